"""Shared pieces of level-1 backup stores: how much host memory is available, and a store of
one page-locked host buffer per backed-up range whose vendor part is four calls (allocate, free,
copy device→host, copy host→device)."""

from __future__ import annotations

import abc
import ctypes
from typing import Callable, Optional

from .driver import BackupStore
from .errors import HostBudgetError
from .units import human_bytes


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
            except Exception:
                pass
