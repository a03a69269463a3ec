"""unisleep's torch_memory_saver native library and whole-process capture, on the host backend
(real memfd memory, torch's real CPU allocator), each case in a child process (capture rewrites
the process's import table).

* the library sits where slime and AReaL look for torch_memory_saver's (next to
  ``dirname(dirname(torch_memory_saver.__file__))``), loads with nothing but libc, and named in
  ``LD_PRELOAD`` makes ``import torch_memory_saver`` give the facade — and changes nothing else;
* ``_impl._binary_wrapper.cdll.tms_*`` (slime's DeepEP patch, tms's nested_region example) are
  real per-thread settings that decide what is captured;
* ``TMS_INIT_ENABLE=1``: plain ``torch.empty``/``torch.full`` from any thread are captured into
  tag "default" (backed up with ``TMS_INIT_ENABLE_CPU_BACKUP=1``), ``pause()`` gives their memory
  back, ``resume()`` maps it at the same address with the bytes, ``disable()`` and a thread that
  turned its interesting region off allocate ordinary memory.

slime is not on the package index (the index's ``slime`` is an unrelated statistics library), so
its side is what its source does (slime/ray/actor_group.py, slime/backends/megatron_utils/
__init__.py, read from THUDM/slime): the names it looks for, the variables it sets, the attributes
its DeepEP patch calls — performed here by the test, not imported from slime.  AReaL's side is its
released package: tests/test_integrations_areal.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import unisleep
from unisleep.compat import shim_dir
from unisleep.compat.torch_memory_saver import NATIVE_NAME, native_library_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACADE = "unisleep.compat.torch_memory_saver"
#: the file names slime/ray/actor_group.py tries, in its order
SLIME_NAMES = ("torch_memory_saver_hook_mode_preload_cu13.abi3.so", "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
               "torch_memory_saver_hook_mode_preload.abi3.so")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TMS_") and k not in ("UNISLEEP_TMS", "LD_PRELOAD", "PYTHONPATH")}
    env.update(UNISLEEP_PLATFORM="host", PYTHONPATH=ROOT)
    env.update(extra)
    return env


def _run(code: str, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the library
@pytest.mark.slow
def test_library_is_where_slime_and_areal_look_and_needs_only_libc():
    import unisleep.compat.torch_memory_saver as facade

    here = os.path.dirname(os.path.dirname(facade.__file__))  # what both compute from __file__
    assert here == os.path.dirname(unisleep.__file__)
    assert os.path.isfile(os.path.join(here, NATIVE_NAME)), (
        f"{NATIVE_NAME} is not built: pip install -e . (or python setup.py build_ext --inplace)")
    assert NATIVE_NAME in SLIME_NAMES and native_library_path() == os.path.join(here, NATIVE_NAME)
    needed = subprocess.run(["readelf", "-d", native_library_path()], capture_output=True, text=True).stdout
    libs = sorted(line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line)
    assert all(lib.startswith(("libc.so", "ld-linux")) for lib in libs), libs  # no device runtime, no Python


@pytest.mark.slow
def test_preloading_brings_the_facade_and_changes_nothing_else(tmp_path):
    so = native_library_path()
    # a non-Python program runs as before
    out = subprocess.run(["/bin/sh", "-c", "echo ok"], capture_output=True, text=True, env=_env(LD_PRELOAD=so))
    assert out.returncode == 0 and out.stdout == "ok\n" and out.stderr == ""
    # Python with only LD_PRELOAD (what slime's Ray actor and AReaL's workers get): the facade
    code = "import os, torch_memory_saver as m; print(m.__name__, os.environ.get('UNISLEEP_TMS'))"
    env = _env(LD_PRELOAD=so)
    env.pop("PYTHONPATH")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [FACADE, "1"]
    # a value the user set wins; the shim folder is added once, in front
    env.update(UNISLEEP_TMS="0", PYTHONPATH=f"{shim_dir()}:/somewhere")
    code = "import os; print(os.environ['UNISLEEP_TMS'], os.environ['PYTHONPATH'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert proc.stdout.split() == ["0", f"{shim_dir()}:/somewhere"], proc.stderr
    # loaded by ctypes (not preloaded): no change to the environment
    proc = _run(f"import ctypes, os; ctypes.CDLL({so!r}); print(os.environ.get('UNISLEEP_TMS'))", _env())
    assert proc.stdout.strip() == "None", proc.stderr


@pytest.mark.slow
def test_the_real_libraries_preload_is_refused_by_name(tmp_path):
    fake = tmp_path / "torch_memory_saver_hook_mode_preload_cu12.abi3.so"
    fake.write_bytes(b"")  # only its name in LD_PRELOAD matters to the check (the loader skips a bad file)
    code = """
        import torch
        from unisleep.compat.torch_memory_saver import TorchMemorySaver
        from unisleep.errors import UnsupportedError
        try:
            TorchMemorySaver().pause()
        except UnsupportedError as e:
            print("refused", "LD_PRELOAD" in str(e) and "python -m unisleep.compat --preload-path" in str(e))
    """
    proc = _run(code, _env(LD_PRELOAD=str(fake)))
    assert "refused True" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- tms's per-thread settings
@pytest.mark.slow
def test_thread_settings_are_tms_settings():
    code = """
        import json, threading
        from unisleep.compat.torch_memory_saver import torch_memory_saver as tms
        tms._ensure_initialized()
        c = tms._impl._binary_wrapper.cdll
        out = {"start": [c.tms_get_interesting_region(), c.tms_get_enable_cpu_backup(), c.tms_get_current_tag().decode(),
                         c.tms_get_cpu_backup_backend().decode(), c.tms_get_enable_disk_backup()]}
        with tms.region(tag="grad_buffer", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            out["inside"] = [c.tms_get_interesting_region(), c.tms_get_enable_cpu_backup(), c.tms_get_current_tag().decode(),
                             c.tms_get_cpu_backup_backend().decode()]
            with tms.disable():
                out["disabled"] = [c.tms_get_interesting_region(), c.tms_get_current_tag().decode()]
            out["after_disable"] = c.tms_get_interesting_region()
        out["after"] = [c.tms_get_interesting_region(), c.tms_get_current_tag().decode(), c.tms_get_cpu_backup_backend().decode()]
        c.tms_set_interesting_region(False)
        seen = []
        t = threading.Thread(target=lambda: seen.append(c.tms_get_interesting_region()))  # per thread, from the env
        t.start(); t.join()
        out["other_thread"], out["this_thread"] = seen[0], c.tms_get_interesting_region()
        print(json.dumps(out))
    """
    got = _json(_run(code, _env(TMS_INIT_CPU_BACKUP_BACKEND="pinned", TMS_INIT_ENABLE_CPU_BACKUP="1")))
    assert got == {
        "start": [False, True, "default", "pinned", False],
        "inside": [True, True, "grad_buffer", "mmap"],
        "disabled": [False, "grad_buffer"],
        "after_disable": True,
        "after": [False, "default", "pinned"],
        "other_thread": False, "this_thread": False,
    }


@pytest.mark.slow
@pytest.mark.parametrize("var,value", [("TMS_INIT_ENABLE", "maybe"), ("TMS_INIT_CPU_BACKUP_BACKEND", "disk")])
def test_init_variables_torch_memory_saver_would_reject_are_refused(var, value):
    code = """
        from unisleep.errors import InvalidArgumentError
        try:
            import torch_memory_saver
            from unisleep.compat.torch_memory_saver import torch_memory_saver as tms
            tms.pause()
        except InvalidArgumentError as e:
            print("refused:", e)
    """
    proc = _run(code, _env(**{var: value, "UNISLEEP_TMS": "1", "PYTHONPATH": f"{shim_dir()}:{ROOT}"}))
    assert f"refused: {var}={value!r}" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- whole-process capture
_CAPTURE = """
    import json, os, threading
    import torch
    import torch_memory_saver
    from torch_memory_saver import torch_memory_saver as tms
    MiB = 1 << 20
    out = {"module": torch_memory_saver.__name__}

    w = torch.full((4 * MiB,), 42, dtype=torch.uint8)      # plain torch, no region: captured
    x = torch.arange(300_000, dtype=torch.int64)
    got = []
    th = threading.Thread(target=lambda: got.append(torch.full((MiB,), 5, dtype=torch.uint8)))
    th.start(); th.join()
    t_other = got[0]
    with tms.region(tag="grad_buffer", enable_cpu_backup=False):
        g = torch.full((2 * MiB,), 9, dtype=torch.uint8)
    with tms.disable():
        plain = torch.full((MiB,), 7, dtype=torch.uint8)   # ordinary memory
    c = tms._impl._binary_wrapper.cdll                       # what slime's DeepEP patch does
    was = c.tms_get_interesting_region()
    c.tms_set_interesting_region(False)
    deep_ep = torch.full((MiB,), 3, dtype=torch.uint8)
    c.tms_set_interesting_region(was)
    after = torch.full((MiB,), 1, dtype=torch.uint8)
    ptrs = [t.data_ptr() for t in (w, x, t_other, g, after)]

    out["tags"] = sorted(tms.state())
    out["resident_default"] = tms.resident_bytes("default")
    out["resident_grad"] = tms.resident_bytes("grad_buffer")
    tms.pause()
    out["paused_resident"] = tms.resident_bytes()
    backup = tms.get_cpu_backup(w, zero_copy=True)
    with tms.disable():  # while paused, work goes in disable() (tms: e.g. slime's weight sync)
        out["plain_usable"] = int(plain.sum()) == 7 * MiB and int(deep_ep.max()) == 3
        out["backup_ok"] = backup is not None and int(backup.min()) == 42
        scratch = torch.full((MiB,), 8, dtype=torch.uint8)
        out["scratch_ok"] = int(scratch.max()) == 8
    tms.resume()
    out["same_addresses"] = ptrs == [t.data_ptr() for t in (w, x, t_other, g, after)]
    out["w_kept"] = int(w.min()) == 42 == int(w.max())
    out["x_kept"] = bool(torch.equal(x, torch.arange(300_000, dtype=torch.int64)))
    out["other_thread_kept"] = int(t_other.min()) == 5
    out["after_kept"] = int(after.min()) == 1
    out["grad_zeroed"] = int(g.max()) == 0   # no backup: thrown away, zeros here
    owned = tms._capture.owned
    del w, x, t_other, g, after, backup, got
    out["freed_back"] = tms._capture.owned < owned
    print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("first", ["torch", "torch_memory_saver"])
def test_whole_process_capture_pauses_plain_torch_allocations(first):
    """Before whole-process capture existed the facade logged a warning for TMS_INIT_ENABLE=1 and
    captured nothing: ``pause()`` freed nothing and the tags were empty.  The program may import
    torch_memory_saver before torch (torch_memory_saver's own training_engine example does): the
    facade then loads torch itself before it hooks torch's allocator library."""
    env = _env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", UNISLEEP_TMS="1",
               PYTHONPATH=f"{shim_dir()}:{ROOT}")
    code = _CAPTURE
    if first == "torch_memory_saver":
        code = code.replace("    import torch\n    import torch_memory_saver\n", "    import torch_memory_saver\n    import torch\n", 1)
        assert code != _CAPTURE
    got = _json(_run(code, env))
    MiB = 1 << 20
    assert got["module"] == FACADE
    assert got["tags"] == ["default", "grad_buffer"]
    # w, x, the other thread's and the last tensor: captured (plus torch's own small tensors of
    # this thread, < 1 MiB); not disable()'s nor DeepEP's (1 MiB each)
    captured = 4 * MiB + 2_400_256 + 2 * MiB
    assert captured <= got["resident_default"] < captured + MiB, got
    assert got["resident_grad"] == 2 * MiB, got
    assert got["paused_resident"] == 0, got
    for k in ("plain_usable", "backup_ok", "scratch_ok", "same_addresses", "w_kept", "x_kept", "other_thread_kept",
              "after_kept", "grad_zeroed", "freed_back"):
        assert got[k] is True, (k, got)


