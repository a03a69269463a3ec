"""slime's own source driving unisleep's torch_memory_saver facade.

slime (THUDM/slime) is not on the package index (the index's ``slime`` is an unrelated statistics
library), so CI cannot install it and this test skips there.  It runs wherever a checkout of
slime is given::

    git clone https://github.com/THUDM/slime /path/to/slime
    UNISLEEP_SLIME_SOURCE=/path/to/slime python -m pytest tests/integrations/test_slime_source.py

Nothing of slime is copied here: the test reads slime's files when it runs and executes, as slime
runs them, the two pieces of slime that touch torch_memory_saver —

* the driver's offload block of ``RayTrainGroup._allocate_gpus_for_actor``
  (``slime/ray/actor_group.py``): finds the library through ``torch_memory_saver.__file__`` and
  writes ``LD_PRELOAD``, ``TMS_INIT_ENABLE`` and ``TMS_INIT_ENABLE_CPU_BACKUP`` into the train
  actor's environment;
* the DeepEP patch of ``slime/backends/megatron_utils/__init__.py`` (with slime's own
  ``slime.utils.accelerator``): turns the thread's interesting region off around
  ``deep_ep.Buffer.__init__`` through ``torch_memory_saver._impl._binary_wrapper.cdll``.

The actor process is started with exactly the environment slime's block wrote.  Only DeepEP is
stood in for (it needs NVSHMEM and a GPU): a ``deep_ep`` module whose ``Buffer.__init__``
allocates its buffer with torch, as DeepEP's does.  On the host backend (this machine) the
allocations are torch's CPU ones, captured by whole-process capture.  A CPU-only torch build
refuses the ``torch.cuda.synchronize()`` slime's patch makes after the buffer is made when no
accelerator is selected (``AssertionError``, where a CUDA build without a GPU raises the
``RuntimeError`` slime expects): that one error, after the patch restored the thread's setting,
is what slime's own code does on such a build and is accepted by name; every check of the facade
comes before it or does not depend on it.  The in-repository test that performs the same steps
without slime's files is ``tests/test_compat_tms_native.py::test_slimes_env_and_deep_ep_patch_work_with_the_facade``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from unisleep.compat import shim_dir
from unisleep.compat.torch_memory_saver import native_library_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.environ.get("UNISLEEP_SLIME_SOURCE", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.isfile(os.path.join(SOURCE, "slime", "ray", "actor_group.py")),
        reason="needs slime's source (slime is not on the package index): git clone https://github.com/THUDM/slime "
               "and set UNISLEEP_SLIME_SOURCE to that folder"),
]

#: executes, from slime's file, the body of the ``if ... offload_train ...`` block of
#: RayTrainGroup._allocate_gpus_for_actor with an empty env_vars; prints what it wrote
_DRIVER = """
    import ast, json, os, sys
    path = os.path.join(os.environ["UNISLEEP_SLIME_SOURCE"], "slime", "ray", "actor_group.py")
    tree = ast.parse(open(path).read(), path)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_allocate_gpus_for_actor")
    block = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and "offload_train" in ast.unparse(n.test))
    env_vars = {}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), path, "exec"), {"os": os, "env_vars": env_vars})
    print(json.dumps(env_vars))
"""

#: the train actor: slime's DeepEP patch (its file's ``try:`` block importing deep_ep) over a
#: stand-in DeepEP, then pause / get_cpu_backup / resume as slime's actor does
_ACTOR = """
    import ast, importlib, json, logging, os, sys, types
    src = os.environ["UNISLEEP_SLIME_SOURCE"]
    sys.path.append(src)
    sys.path.append(os.environ["UNISLEEP_SRC"])  # this source tree (an installed unisleep needs nothing)
    import torch

    made = []
    class Buffer:  # stand-in for DeepEP's Buffer: it allocates its persistent buffer with torch
        def __init__(self, *args, **kwargs):
            from torch_memory_saver import torch_memory_saver as tms
            self.interesting = bool(tms._impl._binary_wrapper.cdll.tms_get_interesting_region())
            self.buf = torch.full((1 << 20,), 3, dtype=torch.uint8)
            made.append(self)
    sys.modules["deep_ep"] = types.SimpleNamespace(Buffer=Buffer)

    from torch_memory_saver import torch_memory_saver
    out = {"facade": type(torch_memory_saver).__module__}
    params = [torch.randn(1 << 18), torch.full((1 << 20,), 2.0)]
    cdll = torch_memory_saver._impl._binary_wrapper.cdll

    path = os.path.join(src, "slime", "backends", "megatron_utils", "__init__.py")
    tree = ast.parse(open(path).read(), path)
    patch = next(n for n in tree.body if isinstance(n, ast.Try) and "deep_ep" in ast.unparse(n.body[0]))
    accelerator = importlib.import_module("slime.utils.accelerator")
    exec(compile(ast.Module(body=[patch], type_ignores=[]), path, "exec"),
         {"torch": torch, "accelerator": accelerator, "logging": logging})
    out["patched"] = Buffer.__init__.__name__ == "new_init"
    before = bool(cdll.tms_get_interesting_region())
    try:
        Buffer()
        out["after_init"] = "returned"
    except AssertionError as e:  # a CPU-only torch build refuses torch.cuda.synchronize()
        out["after_init"] = "cpu-only torch: " + str(e)
    out["region_off_inside"] = made[0].interesting is False
    out["region_restored"] = bool(cdll.tms_get_interesting_region()) == before is True

    with torch_memory_saver.disable():
        ref = [p.clone() for p in params]
    torch_memory_saver.pause()
    out["freed"] = torch_memory_saver.resident_bytes() == 0
    with torch_memory_saver.disable():  # slime's weight sync reads the CPU backups
        cpu = [torch_memory_saver.get_cpu_backup(p, zero_copy=True) for p in params]
        out["backup"] = all(c is not None and torch.equal(c, r) for c, r in zip(cpu, ref))
        out["deep_ep_usable"] = int(made[0].buf.max()) == 3 == int(made[0].buf.min())
    torch_memory_saver.resume()
    out["restored"] = all(torch.equal(p, r) for p, r in zip(params, ref))
    print(json.dumps(out))
"""


def _run(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TMS_") and k not in ("UNISLEEP_TMS", "LD_PRELOAD", "PYTHONPATH")}
    env.setdefault("UNISLEEP_PLATFORM", "host")
    return env


def test_slimes_own_offload_code_runs_on_the_facade():
    driver_env = _base_env()
    driver_env.update(UNISLEEP_TMS="1", PYTHONPATH=f"{shim_dir()}:{ROOT}")
    env_vars = _run(_DRIVER, driver_env)
    # slime's block found unisleep's native library where it looks, and wrote exactly these
    assert env_vars == {"LD_PRELOAD": native_library_path(), "TMS_INIT_ENABLE": "1",
                        "TMS_INIT_ENABLE_CPU_BACKUP": "1"}, env_vars

    actor_env = _base_env()
    actor_env.update(env_vars)
    actor_env["UNISLEEP_SRC"] = ROOT
    got = _run(_ACTOR, actor_env)
    assert got.pop("after_init") in ("returned", "cpu-only torch: Torch not compiled with CUDA enabled"), got
    assert got == {"facade": "unisleep.compat.torch_memory_saver", "patched": True, "region_off_inside": True,
                   "region_restored": True, "freed": True, "backup": True, "deep_ep_usable": True,
                   "restored": True}, got
