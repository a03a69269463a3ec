"""NVIDIA collective for weight transfer: a ``ProcessGroupNCCL`` built directly on a prefix store
(no default process group), and the device identity used to detect colocation (GPU UUID, which
is the same whatever ``CUDA_VISIBLE_DEVICES`` each process has)."""

from __future__ import annotations

import datetime
import logging
import os

from unisleep.addresses import is_loopback

log = logging.getLogger("unisleep.transfer")

BACKEND = "nccl"
#: NCCL cannot connect two ranks that sit on the same GPU
SAME_DEVICE_OK = False


def device_key(device_index: int = 0) -> str:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    if uuid is None:  # pragma: no cover - very old torch
        from cuda.bindings import driver as cu

        cu.cuInit(0)
        _, dev = cu.cuDeviceGet(device_index)
        _, u = cu.cuDeviceGetUuid(dev)
        uuid = bytes(u.bytes).hex()
    return f"gpu:{uuid}"


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux), from /sys/class/net."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    except (OSError, ValueError):
        pass
    return "lo"


def pin_loopback(host: str) -> None:
    """For a loopback group, NCCL's bootstrap and socket transport listen on the loopback
    interface (``NCCL_SOCKET_IFNAME``), unless the user chose an interface already.  NCCL reads
    the variable once per process: a trainer that also runs multi-node NCCL groups sets
    ``NCCL_SOCKET_IFNAME`` itself (docs/security.md)."""
    if is_loopback(host) and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = loopback_interface()
        log.info("loopback transfer group: NCCL_SOCKET_IFNAME=%s", os.environ["NCCL_SOCKET_IFNAME"])


def create_backend(store, rank: int, world_size: int, timeout: datetime.timedelta, device_index: int = 0, *, host: str = ""):
    """A ``ProcessGroupNCCL`` over ``store`` (communicator created lazily on the first collective);
    on a loopback rendezvous NCCL's sockets stay on the loopback interface."""
    import torch
    import torch.distributed as dist

    pin_loopback(host)
    torch.cuda.set_device(device_index)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def same_device_message(ranks) -> str:
    return (
        f"ranks {sorted(ranks)} of this transfer group are on the same GPU, and NCCL cannot connect two "
        "processes on one GPU (its transports need distinct devices; it fails or hangs at init). "
        "Use the colocated IPC path instead: WeightSender(group, path='ipc') (or path='auto', the default), "
        "which exports the bucket memory as a POSIX file descriptor and passes it over a Unix socket."
    )
