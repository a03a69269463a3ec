"""Weight transfer over NCCL between two GPUs (two spawned processes, one per GPU).

Run on a machine with >= 2 GPUs:  pytest -q -m cuda tests/cuda/test_nccl.py
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(version: int, device: str) -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(version)
    m = {f"layers.{i}.weight": torch.randn(2048, 2048, device=device, generator=g, dtype=torch.bfloat16) for i in range(16)}
    m["embed.weight"] = torch.randn(16000, 2048, device=device, generator=g)  # larger than a bucket
    m["steps"] = torch.arange(9, device=device) * version
    return m


def _side(rank: int, port: int, q) -> None:
    try:
        import torch

        from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

        dev = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=120)
        res = {"rank": rank, "colocated": g.colocated, "backend": g.backend}
        if rank == 0:
            tx = WeightSender(g, bucket_bytes=64 * 2**20)
            res["path"] = tx.resolve_path()
            res["reports"] = [tx.send(model(v, dev), v).as_dict() for v in (1, 2)]
        else:
            tgt = {k: torch.zeros_like(v) for k, v in model(0, dev).items()}
            rx = WeightReceiver(g, target=tgt)
            res["exact"] = []
            for v in (1, 2):
                rx.receive()
                want = model(v, dev)
                res["exact"].append(all(torch.equal(tgt[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8))
                                        for k in want))
            res["version"] = rx.version
        g.close()
        q.put(res)
    except BaseException:
        q.put({"rank": rank, "error": traceback.format_exc()})


@pytest.mark.skipif(_gpus() < 2, reason="needs at least 2 NVIDIA GPUs")
def test_nccl_two_gpus_bit_exact():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    ps = [ctx.Process(target=_side, args=(r, port, q)) for r in (0, 1)]
    [p.start() for p in ps]
    out = {}
    try:
        for _ in ps:
            res = q.get(timeout=300)
            out[res["rank"]] = res
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert "error" not in out[r], f"rank {r}:\n{out[r]['error']}"
    assert out[0]["backend"] == "nccl" and not out[0]["colocated"]
    assert out[0]["path"] == "collective"
    assert out[1]["exact"] == [True, True] and out[1]["version"] == 2
