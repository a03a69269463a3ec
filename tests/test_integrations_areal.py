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
