"""``TransferGroup``: a private trainer↔engine group from a rendezvous address.

It is built from torch.distributed parts only — a ``TCPStore`` (hosted by rank 0, the sender)
under a ``PrefixStore``, and the platform's process-group backend constructed directly on it — so
the default process group of either side (the trainer's data-parallel group, the engine's
tensor-parallel group) is never created or touched.  The store also carries the small control
messages of an update (header, acknowledgements); the backend carries the bytes.

The vendor part (which backend class, how a device is identified) lives in
``unisleep.backends.<platform>.collective``, found through the platform's driver entry.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlparse

from ..errors import InvalidArgumentError, TransferError, UnsupportedError
from ..platform import SPECS, Platform, detect_platform

log = logging.getLogger("unisleep.transfer")

DEFAULT_TIMEOUT_S = 300.0


def vendor_module(platform: Platform, name: str):
    """``unisleep.backends.<platform>.<name>`` for this platform (e.g. ``collective``, ``ipc``)."""
    pkg = platform.spec.driver.split(":", 1)[0]
    if pkg:
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{pkg}.{name}" or platform.collective_backend != SPECS["host"].collective_backend:
                raise
    # a third-party platform without its own module: host memory over the host collective
    pkg = SPECS["host"].driver.split(":", 1)[0]
    return importlib.import_module(f"{pkg}.{name}")


def parse_rendezvous(rendezvous: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port)."""
    u = urlparse(rendezvous if "://" in rendezvous else f"tcp://{rendezvous}")
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise InvalidArgumentError(f"rendezvous must look like tcp://HOST:PORT, got {rendezvous!r}")
    return u.hostname, int(u.port)


@dataclass(frozen=True)
class Peer:
    rank: int
    device_key: str
    host: str
    pid: int


