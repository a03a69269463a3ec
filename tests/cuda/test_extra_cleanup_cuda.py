"""Extra cleanup on an NVIDIA GPU (marker ``cuda``; CPU CI skips these).

* group part: two real processes share one GPU (gloo over 127.0.0.1 with CUDA tensors — NCCL
  refuses two ranks on one GPU); with two or more GPUs the platform's collective backend runs
  too, one GPU per rank.  The group is destroyed on sleep and a new one all-reduces correctly
  after the wake;
* graph part: a real CUDA graph reading lifecycle memory is released on sleep (its private
  pool is given back: ``memory_reserved`` drops) and recaptured only on wakes that cover the
  KV cache; the recaptured graph computes the right value.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep import MemoryLifecycle  # noqa: E402
from unisleep.extra_cleanup import ExtraCleanup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from unisleep import MemoryLifecycle
    from unisleep.errors import InvalidTransitionError
    from unisleep.extra_cleanup import ExtraCleanup

    rank, world, port, backend, same_gpu = int(sys.argv[1]), 2, int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    dev = 0 if same_gpu else rank
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lc = MemoryLifecycle("cuda", device=dev)
    w = lc.empty((1 << 20,), torch.uint8, tag="weights"); w.fill_(rank + 1)
    kv = lc.empty((1 << 20,), torch.uint8, tag="kv_cache")
    calls = {"capture": 0}
    cleanup = ExtraCleanup().install(lc)
    cleanup.add_group("tp", ranks=[0, 1], backend=backend)
    cleanup.add_graphs("g", capture=lambda: calls.__setitem__("capture", calls["capture"] + 1))

    def allreduce():
        t = torch.full((4,), float(rank + 1), device=f"cuda:{dev}")
        dist.all_reduce(t, group=cleanup.group("tp"))
        torch.cuda.synchronize()
        return t[0].item()

    out = {"start": allreduce()}
    free_awake = torch.cuda.mem_get_info(dev)[0]
    lc.sleep(level=2)
    try:
        cleanup.group("tp"); out["asleep_access"] = True
    except InvalidTransitionError:
        out["asleep_access"] = False
    out["freed"] = torch.cuda.mem_get_info(dev)[0] - free_awake
    lc.wake_up(["weights"])
    out["weights_sum"], out["weights_capture"] = allreduce(), calls["capture"]
    lc.wake_up(["kv_cache"])
    out["kv_sum"], out["kv_capture"] = allreduce(), calls["capture"]
    lc.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def _backends():
    out = [pytest.param("gloo", True, id="gloo-two-processes-one-gpu")]
    from unisleep.registry import backend

    out.append(pytest.param(backend("cuda").collective_module().BACKEND, False, id="platform-backend-one-gpu-per-rank",
                            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")))
    return out


@pytest.mark.parametrize("backend,same_gpu", _backends())
def test_extra_cleanup_cuda_groups_two_processes(backend, same_gpu):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(port), backend, "1" if same_gpu else "0"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        assert r["start"] == 3.0
        assert r["asleep_access"] is False
        assert r["freed"] > 0  # the lifecycle's memory really left the GPU
        assert r["weights_sum"] == 3.0 and r["weights_capture"] == 0  # groups back; no capture on weights
        assert r["kv_sum"] == 3.0 and r["kv_capture"] == 1


def test_extra_cleanup_cuda_graphs_recaptured_only_on_kv_wakes():
    lc = MemoryLifecycle("cuda")
    try:
        kv = lc.empty((N,), torch.float32, tag="kv_cache")
        w = lc.empty((N,), torch.float32, tag="weights")
        kv.fill_(1.0)
        w.fill_(2.0)
        state: dict = {}
        counts = {"capture": 0, "release": 0}

        def capture():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture
                (kv * w).sum()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = (kv * w).sum()
            state["g"], state["out"] = g, out
            counts["capture"] += 1

        def release():
            state["g"].reset()
            state.clear()
            counts["release"] += 1

        capture()
        cleanup = ExtraCleanup().install(lc)
        cleanup.add_graphs("decode", capture=capture, release=release)

        state["g"].replay()
        torch.cuda.synchronize()
        assert state["out"].item() == 2.0 * N
        reserved_with_graph = torch.cuda.memory_reserved()

        lc.sleep(level=1)
        torch.cuda.empty_cache()
        assert counts["release"] == 1 and not state
        assert torch.cuda.memory_reserved() < reserved_with_graph  # the graph pool went back

        lc.wake_up()  # all tags: recapture
        assert counts["capture"] == 2
        kv.fill_(3.0)  # discarded KV came back zeroed; new contents
        state["g"].replay()
        torch.cuda.synchronize()
        assert state["out"].item() == 6.0 * N  # weights restored (2) x new KV (3)

        lc.sleep(level=2)
        lc.wake_up(["weights"])
        assert counts["capture"] == 2 and not state  # never after a weights-only wake
        w.fill_(5.0)  # the weight update
        lc.wake_up(["kv_cache"])
        assert counts["capture"] == 3
        kv.fill_(1.0)
        state["g"].replay()
        torch.cuda.synchronize()
        assert state["out"].item() == 5.0 * N
        lc.wake_up()  # nothing asleep: no recapture
        assert counts["capture"] == 3
    finally:
        lc.close()
