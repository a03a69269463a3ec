"""vLLM's sleep-mode contract on the GPU, through vLLM's own code (extracted from its wheel by
``python tools/vllm_contract/fetch.py``): the ``unisleep`` backend and vLLM's ``cumem`` backend
side by side in one process — weights/KV/runtime/graph pools, level 1 and 2, selective wake,
discard; bytes exact, graph replays exact, memory freed (cuMemGetInfo).  Small sizes here; the
8 GiB + 16 GiB timing run is ``tools/vllm_contract/harness.py`` (docs/vllm.md).

Every extracted tree runs: ``vllm_pkg/`` (``fetch.py``) and each ``vllm_pkg-<version>/``
(``fetch.py --version X``), or only ``$VLLM_CONTRACT_PKG`` when it is set; each version's
config takes the route that version offers (the harness's ``contract`` in the JSON).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools", "vllm_contract")
HARNESS = os.path.join(TOOLS, "harness.py")
TREES = ([os.environ["VLLM_CONTRACT_PKG"]] if os.environ.get("VLLM_CONTRACT_PKG") else
         sorted(d for d in glob.glob(os.path.join(TOOLS, "vllm_pkg*")) if os.path.isdir(os.path.join(d, "vllm"))))

def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


# the GPU first: without one, fetching vLLM's modules would not make these tests run
pytestmark = [
    pytest.mark.skipif(_gpus() < 1, reason="needs an NVIDIA GPU with a CUDA build of torch (none here); on one, "
                                           "also vLLM's sleep-mode modules: python tools/vllm_contract/fetch.py"),
    pytest.mark.skipif(
        _gpus() >= 1 and not TREES,
        reason="needs vLLM's sleep-mode modules extracted from its wheel: run "
               "`python tools/vllm_contract/fetch.py` on a machine with a package registry"),
]


@pytest.fixture(scope="module", params=TREES or [None], ids=lambda t: os.path.basename(t) if t else "none")
def contract(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("contract") / "contract.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, HARNESS, "--vllm-pkg", request.param, "--weights-gib", "0.5", "--kv-gib", "1",
                        "--weight-tensors", "8", "--kv-tensors", "4", "--cycles", "2",
                        "--settle-s", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout + p.stderr


@pytest.mark.parametrize("backend", ["unisleep", "cumem"])
def test_every_check_passes(contract, backend):
    data, log = contract
    b = data["backends"][backend]
    failed = [c for c in b["checks"] if not c["ok"]]
    assert not failed, f"{backend}: {failed}\n{log[-3000:]}"
    assert len(b["checks"]) > 20  # the whole sequence ran


def test_unisleep_backend_uses_the_lifecycle_allocator(contract):
    data, _ = contract
    c = data["contract"]
    # the route each version offers: the unisleep backend where --sleep-mode-backend exists (0.33),
    # vLLM's cumem backend over unisleep's allocator (0.25-0.32), the worker's calls (0.24)
    want = ("UnisleepSleepBackend" if c["sleep_mode_backend_flag"] else
            "CuMemBackend" if c["sleep_mode_backend_factory"] else "WorkerCalls")
    assert data["backends"]["unisleep"]["allocator"] == "UnisleepAllocator"
    assert data["backends"]["unisleep"]["backend"] == want, c
    assert data["backends"]["cumem"]["allocator"] == "CuMemAllocator"


def test_same_memory_freed_as_vllm(contract):
    data, _ = contract
    u, c = data["backends"]["unisleep"]["memory"], data["backends"]["cumem"]["memory"]
    gib = 1 << 30
    keys = ["first_sleep_freed_bytes", "l2_sleep_freed_bytes"]
    if data["contract"]["allocator_discard"]:  # the discard step runs from vLLM 0.28
        keys.append("discard_freed_bytes")
    for key in keys:
        # unisleep frees at least what vLLM frees (within one 2 MiB granule per tensor)
        assert u[key] >= c[key] - 64 * (2 << 20), (key, u[key] / gib, c[key] / gib)


def test_the_first_sleep_found_its_room_prepared(contract):
    """The allocator prepared the first level-1 sleep's backup room while the engine started (the
    weights and the runtime buffer), the start waited for it before the KV cache, and the first
    sleep's copies found it registered; the harness prints the sleep's breakdown beside a steady one."""
    data, log = contract
    b = data["backends"]["unisleep"]["breakdown"]
    first, steady = b["first_sleep"], b["steady_sleep"]
    room = first["before"]["backup_room"]
    assert room["error"] is None and room["bytes"] >= int(0.5 * (1 << 30)), room
    for k in (first, steady):
        assert {t["what"] for t in k["traces"]} == {"sleep", "suspend"}, k["traces"]
    sus = next(t for t in first["traces"] if t["what"] == "suspend")
    assert sus["arena_bytes"] >= int(0.5 * (1 << 30)) and sus["copy_bytes"] >= int(0.5 * (1 << 30)), sus
    assert "unisleep sleep, phase (ms)" in log and "queue the copies" in log
