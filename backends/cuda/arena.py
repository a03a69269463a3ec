"""A persistent pinned host arena for level-1 backups.

Host memory is mapped once (anonymous, transparent huge pages requested), page-locked with
``cuMemHostRegister`` (much cheaper than ``cudaHostAlloc`` for the same bytes) and reused every
cycle.  It grows in segments as backups need room, never beyond ``host_budget_bytes``, and can be
prepared ahead in a background thread so even the first sleep copies at bus speed.  Copies are
asynchronous, in large pieces, on a dedicated stream; growing the arena (registering a new
segment) overlaps with the copies already queued.  A segment is never registered while a graph
is being captured in the process (:mod:`unisleep.graph_capture`): the grower waits for the
capture to end (faulting pages in, which touches only host memory, goes on).

Host memory: before the arena grows, the room is checked against every limit of the host and
the process (:func:`unisleep.hostmem.check_host_room`: ``MemAvailable``, the memory cgroup, the
address-space limits) with 1 GiB kept free, and refused with
:class:`~unisleep.errors.HostMemoryError` instead of risking the OOM killer.  Segments no backup
uses any more are given back (unregistered, unmapped) by :meth:`PinnedArena.release_unused`
(the lifecycle's ``host_backups="release"``).  On a host with more than one NUMA node each new
segment is bound (``mbind``, ``MPOL_PREFERRED``) to the GPU's node, read from sysfs through the
GPU's PCI bus id, before it is faulted in (:mod:`unisleep.numa`; best effort).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

from unisleep import graph_capture, numa
from unisleep.backup import BackupStore, host_available_bytes
from unisleep.errors import HostBudgetError
from unisleep.hostmem import check_host_room
from unisleep.units import human_bytes

from unisleep.backends.host import libc

from . import cu

_libc = ctypes.CDLL(None)

log = logging.getLogger("unisleep.cuda")

SEGMENT = 1 << 30  # arena grows by segments of at most this size
GRAIN = 2 << 20  # segment sizes are multiples of this
PIECE = 256 << 20  # copy granularity
MADV_HUGEPAGE = 14
#: host memory kept free below the machine's and the cgroup's limits when the arena grows
HEADROOM = 1 << 30


def _fault_in(addr: int, size: int) -> None:
    """Touch every page of [addr, addr+size) on several threads (ctypes releases the GIL)."""
    threads = max(1, min(16, (os.cpu_count() or 2)))
    step = max(GRAIN, (size // threads + GRAIN - 1) // GRAIN * GRAIN)
    ts = [threading.Thread(target=ctypes.memset, args=(addr + o, 0, min(step, size - o))) for o in range(0, size, step)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


@dataclass
class Segment:
    addr: int
    size: int
    free: list = field(default_factory=list)  # [(off, n)] sorted
    dev: int = 0  # its device address (``cuMemHostGetDevicePointer``), for reads by the SMs


class PinnedArena(BackupStore):
    """``numa_node``: the node new segments are bound to — ``"auto"`` (the GPU's node where the
    host has more than one, else none), an int, or None (no binding)."""

    supports_numa = True
    queued_copies = True  # BackupStore.queued_copies: the CUDA driver pipelines through it

    def __init__(self, device: int, budget_bytes: Optional[int], numa_node="auto"):
        self.device = device
        self.budget = budget_bytes
        self.where = "pinned host arena"
        self.numa_node = numa_node
        self._numa: Optional[dict] = None  # the placement, resolved at the first growth
        self._host_ok = 0  # the arena size the last host-room check approved
        self._segs: list[Segment] = []
        self._slots: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> [(seg, off, n)]
        self._cv = threading.Condition()
        self._grower: Optional[threading.Thread] = None
        self._grow_error: Optional[BaseException] = None
        self._pending = 0  # bytes the grower thread is still adding
        self._promised: dict[tuple, int] = {}  # room reserved for backups not yet written
        self._stream = None

    # ---- memory ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return sum(s.size for s in self._segs)

    @property
    def held_bytes(self) -> int:
        return sum(n for ext in self._slots.values() for _, _, n in ext)

    def _free_bytes(self) -> int:
        return sum(n for s in self._segs for _, n in s.free)

    def residency(self) -> dict[str, int]:
        """Every registered segment is page-locked host memory, whether a backup uses it or it
        is kept for the next sleep (segments still being added are not counted yet)."""
        with self._cv:
            return {"pinned": self.capacity, "pageable": 0, "disk": 0}

    def release_unused(self) -> int:
        """Unregister and unmap every segment no backup (and no reservation) uses; returns the
        bytes given back.  Skipped, returning 0, while the arena is growing or a graph capture
        is underway (unregistering would invalidate it): the next call gives them back."""
        with self._cv:
            if self._grower is not None or self._pending or not self._segs:
                return 0
            if self._promised:  # room reserved for a sleep in progress
                return 0
            used = {si for ext in self._slots.values() for si, _, _ in ext}
            idle = [si for si, seg in enumerate(self._segs) if si not in used and seg.free == [(0, seg.size)]]
            if not idle:
                return 0
            with graph_capture.background_unless_capturing() as ok:
                if not ok:
                    log.debug("a graph capture is underway: the arena's free segments are given back later")
                    return 0
                self.flush()
                freed = 0
                for si in idle:
                    seg = self._segs[si]
                    self._unlock(seg)
                    libc.munmap(seg.addr, seg.size)
                    freed += seg.size
                keep = [si for si in range(len(self._segs)) if si not in set(idle)]
                renum = {old: new for new, old in enumerate(keep)}
                self._segs = [self._segs[si] for si in keep]
                self._host_ok = 0
                self._slots = {k: [(renum[si], off, n) for si, off, n in ext] for k, ext in self._slots.items()}
        log.debug("arena gave back %s (%s still registered)", human_bytes(freed), human_bytes(self.capacity))
        return freed

    def _unlock(self, seg: Segment) -> None:
        """Undo the page-locking of ``seg`` (its memory stays mapped)."""
        try:
            cu.ensure_context(self.device)
            cu.call("cuMemHostUnregister", seg.addr)
        except Exception as e:  # the mapping goes anyway: the driver drops its pins with it
            log.warning("cuMemHostUnregister of an arena segment failed: %s", e)

    def _map_faulted(self, size: int) -> int:
        """Map ``size`` bytes and fault them in on several threads (registration of resident
        pages is several times faster than letting the driver fault them); their address."""
        addr = libc.mmap(0, size, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS)
        try:
            node = self.placement().get("bind")
            if node is not None and not numa.bind(addr, size, node):  # best effort: where the threads run
                log.debug("arena segment not bound to NUMA node %s: %s", node, numa.why_not())
            _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_HUGEPAGE)  # best effort
            _fault_in(addr, size)
        except BaseException:
            libc.munmap(addr, size)
            raise
        return addr

    def device_numa_node(self) -> Optional[int]:
        """The GPU's NUMA node, from sysfs through its PCI bus id (``cuDeviceGetPCIBusId``, else
        torch's device properties); None when not known."""
        bus = None
        try:
            cu.ensure_context(self.device)
            raw = cu.call("cuDeviceGetPCIBusId", 64, cu.call("cuDeviceGet", self.device))
            bus = (raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)).split("\x00")[0]
        except Exception as e:  # falls back to torch's properties below
            log.debug("cuDeviceGetPCIBusId failed: %s", e)
        if not bus:
            try:
                import torch

                p = torch.cuda.get_device_properties(self.device)
                bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            except Exception as e:  # no bus id: no NUMA placement, the arena still works
                log.debug("the GPU's PCI bus id could not be read: %s", e)
                return None
        try:
            return numa.pci_node(bus.strip())
        except ValueError:
            return None

    def placement(self) -> dict:
        """Where new segments go: :func:`unisleep.numa.placement` for this GPU, or the node set
        by ``numa_node`` (resolved once)."""
        if self._numa is None or self._numa.get("asked") != self.numa_node:
            if self.numa_node == "auto":
                self._numa = numa.placement(self.device_numa_node() if len(numa.online_nodes()) > 1 else None)
            elif self.numa_node is None:
                self._numa = {"nodes": numa.online_nodes(), "device_node": None, "bind": None,
                              "why": "NUMA binding turned off (numa_node=None)"}
            else:
                self._numa = {"nodes": numa.online_nodes(), "device_node": None, "bind": int(self.numa_node),
                              "why": f"bound to node {self.numa_node} as asked"}
            self._numa["asked"] = self.numa_node
        return self._numa

    def page_nodes(self, sample: int = 64) -> list[int]:
        """The NUMA node of up to ``sample`` pages of each registered segment, read from the
        kernel (``move_pages``); [] where it cannot be read."""
        out: list[int] = []
        for seg in list(self._segs):
            try:
                out += numa.page_nodes(seg.addr, seg.size, sample)
            except OSError as e:
                log.debug("the arena's page nodes cannot be read: %s", e)
                return []
        return out

    def _register(self, addr: int, size: int) -> Segment:
        """Page-lock the mapped ``[addr, addr+size)`` (unmapped again if that fails)."""
        with graph_capture.background():  # page-locking invalidates a graph capture underway
            return self._page_lock(addr, size)

    def _page_lock(self, addr: int, size: int) -> Segment:
        try:
            cu.ensure_context(self.device)
            cu.call("cuMemHostRegister", addr, size, 0)
        except BaseException:
            libc.munmap(addr, size)
            raise
        try:
            dev = int(cu.call("cuMemHostGetDevicePointer", addr, 0))
        except cu.CudaError as e:  # restores then stay on the copy engine
            log.debug("no device address for the arena segment: %s", e)
            dev = 0
        return Segment(addr, size, [(0, size)], dev)

    def _next_size(self, in_flight: int) -> int:
        """The size of the next segment to add, beyond ``in_flight`` bytes already on their way
        (0: none is needed, or the budget has room only once those are in)."""
        with self._cv:
            left = self._pending - in_flight
        if left <= 0:
            return 0
        size = min(SEGMENT, (left + GRAIN - 1) // GRAIN * GRAIN)
        if self.budget is not None and self.capacity + in_flight + size > self.budget:
            size = (self.budget - self.capacity - in_flight) // GRAIN * GRAIN
            if size <= 0:
                if in_flight:
                    return 0
                raise HostBudgetError(self._budget_msg(left))
        return size

    def _grow(self) -> None:
        """Add segments until the bytes asked for (``_pending``, which later requests add to)
        are in; runs in the grower thread.  Each segment is usable as soon as it is registered,
        and while one registers the next is mapped and faulted in on a helper thread: the two
        steps take about as long each, so overlapping them shortens the growth (docs/cuda.md,
        the ``arena.py`` row, has the figures)."""
        from concurrent.futures import ThreadPoolExecutor

        if self._numa is None or self._numa.get("asked") != self.numa_node:
            with graph_capture.background():  # the GPU's bus id is a driver call: not during a capture
                self.placement()
        with ThreadPoolExecutor(1, thread_name_prefix="unisleep-arena-fault") as helper:
            ahead = None  # (size, future of its address): the next segment, being faulted in
            try:
                while True:
                    if ahead is None:
                        size = self._next_size(0)
                        if not size:
                            break
                        ahead = (size, helper.submit(self._map_faulted, size))
                    size, fut = ahead
                    addr = fut.result()
                    ahead = None
                    nxt = self._next_size(size)
                    if nxt:
                        ahead = (nxt, helper.submit(self._map_faulted, nxt))
                    seg = self._register(addr, size)
                    with self._cv:
                        self._segs.append(seg)
                        self._pending = max(0, self._pending - size)
                        self._cv.notify_all()
            finally:
                if ahead is not None:  # growing failed: the segment faulted ahead goes back
                    size, fut = ahead
                    try:
                        libc.munmap(fut.result(), size)
                    except BaseException:  # it failed itself (and unmapped what it had)
                        pass
        log.debug("arena now %.2f GiB", self.capacity / 2**30)

    def _start_grower(self, nbytes: int) -> None:
        """Ask for ``nbytes`` more arena; a grower thread already running takes them on."""

        def work():
            try:
                self._grow()
            except BaseException as e:  # surfaced to the thread waiting for room
                with self._cv:
                    self._grow_error = e
                    self._cv.notify_all()
            finally:
                with self._cv:
                    self._grower = None
                    self._pending = 0
                    self._cv.notify_all()

        with self._cv:
            self._pending += nbytes
            if self._grower is not None:
                return
            self._grow_error = None
            self._grower = threading.Thread(target=work, name="unisleep-arena", daemon=True)
            self._grower.start()

    def _budget_msg(self, nbytes: int) -> str:
        return (
            f"a level-1 backup of {nbytes / 2**30:.2f} GiB does not fit in the pinned host arena "
            f"(budget {'unlimited' if self.budget is None else f'{self.budget / 2**30:.2f} GiB'}, "
            f"{self.held_bytes / 2**30:.2f} GiB held, {host_available_bytes() / 2**30:.2f} GiB of host memory available). "
            "Raise host_budget_bytes, free host memory, or sleep at level 2. Nothing was released."
        )

    def _check_host(self, nbytes: int, grow: int, total: int) -> None:
        """Refuse, before anything is mapped or pinned, growth the host cannot hold
        (:class:`~unisleep.errors.HostMemoryError`).  ``total``: the arena's size once grown; a
        size already approved by the check of this sleep (:meth:`ensure_fits`, which sees the
        whole backup) is not read again for each of its pieces (:meth:`reserve`)."""
        if total <= self._host_ok:
            return
        check_host_room(grow, what=f"a level-1 backup of {human_bytes(nbytes)} (the pinned arena grows by "
                                   f"{human_bytes(grow)}, {human_bytes(self.capacity)} registered already)",
                        headroom=HEADROOM)
        self._host_ok = total

    def ensure_fits(self, nbytes: int) -> None:
        spare = self._free_bytes() + self._pending
        grow = max(0, nbytes - spare)
        if grow == 0:
            return
        if self.budget is not None and self.capacity + grow > self.budget:
            raise HostBudgetError(self._budget_msg(nbytes))
        self._host_ok = 0  # a new sleep (or preparation): the host is read again
        self._check_host(nbytes, grow, self.capacity + self._pending + grow)

    def prepare(self, nbytes: int, background: bool = True) -> None:
        """Map and register ``nbytes`` of arena now (in a thread when ``background``)."""
        need = nbytes - self._free_bytes() - self._pending
        if need <= 0:
            return
        self._start_grower(need)
        if not background:
            self.wait_prepared()

    def wait_prepared(self) -> None:
        with self._cv:
            while self._grower is not None:
                self._cv.wait()
            err, self._grow_error = self._grow_error, None
        if err is not None:
            raise err

    def _extents(self, n: int):
        """Yield (segment, offset, bytes) extents covering ``n`` bytes.  When the arena is short,
        a grower thread adds segments one by one and copies into the first ones start while the
        next ones are still being registered."""
        left = n
        while left:
            got = False
            for si, seg in enumerate(list(self._segs)):
                while seg.free and left:
                    off, sz = seg.free[0]
                    take = min(sz, left)
                    seg.free[0] = (off + take, sz - take)
                    if seg.free[0][1] == 0:
                        seg.free.pop(0)
                    left -= take
                    got = True
                    yield si, off, take
                if not left:
                    return
            if not got:
                with self._cv:
                    count = len(self._segs)
                    if self._grower is None:
                        self._start_grower(left)  # the condition's lock is re-entrant
                    while len(self._segs) == count and self._grower is not None and self._grow_error is None:
                        self._cv.wait()
                    if self._grow_error is not None:
                        err, self._grow_error = self._grow_error, None
                        raise err

    def _release(self, extents) -> None:
        for si, off, n in extents:
            free = self._segs[si].free  # sorted, adjacent ranges merged
            i = bisect.bisect_left(free, (off, n))
            if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # joins the range before
                i -= 1
                off, n = free[i][0], free[i][1] + n
                del free[i]
            if i < len(free) and off + n == free[i][0]:  # joins the range after
                n += free[i][1]
                del free[i]
            free.insert(i, (off, n))

    # ---- copies ------------------------------------------------------------------------
    def stream(self):
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def warm_stream(self) -> None:
        """Make the copy stream ready now: the first copy between host and device on a new
        stream makes the driver set up resources in device memory (once per process, never
        given back; docs/benchmarks.md has the size); done at start, so the first sleep frees every
        byte it puts to sleep."""
        import torch

        s = self.stream()
        host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
        dev = torch.zeros(4096, dtype=torch.uint8, device=f"cuda:{self.device}")
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
        s.synchronize()

    def _host_view(self, si: int, off: int, n: int):
        import torch

        buf = (ctypes.c_char * n).from_address(self._segs[si].addr + off)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def reserve(self, key, nbytes: int) -> None:
        """Hold room for backup ``key`` of ``nbytes`` before anything is copied or released:
        raise :class:`HostBudgetError` now when the budget or host memory cannot hold every
        reservation, else grow the arena in the background towards the full size (copies into
        the first new segments start while the next ones register; a registration that fails
        raises from :meth:`save`, still before the caller releases anything)."""
        old = self._slots.get(key)
        if old is not None and sum(x[2] for x in old) == nbytes:
            self._promised.pop(key, None)
            return  # the slot of the same size is reused
        if old is not None:  # a backup of another size is replaced: give its room back first
            self._release(self._slots.pop(key))
        self._promised[key] = nbytes
        need = sum(self._promised.values())
        spare = self._free_bytes() + self._pending
        grow = need - spare
        if grow <= 0:
            return
        try:
            if self.budget is not None and self.capacity + self._pending + grow > self.budget:
                raise HostBudgetError(self._budget_msg(need))
            self._check_host(need, grow, self.capacity + self._pending + grow)
        except HostBudgetError:
            del self._promised[key]
            raise
        self._start_grower(grow)

    def save(self, key, src, track: bool = False):
        """Queue the copy of ``src`` into the arena.  With ``track``, return [(bytes done, event)]
        marks so a caller can release memory piece by piece as its copy completes.  On failure
        the room this call took is given back and ``key`` holds no backup."""
        import torch

        n = src.numel()
        self._promised.pop(key, None)
        old = self._slots.pop(key, None)
        reuse = old is not None and sum(x[2] for x in old) == n
        if reuse:
            extents = iter(old)  # same size as last time: reuse the slot
        else:
            if old is not None:
                self._release(old)
            extents = self._extents(n)
        s = self.stream()
        ext, pos, marks = [], 0, []
        try:
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for si, off, m in extents:
                    ext.append((si, off, m))
                    for p in range(0, m, PIECE):
                        k = min(PIECE, m - p)
                        self._host_view(si, off + p, k).copy_(src[pos + p : pos + p + k], non_blocking=True)
                        if track:
                            ev = torch.cuda.Event()
                            ev.record(s)
                            marks.append((pos + p + k, ev))
                    pos += m
        except BaseException:
            try:
                s.synchronize()  # no copy may still write into room we give back
            finally:
                self._release(old if reuse else ext)
            raise
        self._slots[key] = ext
        return marks

    def abandon(self, keys) -> None:
        """Undo a failed suspend: wait for the copies queued so far, then drop the backups of
        ``keys`` (part-written or overwritten in this call, they match no digest)."""
        try:
            self.flush()
        finally:
            for key in keys:
                self.drop(key)

    def load(self, key, dst) -> None:
        import torch

        ext = self._slots[key]
        s = self.stream()
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            pos = 0
            for si, off, m in ext:
                for p in range(0, m, PIECE):
                    k = min(PIECE, m - p)
                    dst[pos + p : pos + p + k].copy_(self._host_view(si, off + p, k), non_blocking=True)
                pos += m
        torch.cuda.current_stream(self.device).wait_stream(s)

    def readable_by_sms(self, key) -> bool:
        """Every segment backup ``key`` lies in has a device address (:mod:`.host_reads`)."""
        return all(self._segs[si].dev for si, _, _ in self._slots[key])

    def load_range(self, key, offset: int, dst, by_sms: bool = False, zero=None) -> None:
        """Copy ``dst.numel()`` bytes of backup ``key``, from byte ``offset`` on, into ``dst``;
        with ``by_sms`` read by a kernel through the arena's device mapping (:mod:`.host_reads`;
        check :meth:`readable_by_sms` first), else by the copy engine.  ``zero``: a
        :class:`~.host_reads.ZeroFeed` the kernel takes its share of (``by_sms`` only)."""
        import torch

        from . import host_reads

        ext = self._slots[key]
        want_lo, want_hi = offset, offset + dst.numel()
        s = self.stream()
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            pos = 0
            for si, off, m in ext:
                lo, hi = max(pos, want_lo), min(pos + m, want_hi)
                if by_sms and hi > lo:
                    seg = self._segs[si]
                    src = host_reads.device_view(seg.dev + off + lo - pos, hi - lo, self.device)
                    host_reads.copy(dst[lo - want_lo : hi - want_lo], src, zero)
                    lo = hi
                for p in range(lo, hi, PIECE):
                    k = min(PIECE, hi - p)
                    dst[p - want_lo : p - want_lo + k].copy_(self._host_view(si, off + p - pos, k), non_blocking=True)
                pos += m
        if pos < want_hi:
            raise ValueError(f"backup {key} holds {pos} bytes; asked for {want_lo}..{want_hi}")
        torch.cuda.current_stream(self.device).wait_stream(s)

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def has(self, key) -> bool:
        return key in self._slots

    def drop(self, key) -> None:
        self._promised.pop(key, None)
        ext = self._slots.pop(key, None)
        if ext:
            self._release(ext)

    def close(self) -> None:
        self.wait_prepared()
        self.flush()
        self._slots.clear()
        self._promised.clear()
        for seg in self._segs:
            try:
                self._unlock(seg)
            except Exception:  # pragma: no cover - best effort at close
                pass
            libc.munmap(seg.addr, seg.size)
        self._segs.clear()
