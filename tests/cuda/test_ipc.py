"""Colocated weight transfer on one NVIDIA GPU: two processes (spawned), cuMem POSIX-fd IPC.

Run on a GPU machine:  pytest -q -m cuda tests/cuda/test_ipc.py
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import pytest

pytestmark = pytest.mark.cuda


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _no_bindings() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except Exception:
        return True
    return False


needs_gpu = pytest.mark.skipif(_gpus() < 1, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
# (only where there is a GPU: without one, the GPU is what is missing first, and the skip says that)
needs_bindings = pytest.mark.skipif(_gpus() >= 1 and _no_bindings(), reason="needs cuda-bindings (pip install "
                                    "'unisleep[cuda12]' or '[cuda13]', the major of torch's CUDA build)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(version: int, device: str = "cuda:0") -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(version)
    m = {f"layers.{i}.weight": torch.randn(2048, 2048, device=device, generator=g, dtype=torch.bfloat16) for i in range(24)}
    m["embed.weight"] = torch.randn(32000, 1024, device=device, generator=g)  # 125 MiB: larger than a bucket
    m["norm.weight"] = torch.randn(4097, device=device, generator=g).to(torch.bfloat16)
    m["steps"] = torch.arange(7, device=device) * version
    m["empty"] = torch.empty(0, 3, device=device)
    return m


def _same(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _side(rank: int, port: int, q, use_lifecycle: bool) -> None:
    try:
        import torch

        from unisleep.errors import UnsupportedError
        from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

        torch.cuda.set_device(0)
        g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=60)
        res = {"rank": rank, "colocated": g.colocated, "platform": g.platform.name}
        if rank == 0:
            src = model(1)
            if use_lifecycle:  # weights in lifecycle (cuMem) memory: plain cudaIpc would reject them
                from unisleep import MemoryLifecycle

                lc = MemoryLifecycle()
                lc.adopt(src, tag="weights")
            try:
                WeightSender(g, path="collective").resolve_path()
                res["collective_refusal"] = None
            except UnsupportedError as e:
                res["collective_refusal"] = str(e)
            tx = WeightSender(g, bucket_bytes=64 * 2**20)
            res["path"] = tx.resolve_path()
            r1 = tx.send(src, 1)
            r2 = tx.send(model(2), 2)
            res["reports"] = [r1.as_dict(), r2.as_dict()]
        else:
            tgt = {k: torch.zeros_like(v) for k, v in model(0).items()}
            rx = WeightReceiver(g, target=tgt)
            r1 = rx.receive()
            res["v1_exact"] = all(_same(tgt[k], v) for k, v in model(1).items())
            r2 = rx.receive()
            res["v2_exact"] = all(_same(tgt[k], v) for k, v in model(2).items())
            res["reports"] = [r1.as_dict(), r2.as_dict()]
            res["version"] = rx.version
        q.put(res)
    except BaseException:
        q.put({"rank": rank, "error": traceback.format_exc()})


def _run(use_lifecycle: bool):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    ps = [ctx.Process(target=_side, args=(r, port, q, use_lifecycle)) for r in (0, 1)]
    [p.start() for p in ps]
    out = {}
    try:
        for _ in ps:
            res = q.get(timeout=240)
            out[res["rank"]] = res
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert "error" not in out[r], f"rank {r}:\n{out[r]['error']}"
    return out


@needs_gpu
@needs_bindings
def test_ipc_one_gpu_bit_exact():
    out = _run(use_lifecycle=False)
    s, r = out[0], out[1]
    assert s["platform"] == "cuda" and s["colocated"] and r["colocated"]
    assert s["path"] == "ipc"
    assert r["v1_exact"] and r["v2_exact"] and r["version"] == 2
    assert all(rep["path"] == "ipc" for rep in r["reports"])
    assert r["reports"][1]["metadata_reused"] is True
    # NCCL between two processes on one GPU is refused with the reason and the alternative
    assert s["collective_refusal"] and "same GPU" in s["collective_refusal"] and "ipc" in s["collective_refusal"].lower()
    print("ipc reports:", s["reports"])


@needs_gpu
@needs_bindings
def test_ipc_from_lifecycle_memory():
    # no skip when the lifecycle fails here: with a GPU and cuda-bindings present, that failure is unisleep's
    out = _run(use_lifecycle=True)
    assert out[1]["v1_exact"] and out[1]["v2_exact"]


def _side_residue(rank: int, port: int, q, barrier) -> None:
    """Four updates over colocated IPC; around the third (default: buffers made per update) and
    the fourth (``keep_buffers=True``) both sides empty their allocator caches and rank 0 reads
    the device's free memory (cuMemGetInfo) with the other side waiting."""
    try:
        import torch

        from unisleep import keyed_hash
        from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

        torch.cuda.set_device(0)
        g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=60)
        res = {"rank": rank, "free": [], "allocated": [], "held": [], "layouts": [], "phases": []}
        tx = rx = None
        if rank == 0:
            tx = WeightSender(g, bucket_bytes=64 * 2**20)
        else:
            tgt = {k: torch.zeros_like(v) for k, v in model(0).items()}
            rx = WeightReceiver(g, target=tgt)

        def settle():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            barrier.wait()
            res["allocated"].append(torch.cuda.memory_allocated())
            res["held"].append((tx or rx).buffer_bytes())
            res["layouts"].append(len(keyed_hash._LAYOUTS))
            if rank == 0:
                res["free"].append(torch.cuda.mem_get_info()[0])
            barrier.wait()

        for v in (1, 2, 3, 4):
            if v == 3:
                settle()
            if rank == 0:
                tx.keep_buffers = v == 4
                res["phases"].append(tx.send(model(v), v).phases)
            else:
                res["phases"].append(rx.receive().phases)
            if v >= 3:
                settle()
        if rank == 1:
            res["exact"] = all(_same(tgt[k], w) for k, w in model(4).items())
        q.put(res)
    except BaseException:
        q.put({"rank": rank, "error": traceback.format_exc()})


@needs_gpu
@needs_bindings
def test_an_update_leaves_no_device_memory_behind():
    """After an update (the default: bucket memory made per update), the device has as much free
    memory as before it, each side's allocator holds what it held before, neither side holds
    bucket memory or the hash's block tables; with ``keep_buffers=True`` the buckets stay (so the
    measure can see them)."""
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    port = _port()
    ps = [ctx.Process(target=_side_residue, args=(r, port, q, barrier)) for r in (0, 1)]
    [p.start() for p in ps]
    out = {}
    try:
        for _ in ps:
            res = q.get(timeout=240)
            out[res["rank"]] = res
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert "error" not in out[r], f"rank {r}:\n{out[r]['error']}"
    s, r = out[0], out[1]
    assert r["exact"]
    MiB = 2**20
    before, after, kept = s["free"]
    print("free MiB before/after/kept:", before / MiB, after / MiB, kept / MiB, "phases:", s["phases"][2], r["phases"][2])
    assert after >= before - 2 * MiB, f"the update left {(before - after) / MiB:.1f} MiB of device memory behind"
    for side in (s, r):
        a0, a1, _ = side["allocated"]
        assert abs(a1 - a0) <= MiB, f"rank {side['rank']}: its allocator holds {(a1 - a0) / MiB:.1f} MiB more"
        assert side["held"][:2] == [0, 0] and side["layouts"][:2] == [0, 0], side
        assert side["held"][2] > 0  # keep_buffers=True: the buffers (and tables) stay, and are counted
    assert kept <= after - 64 * MiB, "with keep_buffers=True the buckets should still take device memory"