@pytest.mark.slow
def test_slimes_env_and_deep_ep_patch_work_with_the_facade():
    """What slime does, step by step: the driver finds the library through
    ``torch_memory_saver.__file__`` (facade installed there), the train actor gets ``LD_PRELOAD``
    + ``TMS_INIT_ENABLE=1`` + ``TMS_INIT_ENABLE_CPU_BACKUP=1`` (nothing else), imports
    torch_memory_saver, DeepEP's Buffer init turns the interesting region off and back on
    through ``_impl._binary_wrapper.cdll``, then ``pause()``, ``get_cpu_backup(x, zero_copy=True)``
    (its weight conversion), ``disable()`` around the weight sync and ``resume()``."""
    driver = """
        import json, os
        import unisleep.compat
        unisleep.compat.install()
        import torch_memory_saver
        base = os.path.dirname(os.path.dirname(torch_memory_saver.__file__))
        found = [n for n in %r if os.path.exists(os.path.join(base, n))]
        print(json.dumps({"path": os.path.join(base, found[0]) if found else None}))
    """ % (SLIME_NAMES,)
    path = _json(_run(driver, _env()))["path"]
    assert path == native_library_path()
    actor_env = _env(LD_PRELOAD=path, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    actor_env.pop("PYTHONPATH")
    actor_env["UNISLEEP_SRC"] = ROOT
    actor = """
        import json, os, sys
        sys.path.append(os.environ["UNISLEEP_SRC"])  # this source tree (an installed unisleep needs nothing)
        import torch
        from torch_memory_saver import torch_memory_saver
        out = {"facade": type(torch_memory_saver).__module__}
        params = [torch.randn(1 << 18), torch.full((1 << 20,), 2.0)]
        impl = torch_memory_saver._impl
        cdll = impl._binary_wrapper.cdll
        original = cdll.tms_get_interesting_region()
        cdll.tms_set_interesting_region(False)
        deep_ep_buffer = torch.full((1 << 20,), 1, dtype=torch.uint8)
        cdll.tms_set_interesting_region(original)
        with torch_memory_saver.disable():  # (everything else is captured, and paused below)
            ref = [p.clone() for p in params]
        torch_memory_saver.pause()
        out["freed"] = torch_memory_saver.resident_bytes() == 0
        with torch_memory_saver.disable():  # slime's update_weights, which reads the CPU backups
            cpu = [torch_memory_saver.get_cpu_backup(p, zero_copy=True) for p in params]
            out["backup"] = all(c is not None and torch.equal(c, r) for c, r in zip(cpu, ref))
            sync_buffer = torch.cat([c.flatten() for c in cpu])
            out["deep_ep_usable"] = int(deep_ep_buffer.sum()) == 1 << 20
        torch_memory_saver.resume()
        out["restored"] = all(torch.equal(p, r) for p, r in zip(params, ref))
        print(json.dumps(out))
    """
    got = _json(_run(actor, actor_env))
    assert got == {"facade": FACADE, "freed": True, "backup": True, "deep_ep_usable": True, "restored": True}


@pytest.mark.slow
def test_preload_path_helper_prints_the_library():
    proc = _run("import runpy, sys; sys.argv = ['x', '--preload-path']; runpy.run_module('unisleep.compat', run_name='__main__')",
                _env())
    assert proc.returncode == 0 and proc.stdout.strip() == native_library_path(), proc.stderr
