"""SIMULATED device memory for the vendor-binding tests — not a driver, not hardware.

A :class:`SimDevice` is an accelerator's virtual-memory manager built on real host memory:

* an address reservation is a real ``mmap(PROT_NONE)`` range;
* a physical allocation is a real ``memfd`` (one file descriptor per handle, like ROCm's dmabuf);
* a mapping is a real ``mmap(MAP_FIXED|MAP_SHARED)`` of that memfd at the address;
* "device memory used" is the sum of live physical allocations, capped at ``total_bytes``,
  and every physical allocation's descriptor is closed when the device frees it.

The vendor front ends (fake_hip.py, fake_acl.py) enforce each API's contract on top and
return the library's integer error codes.  Behaviours of real devices that the drivers must
survive are switchable: ``keeps_memory_while_reserved`` (ROCm: VRAM stays allocated until the
address range is freed), ``stale_fresh_memory`` (new physical memory holds old bytes),
``deferred_memset`` (memset completes only at a synchronise or a synchronous copy).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

from unisleep.backends.host import libc

STALE_BYTE = 0xA5


class SimError(Exception):
    """A contract violation; the front end turns it into the library's error code."""

    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


@dataclass(eq=False)
class Phys:
    id: int
    size: int
    fd: int
    released: bool = False
    mapped_at: set = field(default_factory=set)
    pinned_by: set = field(default_factory=set)  # reservations holding it (ROCm bug)
    freed: bool = False
    device: int = 0  # the device whose memory it is
    handle_types: int = 0  # shareable handle types requested at create (ROCm: POSIX fd = 1)
    imported: bool = False  # made from another process's exported fd: never handed out again


@dataclass(eq=False)
class Reservation:
    va: int
    size: int
    pins: set = field(default_factory=set)  # Phys kept alive by this reservation (ROCm bug)


@dataclass(eq=False)
class Mapping:
    va: int
    size: int
    phys: Phys
    readable: bool = False  # access granted