class TransferGroup:
    """A weight-transfer group: rank 0 sends, ranks 1..world_size-1 receive.

    Create it on every member at about the same time (it is a rendezvous)::

        group = TransferGroup.create("tcp://10.0.0.1:29555", rank=0, world_size=2)   # trainer
        group = TransferGroup.create("tcp://10.0.0.1:29555", rank=1, world_size=2)   # engine

    Attributes: ``rank``, ``world_size``, ``platform``, ``backend`` (torch backend name),
    ``device`` (torch device of the buckets), ``peers`` (device identity of each rank),
    ``colocated`` (every receiver shares the sender's device, so IPC can be used),
    ``timeout_s``.
    """

    def __init__(self, *, store, rank: int, world_size: int, platform: Platform, device_index: int,
                 timeout_s: float, peers: list[Peer], pg, host: str, port: int, master_store=None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.platform = platform
        self.device_index = device_index
        self.timeout_s = timeout_s
        self.peers = peers
        self._pg = pg
        self.host, self.port = host, port
        self._master_store = master_store  # keep the TCPStore (server on rank 0) alive
        self._collective = vendor_module(platform, "collective")
        self.closed = False
        self._seq = 0  # updates started on this side (the same count on every member)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, rendezvous: str, rank: int, world_size: int, *, platform=None,
               timeout_s: float = DEFAULT_TIMEOUT_S, device: Optional[int] = None,
               name: str = "default") -> "TransferGroup":
        """Join the group at ``rendezvous`` (``tcp://HOST:PORT``; rank 0 hosts the store there).

        ``platform``: ``None`` (detect), a name or a :class:`Platform` — decides the backend
        (host: gloo; accelerators: the vendor's collective).  ``device``: this rank's device index
        (default: the current one).  ``name`` separates several groups on one store address.
        Multi-node is the same call with a routable address.
        """
        if world_size < 2:
            raise InvalidArgumentError(f"a transfer group needs a sender and at least one receiver; world_size={world_size}")
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank must be in [0, {world_size}), got {rank}")
        plat = platform if isinstance(platform, Platform) else detect_platform(platform)
        host, port = parse_rendezvous(rendezvous)
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            base = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        except Exception as e:
            raise TransferError(
                f"cannot {'open' if rank == 0 else 'reach'} the rendezvous store at {host}:{port} "
                f"(rank {rank}/{world_size}): {e}"
            ) from e
        store = dist.PrefixStore(f"unisleep/transfer/{name}", base)
        coll = vendor_module(plat, "collective")
        if device is None:
            device = 0
            if plat.is_accelerator:
                import torch

                device = torch.accelerator.current_device_index()
        me = Peer(rank, coll.device_key(device), socket.gethostname(), os.getpid())
        store.set(f"peer/{rank}", pickle.dumps(me))
        keys = [f"peer/{r}" for r in range(world_size)]
        try:
            store.wait(keys, timeout)
        except Exception as e:
            raise TransferError(f"not every rank of {world_size} joined {rendezvous} within {timeout_s:.0f} s: {e}") from e
        peers = [pickle.loads(store.get(k)) for k in keys]
        shared = _same_device_ranks(peers)
        pg = None
        if shared and not coll.SAME_DEVICE_OK:
            log.info("ranks %s share a device: no collective backend, colocated IPC only", sorted(shared))
        else:
            pg = coll.create_backend(dist.PrefixStore("pg", store), rank, world_size, timeout, device, host=host)
        grp = cls(store=store, rank=rank, world_size=world_size, platform=plat, device_index=device,
                  timeout_s=timeout_s, peers=peers, pg=pg, host=host, port=port, master_store=base)
        grp._shared = shared
        return grp

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> str:
        return self._collective.BACKEND

    @property
    def device(self):
        import torch

        return torch.device(self.platform.torch_device(self.device_index))

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @property
    def receivers(self) -> list[int]:
        return list(range(1, self.world_size))

    @property
    def colocated(self) -> bool:
        """Every receiver is on the sender's device (same GPU; on host: same machine)."""
        return all(p.device_key == self.peers[0].device_key for p in self.peers)

    @property
    def ipc_available(self) -> bool:
        return self.colocated and self._collective.IPC_MODULE is not None

    def ipc_module(self):
        if self._collective.IPC_MODULE is None:
            raise UnsupportedError(
                f"colocated IPC is not implemented on the {self.platform.name} platform; "
                "use path='collective' with the engine on another device"
            )
        return vendor_module(self.platform, self._collective.IPC_MODULE)

    def process_group(self):
        """The backend object that moves bytes; raises with the reason when it cannot exist."""
        if self._pg is None:
            raise UnsupportedError(self._collective.same_device_message(self._shared))
        return self._pg

    # ------------------------------------------------------------------ control plane
    def _next_seq(self) -> int:
        """Number of the next update; every sender/receiver object on this group shares it."""
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def put(self, key: str, obj: Any) -> None:
        self.store.set(key, pickle.dumps(obj))

    def take(self, key: str, timeout_s: Optional[float] = None, what: str = "") -> Any:
        """Wait for ``key`` and unpickle it; a dead peer or a timeout raises :class:`TransferError`."""
        t = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        try:
            self.store.wait([key], datetime.timedelta(seconds=t))
            return pickle.loads(self.store.get(key))
        except TransferError:
            raise
        except Exception as e:
            waited = time.monotonic() - t0
            why = "timed out" if waited >= t * 0.95 else "lost the connection to the store (its host, rank 0, may have died)"
            raise TransferError(f"waiting for {what or key}: {why} after {waited:.1f} s: {e}") from e

    def check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception as e:
            raise TransferError(f"lost the connection to the transfer store: {e}") from e

    def drop(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:
            pass

    def close(self) -> None:
        """Shut the backend down (the store closes when the last reference goes)."""
        if self.closed:
            return
        self.closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"TransferGroup(rank={self.rank}/{self.world_size}, platform={self.platform.name}, "
                f"backend={self.backend}, device={self.device}, colocated={self.colocated})")


def _same_device_ranks(peers: list[Peer]) -> set[int]:
    seen: dict[str, list[int]] = {}
    for p in peers:
        seen.setdefault(p.device_key, []).append(p.rank)
    return {r for ranks in seen.values() if len(ranks) > 1 for r in ranks}


__all__ = ["TransferGroup", "Peer", "parse_rendezvous", "vendor_module", "DEFAULT_TIMEOUT_S"]
