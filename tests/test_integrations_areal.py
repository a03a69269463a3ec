"""AReaL's torch_memory_saver offload, with AReaL's released package (areal==1.0.4, installed
without its dependencies by the Makefile) and unisleep's facade.

AReaL's ``areal/utils/offload.py`` is loaded from the installed package by its file (importing
the ``areal`` package first would need its whole dependency set: hydra, a CUDA torch stack...);
that module imports nothing but ``os``, ``contextlib`` and ``torch_memory_saver``.  What its
callers do is read from AReaL's source (areal/engine/fsdp_engine.py, areal/infra/scheduler/*):
the schedulers put ``get_tms_env_vars()`` into the workers' environment, the engine sets
``hook_mode = "preload"`` when ``is_tms_enabled()``, and ``offload()``/``onload()`` call
``pause()``/``resume()`` with no ``region()`` anywhere — so a pause frees memory only through
whole-process capture.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from unisleep.compat.torch_memory_saver import native_library_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_spec = importlib.util.find_spec("areal")
OFFLOAD = os.path.join(_spec.submodule_search_locations[0], "utils", "offload.py") if _spec else None
pytestmark = pytest.mark.skipif(OFFLOAD is None or not os.path.exists(OFFLOAD),
                                reason="AReaL is not installed (make test installs areal==1.0.4 --no-deps)")

_LOAD = """
    import importlib.util
    def load_areal_offload(path):
        spec = importlib.util.spec_from_file_location("areal_utils_offload", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TMS_") and k not in ("UNISLEEP_TMS", "LD_PRELOAD", "PYTHONPATH")}
    env.update(UNISLEEP_PLATFORM="host", PYTHONPATH=ROOT, AREAL_OFFLOAD=OFFLOAD)
    env.update(extra)
    return env


def _json(code: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD) + textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_areal_finds_the_preload_library_through_the_facade():
    """Before: AReaL's ``get_tms_env_vars()`` raised ``RuntimeError: LD_PRELOAD so file ...
    does not exist`` under the facade."""
    code = """
        import json, os
        import unisleep.compat
        unisleep.compat.install()
        offload = load_areal_offload(os.environ["AREAL_OFFLOAD"])
        print(json.dumps({"env": offload.get_tms_env_vars(), "saver": type(offload.torch_memory_saver).__module__}))
    """
    got = _json(code, _env())
    assert got == {"env": {"LD_PRELOAD": native_library_path(), "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
                   "saver": "unisleep.compat.torch_memory_saver"}


@pytest.mark.slow
def test_an_areal_worker_pauses_its_model_without_regions():
    """A worker started with exactly the environment AReaL's schedulers give it (and nothing
    else): AReaL's module gets the facade (not its silent MockTorchMemorySaver), the engine's
    ``hook_mode = "preload"`` is accepted, and ``pause()`` (``FSDPEngine.offload``) frees the
    model, optimizer state and activations made with plain torch; ``resume()`` (``onload``)
    brings them back exactly."""
    code = """
        import json, os, sys
        sys.path.append(os.environ["UNISLEEP_SRC"])  # this source tree (an installed unisleep needs nothing)
        import torch
        offload = load_areal_offload(os.environ["AREAL_OFFLOAD"])
        tms = offload.torch_memory_saver
        out = {"saver": type(tms).__module__, "enabled": offload.is_tms_enabled()}
        if offload.is_tms_enabled():
            tms.hook_mode = "preload"  # FSDPEngine.initialize
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(64, 512)).square().mean().backward()
        opt.step()
        with tms.disable():
            want = [p.detach().clone() for p in model.parameters()]
            want_state = [s["exp_avg"].clone() for s in opt.state.values()]
        before = tms.resident_bytes()
        tms.pause()  # FSDPEngine.offload
        out["resident_before"], out["resident_paused"] = before, tms.resident_bytes()
        tms.resume()  # FSDPEngine.onload
        out["params_exact"] = all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want))
        out["state_exact"] = all(torch.equal(s["exp_avg"], w) for s, w in zip(opt.state.values(), want_state))
        model(torch.randn(64, 512)).square().mean().backward()
        opt.step()
        out["trains_again"] = True
        print(json.dumps(out))
    """
    so = native_library_path()
    env = _env(LD_PRELOAD=so, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", UNISLEEP_SRC=ROOT)
    env.pop("PYTHONPATH")
    got = _json(code, env)
    params = (512 * 512 + 512 + 512 * 256 + 256) * 4
    assert got["saver"] == "unisleep.compat.torch_memory_saver" and got["enabled"] is True, got
    assert got["resident_before"] >= 3 * params, got  # weights, gradients, two Adam moments
    assert got["resident_paused"] == 0, got
    assert got["params_exact"] and got["state_exact"] and got["trains_again"], got


# ------------------------------------------------------------------ AReaL's SGLang servers
_sg = importlib.util.find_spec("sglang")
SGLANG_ADAPTER = (os.path.join(_sg.submodule_search_locations[0], "srt", "utils", "torch_memory_saver_adapter.py")
                  if _sg else "")
AREAL_ROOT = os.path.dirname(os.path.dirname(OFFLOAD)) if OFFLOAD else ""

#: AReaL's launcher: unisleep.integrations.areal.install() first (the page's line), then AReaL's
#: own launch_server_cmd (areal/infra/launcher/sglang_server.py) and the cache constants it reads
#: (areal/infra/utils/launcher.py), executed from AReaL's installed files — the modules themselves
#: import AReaL's whole dependency set — starting the server command and waiting for it
_AREAL_LAUNCHER = """
    import ast, getpass, json, logging, os, subprocess, sys, uuid
    import unisleep.integrations.areal
    unisleep.integrations.areal.install()

    def areal_defs(rel, names):
        path = os.path.join(os.environ["AREAL_ROOT"], rel)
        tree = ast.parse(open(path).read(), path)
        keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in names)
                or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") in names for t in n.targets))]
        assert {getattr(n, "name", None) or n.targets[0].id for n in keep} == set(names), (rel, names)
        return ast.Module(body=keep, type_ignores=[]), path

    g = {"os": os, "getpass": getpass, "subprocess": subprocess, "sys": sys, "uuid": uuid,
         "logger": logging.getLogger("SGLangWrapper")}
    for rel, names in (("infra/utils/launcher.py", ["LOCAL_CACHE_DIR", "TRITON_CACHE_PATH"]),
                       ("infra/launcher/sglang_server.py", ["launch_server_cmd"])):
        mod, path = areal_defs(rel, names)
        exec(compile(mod, path, "exec"), g)
    # what SGLangServerWrapper.launch_one_server does with SGLang's command line
    proc = g["launch_server_cmd"]([sys.executable, os.environ["SERVER_SCRIPT"]])
    sys.exit(proc.wait(timeout=200))
"""

#: stands in for `python -m sglang.launch_server --enable-memory-saver ...` (SGLang's server needs
#: sgl_kernel and an accelerator): SGLang's own TorchMemorySaverAdapter, as its model runner and
#: memory pools use it, and a spawn child inside configure_subprocess() as SGLang's engine starts
#: its scheduler
_SGLANG_SERVER = '''
import importlib.util, json, logging, multiprocessing, os, sys
import torch

said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("unisleep.compat").addHandler(Keep())

def adapter_module():
    spec = importlib.util.spec_from_file_location("sglang_tms_adapter", os.environ["SGLANG_ADAPTER"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

def scheduler(q):
    import torch_memory_saver
    q.put(type(torch_memory_saver.torch_memory_saver).__module__)

if __name__ == "__main__":
    out = {"triton_cache": os.environ.get("TRITON_CACHE_PATH", "")}
    adapter = adapter_module().TorchMemorySaverAdapter.create(enable=True)
    import torch_memory_saver
    out["module"], out["enabled"] = type(torch_memory_saver.torch_memory_saver).__module__, adapter.enabled
    with adapter.configure_subprocess():
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=scheduler, args=(q,))
        p.start()
        out["scheduler"] = q.get(timeout=120)
        p.join(60)
    with adapter.region("weights", enable_cpu_backup=True):
        w = torch.full((1 << 18,), 5.0)
    adapter.pause("weights")
    adapter.resume("weights")
    out["weights_intact"] = bool(torch.all(w == 5.0))
    out["said"] = said
    try:
        with adapter.cuda_graph(cuda_graph=None, tag="cuda_graph"):
            pass
        out["cuda_graph"] = "ran"
    except Exception as e:
        out["cuda_graph"] = type(e).__name__ + ": " + str(e)
    print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(SGLANG_ADAPTER),
                    reason="sglang is not installed (make test installs sglang==0.5.10.post1 --no-deps)")
def test_areals_sglang_server_inherits_the_facade_through_its_environ_copy(tmp_path):
    """AReaL starts each SGLang server with ``subprocess.Popen(cmd, env=os.environ.copy() + ...)``
    and no torch_memory_saver variables of its own (those go to trainer workers only), so the
    server gets the facade exactly when the launcher has it.  On the host backend SGLang's
    regions route none of torch's allocations (no pool): the facade says so by name once, keeps
    the bytes, and refuses ``cuda_graph`` with ``UnsupportedError``; on CUDA the same regions
    route through unisleep's pool (tests/cuda/test_compat_tms_capture_cuda.py)."""
    server = tmp_path / "sglang_server.py"
    server.write_text(_SGLANG_SERVER)
    env = _env(AREAL_ROOT=AREAL_ROOT, SGLANG_ADAPTER=SGLANG_ADAPTER, SERVER_SCRIPT=str(server))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_AREAL_LAUNCHER)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(tmp_path))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    got = json.loads(lines[-1][len("RESULT "):])
    facade = "unisleep.compat.torch_memory_saver"
    assert "/triton/" in got["triton_cache"], got  # AReaL's own env update reached the server
    assert got["module"] == facade and got["enabled"] is True and got["scheduler"] == facade, got
    assert got["weights_intact"] is True, got
    assert any("whole-process capture (TMS_INIT_ENABLE=1)" in s for s in got["said"]), got
    assert got["cuda_graph"].startswith("UnsupportedError: cuda_graph() needs an accelerator"), got


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(SGLANG_ADAPTER),
                    reason="sglang is not installed (make test installs sglang==0.5.10.post1 --no-deps)")
def test_without_install_areals_sglang_server_has_no_torch_memory_saver(tmp_path):
    """The control: the same launch without ``install()`` — SGLang's adapter raises the
    ImportError it raises when torch_memory_saver is missing (nothing here installs it)."""
    server = tmp_path / "sglang_server.py"
    server.write_text(_SGLANG_SERVER)
    env = _env(AREAL_ROOT=AREAL_ROOT, SGLANG_ADAPTER=SGLANG_ADAPTER, SERVER_SCRIPT=str(server))
    launcher = textwrap.dedent(_AREAL_LAUNCHER).replace("unisleep.integrations.areal.install()\n", "\n")
    p = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(tmp_path))
    assert p.returncode != 0 and "No module named 'torch_memory_saver'" in p.stdout + p.stderr, p.stderr[-3000:]
