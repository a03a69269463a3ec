"""Level-1 backup stores: the contract every store fulfils (:class:`BackupStore`), how much host
memory is available, and a store of one page-locked host buffer per backed-up range whose vendor
part is four calls (allocate, free, copy device→host, copy host→device)."""

from __future__ import annotations

import abc
import contextlib
import ctypes
from typing import Any, Callable, Optional

from .errors import HostBudgetError
from .units import human_bytes


class BackupStore(abc.ABC):
    """Where level-1 backups (and level-2 preserved parameters) live while memory sleeps."""

    #: human-readable location, shown in reports and errors
    where: str = "host"
    #: whether the store runs its own queued device copies, on a stream of its own, so a driver
    #: may pipeline a sleep and a wake through it — the seam a driver branches on, not the
    #: store's class.  Such a store also has ``save(key, src, track=True)`` (returns the
    #: completion marks ``[(bytes done, event)]``), ``abandon(keys)`` (undo queued saves),
    #: ``readable_by_sms(key)``, ``load_range(..., by_sms=, zero=)`` and ``stream()`` (its copy
    #: stream); CUDA's pinned arena is one (``backends/cuda/arena.py``).  Default: False — the
    #: driver's plain path: digests first, then one save per range through this contract.
    queued_copies: bool = False
    #: the lossless backup encodings the store can write (:mod:`unisleep.backup_encoding`), and
    #: the one in use (None: plain bytes); set by ``MemoryLifecycle(backup_encoding=)``
    encodings: tuple = ()
    encoding = None

    @abc.abstractmethod
    def ensure_fits(self, nbytes: int) -> None:
        """Raise :class:`~unisleep.errors.HostBudgetError` if ``nbytes`` more cannot be held."""

    def room_lock(self):
        """A context manager held around a sleep's check of the room (:meth:`ensure_fits`) and
        its reservations (:meth:`reserve`), so that stores of other processes sharing the same
        room (a disk) take turns: one reserves, the next one's check sees it.  Default: nothing
        is shared, nothing is held."""
        return contextlib.nullcontext()

    def reserve(self, key: tuple[int, int], nbytes: int) -> None:
        """Take all the room backup ``key`` needs now (allocate its file, grow the arena), so
        running out fails here, before any memory is released.  Raise
        :class:`~unisleep.errors.BackupError` when it cannot; default: nothing to take."""

    @abc.abstractmethod
    def save(self, key: tuple[int, int], src) -> None:
        """Copy the device tensor ``src`` (uint8) into the backup under ``key`` (may be async)."""

    @abc.abstractmethod
    def load(self, key: tuple[int, int], dst) -> None:
        """Copy the backup ``key`` into the device tensor ``dst`` (may be async)."""

    @abc.abstractmethod
    def load_range(self, key: tuple[int, int], offset: int, dst) -> None:
        """Copy ``dst.numel()`` bytes of backup ``key``, from byte ``offset`` on, into the uint8
        tensor ``dst`` (may be async: :meth:`flush` waits).  ``dst`` is either device memory
        (a chunk being restored: a wake, a progressive wake, the undo of a failed sleep) or host
        memory (``MemoryLifecycle.read_backup``).  A range outside the backup raises
        ``ValueError`` before anything is copied."""

    @abc.abstractmethod
    def drop(self, key: tuple[int, int]) -> None: ...

    @abc.abstractmethod
    def has(self, key: tuple[int, int]) -> bool: ...

    def flush(self) -> None:
        """Wait for outstanding copies."""

    def prepare(self, nbytes: int, background: bool = True) -> None:
        """Make room for ``nbytes`` of backups ahead of the first sleep (default: nothing to do)."""

    @property
    @abc.abstractmethod
    def held_bytes(self) -> int: ...

    def residency(self) -> dict[str, int]:
        """What the store holds now, by where it lies: ``{"pinned", "pageable", "disk"}`` in
        bytes — page-locked host memory (an arena's registered segments, used or kept for the
        next sleep), ordinary host memory (a file on a RAM file system counts here) and disk.
        Read from the store's own memory and files, not from the backups' sizes.  Default:
        every byte held, as pageable host memory."""
        return {"pinned": 0, "pageable": self.held_bytes, "disk": 0}

    def release_unused(self) -> int:
        """Give back the host memory, files and disk space no backup uses any more (an arena's
        free segments, a cached staging buffer); returns the bytes given back.  Default: the
        store keeps nothing beyond its backups."""
        return 0

    # ---- NUMA placement of the store's host memory (stores that place it: CUDA's arena) ----
    #: the store binds its host memory to a NUMA node (:mod:`unisleep.numa`)
    supports_numa: bool = False
    #: where new host memory goes: ``"auto"`` (the device's node where the host has several), a
    #: node, or None (no binding); read at the store's next growth
    numa_node: Any = None

    def device_numa_node(self) -> Optional[int]:
        """The NUMA node of the store's device (None when not known or not applicable)."""
        return None

    def page_nodes(self, sample: int = 64) -> list[int]:
        """The NUMA node of up to ``sample`` pages of each piece of the store's host memory,
        read from the kernel ([] where the store does not place its memory)."""
        return []

    def placement(self) -> dict:
        """Where the store puts new host memory: at least ``{"bind": node or None, "why": ...}``
        (:func:`unisleep.numa.placement`'s keys where the store places its memory)."""
        return {"bind": None, "why": "this store does not place its host memory on a NUMA node"}

    def close(self) -> None:
        pass


