"""One side of test_ascend_sim_ipc_transfer.py: the transfer's whole IPC path with the Ascend
ipc module over the SIMULATED ACL library (tests/sim/fake_acl.py), no Ascend hardware.

    python ascend_sim_ipc_worker.py sender|receiver PORT DRIVER_DIR OUT.json

What stands in, and why: the group runs on the host platform (CPU tensors, gloo-free IPC path)
because no torch_npu runs here; only its ipc module is replaced by the Ascend one, whose device
memory is the simulator's host memory (``TENSOR_DEVICE = "cpu"``).  So the sender's and the
receiver's IPC code (handshake, per-receiver whitelist by SO_PEERCRED pid, handle in the ``buf``
message, import, verify, hand-back) run as written; the NPU copies do not.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for sim

BUCKET = 2 << 20


def model(version: int) -> dict:
    g = torch.Generator().manual_seed(500 + version)
    m = {f"layers.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(6)}  # 1 MiB each
    m["embed.weight"] = torch.randn(3 << 18, generator=g)  # 3 MiB: more than a bucket
    m["tiny"] = torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g)
    return m


def main() -> int:
    role, port, driver_dir, path_out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    out: dict = {"role": role, "pid": os.getpid()}
    try:
        from sim.fake_acl import FakeAcl
        from unisleep.backends.ascend import ipc as ascend_ipc
        from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

        lib = FakeAcl(driver_dir=driver_dir, granularity=2 << 20, total_bytes=256 << 20)
        ascend_ipc.use_library(lib)
        ascend_ipc.TENSOR_DEVICE = "cpu"
        rank = 0 if role == "sender" else 1
        g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, platform="host", timeout_s=30)
        object.__setattr__(g.platform.backend, "ipc", "unisleep.backends.ascend.ipc")  # the stand-in (above)
        assert g.ipc_module() is ascend_ipc
        if role == "sender":
            s = WeightSender(g, bucket_bytes=BUCKET, path="ipc", keep_buffers=True)
            out["reports"] = [s.send(model(v), v).as_dict() for v in (1, 2)]
            out["exports"] = [e[3] for e in lib.dev.log if e[0] == "aclrtMemExportToShareableHandle"]
            out["whitelists"] = []
            for name in sorted(os.listdir(driver_dir)):
                if name.startswith("share-") and name.endswith(".json"):
                    with open(os.path.join(driver_dir, name)) as f:
                        out["whitelists"].append(sorted(json.load(f)["pids"]))
            g.close()
        else:
            target = {k: torch.zeros_like(t) for k, t in model(0).items()}
            rx = WeightReceiver(g, target=target)
            out["holds"] = []
            for v in (1, 2):
                out.setdefault("reports", []).append(rx.receive().as_dict())
                want = model(v)
                out["holds"].append(all(torch.equal(target[k], want[k]) for k in want))
            out["imports"] = sum(1 for e in lib.dev.log if e[0] == "aclrtMemImportFromShareableHandle")
            g.close()
        out["errors"] = [e[1:] for e in lib.dev.log if e[0] == "error"
                         and e[1:3] != ("aclrtGetDevice", 107002)]  # "no context" is the question
        out["internal_errors"] = [repr(e) for e in lib.dev.internal_errors]
    except Exception:
        out["crash"] = traceback.format_exc()
    with open(path_out, "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
