"""AMD collective for weight transfer: torch's "nccl" backend, which on a ROCm build of torch is
RCCL, built directly on a prefix store.  Colocation is keyed by the GPU UUID.

Colocated IPC is not implemented for ROCm yet (``hipIpcGetMemHandle`` does not reject VMM memory
and has crashed kernels with it, ROCm/clr #265; the safe route is hipMemExportToShareableHandle
with a POSIX fd, like backends/cuda/ipc.py)."""

from __future__ import annotations

import datetime

BACKEND = "nccl"  # RCCL on ROCm builds of torch
SAME_DEVICE_OK = False
IPC_MODULE = None


def device_key(device_index: int = 0) -> str:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    return f"gpu:{uuid if uuid is not None else device_index}"


def create_backend(store, rank: int, world_size: int, timeout: datetime.timedelta, device_index: int = 0, *, host: str = ""):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device_index)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def same_device_message(ranks) -> str:
    return (
        f"ranks {sorted(ranks)} of this transfer group are on the same GPU, and RCCL cannot connect two "
        "processes on one GPU. Colocated IPC for ROCm is not implemented yet: put the engine on another GPU "
        "or send through host memory (a gloo group: TransferGroup.create(..., platform='host'))."
    )
