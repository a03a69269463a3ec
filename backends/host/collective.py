"""Host collective: a gloo process group built directly on a (prefix) store, plus this machine's
identity for colocation (hostname + boot id: two processes with the same pair share memory)."""

from __future__ import annotations

import datetime
import socket

BACKEND = "gloo"
#: two ranks on the same device may share a group (gloo moves host memory over sockets)
SAME_DEVICE_OK = True
#: gloo pairs a listening socket with whoever first sends the number it expects: every pair of a new
#: data channel proves the group secret before use (unisleep.transfer.collective, docs/security.md)
PAIR_PROOF = True
#: buckets are host memory: they can be encrypted (AES-256-GCM) on the wire
CIPHER = True


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


def device_key(device_index: int = 0) -> str:
    """Processes with equal keys can share memory by IPC (same machine, same boot)."""
    return f"host:{socket.gethostname()}:{boot_id()}"


def create_backend(store, rank: int, world_size: int, timeout: datetime.timedelta, device_index: int = 0, *, host: str = ""):
    """A ``ProcessGroupGloo`` over ``store``; never touches the default process group.

    On a loopback rendezvous the gloo device is bound to that loopback address (its sockets listen
    there and nowhere else), so hosts whose hostname does not resolve still work.  Elsewhere gloo
    picks the interface from ``GLOO_SOCKET_IFNAME`` or the hostname (docs/security.md)."""
    import torch.distributed as dist

    from unisleep.addresses import is_loopback

    if is_loopback(host):
        host = "127.0.0.1" if host == "localhost" else host
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def same_device_message(ranks) -> str:  # pragma: no cover - gloo allows it
    return ""
