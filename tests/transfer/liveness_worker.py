"""The receiving side of test_transfer_liveness.py, in a process of its own (the test kills it).

    python liveness_worker.py PORT TIMEOUTS

``TIMEOUTS``: comma-separated ``receive(timeout_s=...)`` values, one per receive (``-`` = the
group's timeout).  Every outcome is one JSON line on stdout: ``{"ok": ..., "version": ...,
"type": ..., "msg": ..., "seconds": ..., "exact": ...}``; ``{"ready": true}`` once the group is up.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def weights(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {f"layer.{i}": torch.randn(512, 512, generator=g) for i in range(8)} | {"step": torch.arange(3) * v}


def main() -> int:
    from unisleep.transfer import TransferGroup, WeightReceiver

    port, timeouts = int(sys.argv[1]), sys.argv[2].split(",")
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 1, 2, platform="host", timeout_s=60)
    print(json.dumps({"ready": True}), flush=True)
    tgt = {k: torch.zeros_like(v) for k, v in weights(0).items()}
    rx = WeightReceiver(g, target=tgt)
    for t in timeouts:
        t0 = time.monotonic()
        try:
            r = rx.receive(timeout_s=None if t == "-" else float(t))
            want = weights(int(r.version))
            out = {"ok": True, "version": r.version, "exact": all(torch.equal(tgt[k], want[k]) for k in want)}
        except Exception as e:  # noqa: BLE001
            out = {"ok": False, "type": type(e).__name__, "msg": str(e), "version": rx.version}
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