class SimDevice:
    def __init__(
        self,
        *,
        granularity: int = 2 << 20,
        total_bytes: int = 256 << 20,
        device_count: int = 1,
        keeps_memory_while_reserved: bool = False,
        stale_fresh_memory: bool = True,
        deferred_memset: bool = True,
        access_on_map: bool = False,
    ):
        self.granularity = granularity
        self.total_bytes = total_bytes
        self.device_count = device_count
        self.keeps_memory_while_reserved = keeps_memory_while_reserved
        self.stale_fresh_memory = stale_fresh_memory
        self.deferred_memset = deferred_memset
        self.access_on_map = access_on_map
        self.lock = threading.RLock()
        self.reservations: dict[int, Reservation] = {}
        self.phys: dict[int, Phys] = {}
        self.mappings: dict[int, Mapping] = {}
        self.host_allocs: dict[int, int] = {}
        self.pending: list[tuple[int, int, int]] = []  # deferred memsets (va, value, n)
        self.recycled: list[Phys] = []  # freed memory not scrubbed, handed out again
        self.calls: dict[str, int] = {}
        self.log: list[tuple] = []
        self.internal_errors: list[BaseException] = []
        self.current_device: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.intruder = None  # callable(va, size) run right after an address range is freed

    # ------------------------------------------------------------------ accounting
    @property
    def used_bytes(self) -> int:
        return sum(p.size for p in self.phys.values() if not p.freed)

    @property
    def live_fds(self) -> int:
        return sum(1 for p in self.phys.values() if not p.freed)

    def physical_blocks(self) -> int:
        """Bytes the kernel really holds for live physical allocations (memfd st_blocks)."""
        return sum(os.fstat(p.fd).st_blocks * 512 for p in self.phys.values() if not p.freed)

    def count(self, name: str, *args) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.log.append((name,) + args)

    # ------------------------------------------------------------------ address space
    def reserve(self, size: int, alignment: int, hint: int) -> int:
        if size <= 0 or size % self.granularity:
            raise SimError(1, f"reserve size {size} is not a multiple of the granularity {self.granularity}")
        align = max(alignment, self.granularity)
        va = 0
        if hint:
            try:  # an address hint: honoured when the range is free, like mmap without MAP_FIXED
                got = libc.mmap(hint, size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE | 0x100000)
                va = got
            except OSError:
                va = 0
        if not va:
            raw = libc.mmap(0, size + align, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE)
            va = (raw + align - 1) // align * align
            if va > raw:
                libc.munmap(raw, va - raw)
            tail = raw + size + align - (va + size)
            if tail:
                libc.munmap(va + size, tail)
        self.reservations[va] = Reservation(va, size)
        return va

    def reservation_of(self, va: int, size: int = 1) -> Optional[Reservation]:
        for r in self.reservations.values():
            if r.va <= va and va + size <= r.va + r.size:
                return r
        return None

    def free_address(self, va: int, size: Optional[int]) -> None:
        r = self.reservations.get(va)
        if r is None or (size is not None and r.size != size):
            raise SimError(1, f"free_address({va:#x}, {size}) does not match a reservation")
        if any(r.va <= m.va < r.va + r.size for m in self.mappings.values()):
            raise SimError(1, "free_address on a range that still has mappings")
        del self.reservations[va]
        libc.munmap(va, r.size)
        for p in list(r.pins):
            p.pinned_by.discard(r)
            self._maybe_free(p)
        r.pins.clear()
        if self.intruder is not None:
            self.intruder(va, r.size)

    # ------------------------------------------------------------------ physical memory
    def thread_device(self) -> Optional[int]:
        """The calling thread's current device (None: none set on this thread)."""
        return self.current_device.get(threading.get_ident())

    def devices_of(self, va: int, n: int) -> set:
        """The devices whose memory the mapped part of ``[va, va + n)`` is."""
        return {m.phys.device for m in self.mappings.values() if m.va < va + max(n, 1) and va < m.va + m.size}

    def create(self, size: int, device: int = 0) -> Phys:
        if size <= 0 or size % self.granularity:
            raise SimError(1, f"physical size {size} is not a multiple of the granularity {self.granularity}")
        if self.used_bytes + size > self.total_bytes:
            raise SimError(2, f"out of device memory: {self.used_bytes} used + {size} > {self.total_bytes}")
        fd = None
        for i, old in enumerate(self.recycled):
            if old.size == size:  # the device hands out freed pages again, unscrubbed
                fd = old.fd
                del self.recycled[i]
                break
        if fd is None:
            try:
                fd = os.memfd_create("sim-device", os.MFD_CLOEXEC)
            except OSError as e:  # EMFILE: the real library reports this as out of memory
                raise SimError(2, f"no file descriptor for the handle: {e}") from e
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            if self.stale_fresh_memory:
                os.pwrite(fd, bytes([STALE_BYTE]) * size, 0)
        p = Phys(next(self._ids) * 0x1000 + 0x7F0000000000, size, fd, device=device)
        self.phys[p.id] = p
        return p

    def import_fd(self, fd: int, device: int) -> Phys:
        """A physical allocation over another process's exported memfd (a duplicate of ``fd``):
        both processes map the same pages."""
        size = os.fstat(fd).st_size
        if size <= 0 or size % self.granularity:
            raise SimError(1, f"imported fd {fd} holds {size} bytes, not an allocation of this device")
        p = Phys(next(self._ids) * 0x1000 + 0x7F0000000000, size, os.dup(fd), device=device, imported=True)
        self.phys[p.id] = p
        return p

    def handle(self, hid: int) -> Phys:
        p = self.phys.get(hid)
        if p is None or p.released:
            raise SimError(400, f"invalid or released handle {hid:#x}")
        return p

    def release(self, p: Phys) -> None:
        p.released = True
        self._maybe_free(p)

    def _maybe_free(self, p: Phys) -> None:
        if p.freed or not p.released or p.mapped_at or p.pinned_by:
            return
        p.freed = True
        if self.stale_fresh_memory and not p.imported:
            self.recycled.append(Phys(0, p.size, p.fd, True, freed=True))
            while len(self.recycled) > 2:
                os.close(self.recycled.pop(0).fd)
        else:
            os.close(p.fd)

    # ------------------------------------------------------------------ mappings
    def map(self, va: int, size: int, p: Phys) -> None:
        if va % self.granularity or size % self.granularity:
            raise SimError(1, "map address and size must be multiples of the granularity")
        r = self.reservation_of(va, size)
        if r is None:
            raise SimError(1, f"map({va:#x}, {size}) is not inside one reservation")
        for m in self.mappings.values():
            if m.va < va + size and va < m.va + m.size:
                raise SimError(1, f"map({va:#x}, {size}) overlaps a mapping at {m.va:#x}")
        prot = libc.PROT_READ | libc.PROT_WRITE if self.access_on_map else libc.PROT_NONE
        libc.mmap(va, size, prot, libc.MAP_SHARED | libc.MAP_FIXED, p.fd, 0)
        self.mappings[va] = Mapping(va, size, p, readable=self.access_on_map)
        p.mapped_at.add(va)

    def set_access(self, va: int, size: int) -> None:
        covered = self._covering(va, size)
        if covered is None:
            raise SimError(1, f"set_access({va:#x}, {size}): the range is not fully mapped")
        for m in covered:
            m.readable = True
        ctypes.CDLL(None).mprotect(ctypes.c_void_p(va), ctypes.c_size_t(size), libc.PROT_READ | libc.PROT_WRITE)

    def unmap(self, va: int, size: Optional[int]) -> Phys:
        m = self.mappings.get(va)
        if m is None or (size is not None and m.size != size):
            raise SimError(1, f"unmap({va:#x}, {size}) is not exactly one whole mapping")
        self.drain_for(va, m.size)
        libc.mmap(va, m.size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_FIXED | libc.MAP_NORESERVE)
        del self.mappings[va]
        m.phys.mapped_at.discard(va)
        if self.keeps_memory_while_reserved:
            r = self.reservation_of(va, m.size)
            r.pins.add(m.phys)
            m.phys.pinned_by.add(r)
        self._maybe_free(m.phys)
        return m.phys

    def _covering(self, va: int, n: int) -> Optional[list[Mapping]]:
        out, pos, end = [], va, va + n
        by_start = sorted(self.mappings.values(), key=lambda m: m.va)
        for m in by_start:
            if m.va <= pos < m.va + m.size:
                out.append(m)
                pos = m.va + m.size
                if pos >= end:
                    return out
        return None if n else []

    def is_device(self, va: int, n: int) -> bool:
        return self.reservation_of(va, max(n, 1)) is not None

    def check_device_range(self, va: int, n: int) -> None:
        cov = self._covering(va, n)
        if cov is None:
            raise SimError(1, f"device range {va:#x}+{n} is not mapped")
        if not all(m.readable for m in cov):
            raise SimError(1, f"device range {va:#x}+{n} has no access granted")

    # ------------------------------------------------------------------ data
    def memset(self, va: int, value: int, n: int) -> None:
        self.check_device_range(va, n)
        if self.deferred_memset:
            self.pending.append((va, value, n))
        else:
            ctypes.memset(va, value, n)

    def drain(self, device: Optional[int] = None) -> None:
        """Complete the queued memsets (only ``device``'s, when given)."""
        keep = []
        for va, value, n in self.pending:
            if device is not None and self.devices_of(va, n) - {device}:
                keep.append((va, value, n))
                continue
            ctypes.memset(va, value, n)
        self.pending[:] = keep

    def drain_for(self, va: int, n: int) -> None:
        # work queued on memory that is about to be unmapped completes first
        if any(p[0] < va + n and va < p[0] + p[2] for p in self.pending):
            self.drain()

    def memcpy(self, dst: int, src: int, n: int, dst_dev: Optional[bool], src_dev: Optional[bool]) -> None:
        """A synchronous copy; ``*_dev`` = True/False the side must be device/host, None = either."""
        for ptr, want in ((dst, dst_dev), (src, src_dev)):
            is_dev = self.is_device(ptr, n)
            if want is not None and is_dev != want:
                raise SimError(1, f"copy kind says {'device' if want else 'host'} memory at {ptr:#x}, it is not")
            if is_dev:
                self.check_device_range(ptr, n)
        self.drain()  # stream order: earlier work completes before a synchronous copy
        ctypes.memmove(dst, src, n)

    def host_malloc(self, n: int) -> int:
        va = libc.mmap(0, max(n, 1), libc.PROT_READ | libc.PROT_WRITE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS)
        self.host_allocs[va] = max(n, 1)
        return va

    def host_free(self, va: int) -> None:
        n = self.host_allocs.pop(va, None)
        if n is None:
            raise SimError(1, f"host free of {va:#x}, which this library did not allocate")
        libc.munmap(va, n)

    def close(self) -> None:
        for p in self.phys.values():
            if not p.freed:
                try:
                    os.close(p.fd)
                except OSError:
                    pass
                p.freed = True
        for p in self.recycled:
            try:
                os.close(p.fd)
            except OSError:
                pass
        self.recycled.clear()


def out_size_t(addr: int, value: int) -> None:
    ctypes.c_size_t.from_address(addr).value = value


def out_ptr(addr: int, value: int) -> None:
    ctypes.c_void_p.from_address(addr).value = value


def check_parameter_names(name: str, impl, names: list[str]) -> None:
    """A simulated function reads its arguments by position: its parameters must be the
    bindings' (the header's) names in the header's order, or the simulator would test against
    its own idea of the argument order.  Checked when a simulated library is built."""
    import inspect

    got = [p.name for p in inspect.signature(impl).parameters.values()]
    if got != list(names):
        raise TypeError(f"simulated {name}{tuple(got)} does not take the bindings' parameters {tuple(names)}")