def host_available_bytes() -> int:
    """New host memory this process may take before a limit refuses it: the least of
    ``MemAvailable``, the room left under its memory cgroup, and its address-space limits
    (:func:`unisleep.hostmem.host_room`; 0 when nothing can be read)."""
    from .hostmem import available_bytes

    return available_bytes()


class HostBufferStore(BackupStore):
    """One pinned host buffer per key, reused while the size stays the same."""

    #: host memory left free after a backup
    headroom = 256 << 20

    def __init__(self, budget_bytes: Optional[int], where: str,
                 is_device: Optional[Callable[[int, int], bool]] = None):
        """``is_device(ptr, nbytes)``: whether a destination lies in the driver's device memory
        (a copy there goes through the vendor's host-to-device copy; anywhere else is host
        memory, copied directly); None: every destination is device memory."""
        self.budget = budget_bytes
        self.where = where
        self._is_device = is_device
        self._bufs: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (host pointer, capacity)

    # the vendor part ------------------------------------------------------------------
    @abc.abstractmethod
    def _alloc_host(self, nbytes: int) -> int: ...

    @abc.abstractmethod
    def _free_host(self, ptr: int) -> None: ...

    @abc.abstractmethod
    def _to_host(self, dst: int, capacity: int, src: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _to_device(self, dst: int, capacity: int, src: int, nbytes: int) -> None: ...

    # the store --------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        return sum(n for _, n in self._bufs.values())

    def residency(self) -> dict[str, int]:
        """Every buffer is page-locked host memory, freed when its backup is dropped."""
        return {"pinned": self.held_bytes, "pageable": 0, "disk": 0}

    def ensure_fits(self, nbytes: int) -> None:
        if self.budget is not None and self.held_bytes + nbytes > self.budget:
            raise HostBudgetError(
                f"a level-1 backup of {nbytes / 2**30:.2f} GiB would exceed host_budget_bytes="
                f"{self.budget / 2**30:.2f} GiB ({self.held_bytes / 2**30:.2f} GiB held). Raise the budget or "
                "sleep at level 2. Nothing was released."
            )
        from .hostmem import check_host_room

        check_host_room(nbytes, what=f"a level-1 backup of {human_bytes(nbytes)} in {self.where}",
                        headroom=self.headroom)

    def save(self, key, src) -> None:
        n = src.numel()
        old = self._bufs.get(key)
        if old is None or old[1] != n:
            self.drop(key)
            self._bufs[key] = (self._alloc_host(n), n)
        ptr, cap = self._bufs[key]
        self._to_host(ptr, cap, src.data_ptr(), n)

    def load(self, key, dst) -> None:
        ptr, n = self._bufs[key]
        if dst.numel() != n:
            raise ValueError(f"backup {key} holds {n} bytes, destination has {dst.numel()}")
        self._to_device(dst.data_ptr(), dst.numel(), ptr, n)

    def load_range(self, key, offset: int, dst) -> None:
        try:
            ptr, n = self._bufs[key]
        except KeyError:
            raise KeyError(f"no backup is held under {key}") from None
        m = dst.numel()
        if offset < 0 or offset + m > n:
            raise ValueError(f"backup {key} holds {n} bytes; cannot read {m} at {offset}")
        if m == 0:
            return
        out = dst.data_ptr()
        if self._is_device is None or self._is_device(out, m):
            self._to_device(out, m, ptr + offset, m)
        else:  # a host destination (read_backup): the backup is host memory, read it directly
            ctypes.memmove(out, ptr + offset, m)

    def has(self, key) -> bool:
        return key in self._bufs

    def drop(self, key) -> None:
        entry = self._bufs.pop(key, None)
        if entry:
            self._free_host(entry[0])

    def close(self) -> None:
        for key in list(self._bufs):
            try:
                self.drop(key)
            except Exception:  # closing: every buffer is tried; one that cannot be freed is
                pass  # given back with the process
