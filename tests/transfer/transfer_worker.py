"""One side of the two-process weight-transfer scenario used by test_transfer_processes.py.

    python transfer_worker.py sender|receiver PORT OUT.json

Both sides walk the same steps; every step's outcome (report or exception) goes to OUT.json.
The model is ~100 MB of mixed dtypes (float32, bfloat16 with odd sizes, int64, bool, a 3-byte
uint8, a scalar, an empty tensor, one tensor larger than a bucket); its values are generated from
the version number, so the receiver can check bit for bit what it should hold.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import torch

BUCKET = 16 * 2**20
TIMEOUT_S = 30.0


def model(version: int) -> dict:
    g = torch.Generator().manual_seed(1000 + version)

    def bits(n, dtype):
        x = torch.randint(-(2**31), 2**31 - 1, ((n * torch.empty((), dtype=dtype).element_size() + 3) // 4,),
                          dtype=torch.int32, generator=g)
        return x.view(torch.uint8)[: n * torch.empty((), dtype=dtype).element_size()].view(dtype)

    m = {}
    for i in range(20):
        m[f"layers.{i}.weight"] = bits(1024 * 1024, torch.float32).view(1024, 1024)  # 4 MiB each
    m["embed.weight"] = bits(5 * 2**20, torch.float32).view(5 * 1024, 1024)  # 20 MiB > one bucket
    m["norm.weight"] = bits(4097, torch.bfloat16)
    m["odd.bf16"] = bits(3 * 333, torch.bfloat16).view(3, 333)
    m["steps"] = bits(7, torch.int64)
    m["mask"] = torch.randint(0, 2, (101,), generator=g).bool()
    m["tiny.u8"] = bits(3, torch.uint8)
    m["scalar"] = bits(1, torch.float32).view(())
    m["empty"] = torch.empty(0, 5)
    return m


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def holds(target: dict, version: int) -> bool:
    want = model(version)
    return all(same_bits(target[k], want[k]) for k in want)


def outcome(fn):
    t0 = time.perf_counter()
    try:
        r = fn()
        return {"ok": True, "report": r.as_dict() if r is not None else None, "seconds": time.perf_counter() - t0}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "msg": str(e), "seconds": time.perf_counter() - t0,
                "tb": traceback.format_exc()[-2000:]}


def sender(port: int, out: dict, path_out: str) -> None:
    from unisleep.transfer import TransferGroup

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from faults import FaultySender

    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0, 2, platform="host", timeout_s=TIMEOUT_S)
    out["default_pg_initialized"] = torch.distributed.is_initialized()
    coll = FaultySender(g, bucket_bytes=BUCKET, path="collective")
    ipc = FaultySender(g, bucket_bytes=BUCKET, path="ipc")

    def via(s, v, corrupt=(), drop=()):
        s.corrupt, s.drop = set(corrupt), set(drop)
        return s.send(model(v), v)

    out["v1_collective"] = outcome(lambda: via(coll, 1))
    out["v2_collective_reuse"] = outcome(lambda: via(coll, 2))
    out["v3_ipc"] = outcome(lambda: via(ipc, 3))
    out["v4_corrupt_collective"] = outcome(lambda: via(coll, 4, corrupt={2}))
    out["v5_missing_collective"] = outcome(lambda: via(coll, 5, drop={1}))
    out["v6_corrupt_ipc"] = outcome(lambda: via(ipc, 6, corrupt={0}))
    out["v7_asleep"] = outcome(lambda: via(coll, 7))
    out["v8_after_wake"] = outcome(lambda: via(ipc, 8))
    with open(path_out, "w") as f:  # the next step kills this process
        json.dump(out, f)
    # v9: the sender dies (SIGKILL) after the first buckets are on their way
    m9 = model(9)
    names = list(m9)
    specs = [(n, tuple(t.shape), str(t.dtype)) for n, t in m9.items()]

    def dying():
        for i, n in enumerate(names):
            if i == 12:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            yield n, m9[n]

    coll.corrupt, coll.drop = set(), set()
    coll.send(dying(), 9, specs=specs)


def receiver(port: int, out: dict, path_out: str) -> None:
    from unisleep import MemoryLifecycle
    from unisleep.errors import InvalidTransitionError
    from unisleep.transfer import TransferGroup, WeightReceiver

    target = {k: torch.zeros_like(t) for k, t in model(0).items()}
    lc = MemoryLifecycle("host")
    lc.adopt(target, tag="weights")
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 1, 2, platform="host", timeout_s=TIMEOUT_S)
    out["default_pg_initialized"] = torch.distributed.is_initialized()
    # staged: its corrupt and missing updates must leave the previous version serving untouched
    rx = WeightReceiver(g, target=target, guard=lc, staged=True)

    def step(name, expect_version):
        out[name] = outcome(rx.receive)
        out[name]["version_after"] = rx.version
        out[name]["holds_expected"] = holds(target, expect_version)
        with open(path_out, "w") as f:
            json.dump(out, f)

    step("v1_collective", 1)
    step("v2_collective_reuse", 2)
    step("v3_ipc", 3)
    step("v4_corrupt_collective", 3)
    step("v5_missing_collective", 3)
    step("v6_corrupt_ipc", 3)
    lc.sleep(level=1)
    out["v7_asleep"] = outcome(rx.receive)
    out["v7_asleep"]["is_invalid_transition"] = out["v7_asleep"].get("type") == InvalidTransitionError.__name__
    lc.wake_up()
    out["v7_asleep"]["version_after"] = rx.version
    out["v7_asleep"]["holds_expected"] = holds(target, 3)
    step("v8_after_wake", 8)
    step("v9_sender_killed", 8)
    step("v10_after_sender_death", 8)  # at once: the sender is gone, recreate the group


def main() -> int:
    role, port, path_out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out: dict = {"role": role}
    try:
        (sender if role == "sender" else receiver)(port, out, path_out)
    except Exception:
        out["crash"] = traceback.format_exc()
    with open(path_out, "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
