"""AMD collective for weight transfer: torch's "nccl" backend, which on a ROCm build of torch is
RCCL, built directly on a prefix store.  Colocation is keyed by the GPU UUID.

Two ranks on one GPU use colocated IPC instead (``ipc.py``: exported POSIX fds, never
``hipIpcGetMemHandle``, which does not reject VMM memory and has crashed kernels with it,
ROCm/clr #265)."""

from __future__ import annotations

BACKEND = "nccl"  # RCCL on ROCm builds of torch
SAME_DEVICE_OK = False

# the group itself is torch's ProcessGroupNCCL, exactly as on NVIDIA
from unisleep.backends.cuda.collective import create_backend  # noqa: E402,F401


def device_key(device_index: int = 0) -> str:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    return f"gpu:{uuid if uuid is not None else device_index}"


def same_device_message(ranks) -> str:
    return (
        f"ranks {sorted(ranks)} of this transfer group are on the same GPU, and RCCL cannot connect two "
        "processes on one GPU: send over colocated IPC (the group's IPC path, taken for ranks on one GPU), "
        "put the engine on another GPU, or send through host memory (TransferGroup.create(..., platform='host'))."
    )
