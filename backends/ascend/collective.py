"""Huawei Ascend collective for weight transfer: ``ProcessGroupHCCL`` from torch_npu, built
directly on a prefix store (the stateless-group route; the default group is untouched).
Colocation is keyed by host + physical chip (``ASCEND_RT_VISIBLE_DEVICES`` mapped back)."""

from __future__ import annotations

import datetime
import os
import socket

from unisleep.addresses import is_loopback


BACKEND = "hccl"
SAME_DEVICE_OK = False


def device_key(device_index: int = 0) -> str:
    vis = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")
    chips = [c.strip() for c in vis.split(",") if c.strip()]
    chip = chips[device_index] if device_index < len(chips) else str(device_index)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"npu:{socket.gethostname()}:{boot}:{chip}"


def create_backend(store, rank: int, world_size: int, timeout: datetime.timedelta, device_index: int = 0, *, host: str = ""):
    import torch
    import torch_npu  # noqa: F401  (registers the npu device)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    if host and is_loopback(host):
        # HCCL's host-side sockets (rendezvous, control) on loopback, unless the user chose already
        os.environ.setdefault("HCCL_IF_IP", "127.0.0.1" if ":" not in host else "::1")
    torch.npu.set_device(device_index)
    opts = ProcessGroupHCCL.Options()
    opts._timeout = timeout
    return ProcessGroupHCCL(store, rank, world_size, opts)


def same_device_message(ranks) -> str:
    return (
        f"ranks {sorted(ranks)} of this transfer group are on the same NPU, and HCCL cannot connect two "
        "processes on one NPU: use path='ipc' (or 'auto'; colocated NPU IPC, not yet run on Ascend hardware), "
        "put the engine on another NPU, or send through host memory (TransferGroup.create(..., platform='host'))."
    )
