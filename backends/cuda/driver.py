"""The CUDA driver: cumem virtual memory through the driver API (cuda-python's bindings).

=================  ==================================================================
reserve            ``cuMemAddressReserve(size, 0, 0, 0)``
create             ``cuMemCreate`` (pinned device memory; POSIX-fd exportable only when asked and supported)
map / set_access   ``cuMemMap`` at offset 0, then ``cuMemSetAccess`` READWRITE (again after every remap)
unmap              ``cuMemUnmap`` — the address stays reserved; the caller synchronises first
                   (:meth:`CudaDriver.suspend` once, before anything is unmapped)
release            ``cuMemRelease``
physical_bytes     the size of every handle the driver holds (a handle is physical memory)
=================  ==================================================================

The calls that can run on a thread of their own (reserve, create, map, unmap, the queued
zeroing) first make the device's primary context current on it.  Level-1 backups go to a
persistent pinned host arena (:mod:`.arena`), the store a sleep and a wake pipeline their
copies through (``BackupStore.queued_copies``); a backup retained after wake lets an unchanged
tag skip its copy, proven by the keyed NH digest (:mod:`unisleep.keyed_hash`; its first level is
the fused kernel of :mod:`.checksum`, found through the finder the registry installs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Optional

from unisleep.backends._capture import CaptureSpec
from unisleep.backup import BackupStore
from unisleep.driver import Capabilities, Driver, DriverConfig, RestoreJob, _Trace
from unisleep.errors import InvalidArgumentError

from . import cu
from .arena import PinnedArena
from .views import DeviceBuffer

log = logging.getLogger("unisleep.cuda")

RESTORE_READS = ("auto", "sm", "copy-engine")


@dataclass(frozen=True)
class CudaConfig(DriverConfig):
    """The CUDA driver's knobs: 1 GiB physical chunks (a backed-up chunk is released as soon as
    its copy is done), 64 MiB progressive steps with every chunk mapped ahead of the copies,
    and the policy of the pipelined sleep and of the wake's restores.

    The three cost figures (``early_release_min_copy``, ``after_release_ms_per_gib``,
    ``sm_read_extra_ms_per_gib``) were measured on an H200 (driver 580.159.04, torch
    2.11.0+cu130; docs/benchmarks.md, 2026-12-01, "H200: probes behind the CUDA backend's
    design"); no other GPU has been measured.  They decide only *when* a sleep releases its discards and *who* reads a
    wake's restores (the copy engine or the SMs), never which bytes come back: on another GPU a
    wrong figure costs time, not correctness.  Set them per driver with
    ``lc.driver.configure(...)``; ``restore_reads`` fixes the reader outright."""

    chunk_bytes: Optional[int] = 1 << 30
    progressive_piece: Optional[int] = 64 << 20
    progressive_map_ahead: bool = True
    #: discarded regions (the KV cache) are released while the backup copies run, once every
    #: reservation succeeded; a failure *during the copies* (a CUDA error, or Ctrl-C) then
    #: gives the weights back exactly and marks the discarded tags lost.  False releases them
    #: only once every copy is done, so such a failure gives every tag back exactly, at the
    #: cost docs/benchmarks.md measures
    release_discards_during_copies: bool = True
    #: with release_behind, a sleep copying at least this many bytes still releases its
    #: discards under its copies (:meth:`CudaDriver.suspend`)
    early_release_min_copy: int = 1 << 30
    #: the driver's work left after ``cuMemRelease``, in ms per GiB released: it progresses only
    #: while no host-to-device traffic runs, and a copy-engine restore started before it is
    #: done takes that much longer (:mod:`.host_reads`)
    after_release_ms_per_gib: float = 2.1
    #: what a restore read by the SMs costs over the copy engine, in ms per GiB
    sm_read_extra_ms_per_gib: float = 1.5
    #: who reads a wake's restores from the arena: "auto" (the SMs when the after-release work
    #: would cost the copy engine more than the SMs' slower reads, else the copy engine), "sm"
    #: or "copy-engine"; ``UNISLEEP_RESTORE_READS`` sets the default of every CUDA driver
    restore_reads: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.restore_reads not in RESTORE_READS:
            choices = ", ".join(map(repr, RESTORE_READS[:-1])) + f" or {RESTORE_READS[-1]!r}"
            raise InvalidArgumentError(
                f"restore_reads (UNISLEEP_RESTORE_READS) must be {choices}, not {self.restore_reads!r}")


@dataclass(eq=False)
class CuHandle:
    handle: object
    size: int


class CudaDriver(Driver):
    name = "cuda"
    #: digests: the keyed digests of the regions being backed up are taken once their copies
    #: are queued (they read at memory speed beside the copy engine) and before anything is
    #: released
    capabilities = Capabilities(retain_backups=True, views_hold_owner=True, supports_pool=True,
                                supports_release_behind=True, digests_during_copies=True)
    default_config = CudaConfig()
    #: torch's caching allocator asks the runtime for segments through these two imports
    capture_spec = CaptureSpec("libc10_cuda", "cudaMalloc", "cudaFree", "device", "libcudart")

    def __init__(self, device: int = 0, exportable: bool = False, config: Optional[CudaConfig] = None, **options):
        super().__init__(device, config=config, **options)
        cuda = cu.driver()
        cu.ensure_context(device)
        self._cu = cuda
        self._dev = cu.call("cuDeviceGet", device)
        vmm = cu.call(
            "cuDeviceGetAttribute",
            cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            self._dev,
        )
        if not vmm:
            from unisleep.errors import PlatformError

            raise PlatformError(f"GPU {device} does not support CUDA virtual memory management")
        prop = cuda.CUmemAllocationProp()
        prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        try:
            fd_ok = cu.call(
                "cuDeviceGetAttribute",
                cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                self._dev,
            )
        except cu.CudaError:
            fd_ok = 0
        if fd_ok and exportable:  # POSIX-fd exportable handles (costlier to release); off by default
            prop.requestedHandleTypes = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.exportable = bool(fd_ok and exportable)
        self._prop = prop
        self._gran = int(
            cu.call(
                "cuMemGetAllocationGranularity",
                prop,
                cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        )
        acc = cuda.CUmemAccessDesc()
        acc.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [acc]
        self._pools = None  # created by pool()
        self._after_work_until = 0.0  # time.monotonic() when the after-release work is done
        self._held_off_ms = 0.0  # what of it the last restores read by the SMs held off
        if config is None and "UNISLEEP_RESTORE_READS" in os.environ:  # checked by the config
            self.configure(restore_reads=os.environ["UNISLEEP_RESTORE_READS"])
        self.last_restore_by_sms = False
        self.last_zeroed_by_sms = 0  # bytes the last restore's SM reads zeroed besides
        self._warm_pending = True
        if not _capturing():  # a lifecycle made inside a capture warms up at its first sleep or wake
            self._warm_kernels()

    def _warm_kernels(self) -> None:
        self._warm_pending = False
        self._build_kernels()

    def _build_kernels(self) -> None:
        """Compile the keyed-hash and SM copy kernels now (model-load time), not inside the
        first sleep or wake."""
        from . import checksum, host_reads

        try:
            if not checksum.warm_up(self.torch_device):
                log.debug("NH kernel not compiled; digests use the torch ops (same words, slower)")
        except Exception as e:  # the torch path still gives the same digest
            log.debug("NH kernel warm-up failed: %s", e)
        try:
            if not host_reads.warm_up(self.torch_device):
                log.debug("SM copy kernel not compiled; restores stay on the copy engine")
        except Exception as e:  # restores then stay on the copy engine (disabled, same bytes)
            log.debug("SM copy kernel warm-up failed: %s", e)
            host_reads.disable(e)

    # ---- primitives ------------------------------------------------------------------
    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        cu.ensure_context(self.device)
        return int(cu.call("cuMemAddressReserve", size, 0, 0, 0))

    def free_address(self, va: int, size: int) -> None:
        cu.ensure_context(self.device)
        cu.call("cuMemAddressFree", va, size)

    def prepare_thread(self) -> None:
        cu.ensure_context(self.device)

    def create(self, size: int) -> CuHandle:
        self.wait_releases()  # memory released behind the last sleep is back first
        cu.ensure_context(self.device)
        try:
            h = cu.call("cuMemCreate", size, self._prop, 0)
        except cu.CudaError as e:
            if "OUT_OF_MEMORY" in str(e):
                free, total = self.memory_info()
                from unisleep.errors import UnisleepError

                raise UnisleepError(
                    f"GPU {self.device} is out of memory creating {size / 2**30:.2f} GiB "
                    f"({free / 2**30:.2f} of {total / 2**30:.2f} GiB free): free the trainer's memory "
                    "(torch.cuda.empty_cache()) before waking"
                ) from e
            raise
        return CuHandle(h, size)

    def map(self, va: int, size: int, handle: CuHandle) -> None:
        cu.ensure_context(self.device)
        cu.call("cuMemMap", va, size, 0, handle.handle, 0)

    def set_access(self, va: int, size: int) -> None:
        cu.call("cuMemSetAccess", va, size, self._access, 1)

    def unmap(self, va: int, size: int) -> None:
        cu.ensure_context(self.device)
        cu.call("cuMemUnmap", va, size)

    def release(self, handle: CuHandle) -> None:
        if handle.handle is not None:
            cu.call("cuMemRelease", handle.handle)
            handle.handle = None
            self._note_released(handle.size)

    def _note_released(self, nbytes: int) -> None:
        """Add what releasing ``nbytes`` leaves the driver to do (the ``after_release_ms_per_gib``
        knob; the release thread of release_behind calls this too: one float, written whole)."""
        now = time.monotonic()
        self._after_work_until = (max(now, self._after_work_until)
                                  + nbytes / 2**30 * self.config.after_release_ms_per_gib / 1e3)

    def after_release_pending_ms(self) -> float:
        """The driver's after-release work still expected, in ms (0 once it is done)."""
        return max(0.0, self._after_work_until - time.monotonic()) * 1e3

    def physical_bytes(self, handle: CuHandle) -> int:
        return handle.size if handle.handle is not None else 0

    def view(self, va: int, nbytes: int, owner=None):
        import torch

        t = torch.as_tensor(DeviceBuffer(va, nbytes, owner))
        if t.device.index != self.device:
            raise RuntimeError(f"memory at {va:#x} resolved to {t.device}, expected device {self.device}")
        return t

    def zero(self, va: int, nbytes: int) -> None:
        """Queue a fill with zeros on the current stream: ``cuMemsetD32Async`` (faster than
        torch's ``zero_``, docs/cuda.md), torch's for an unaligned range."""
        if va % 4 or nbytes % 4:
            self.view(va, nbytes).zero_()
            return
        import torch

        cu.ensure_context(self.device)
        cu.call("cuMemsetD32Async", va, 0, nbytes // 4, torch.cuda.current_stream(self.device).cuda_stream)

    def map_region(self, region, zero: bool) -> None:
        """Chunk by chunk: map one, queue its zeroing, map the next while the device zeroes (the
        fills run under the mapping calls instead of after them)."""
        if not zero:
            region.map(self)
            return
        region.map(self, each=lambda c: self.zero(region.va + c.offset, c.size))

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def memory_info(self) -> tuple[int, int]:
        self.wait_releases()
        cu.ensure_context(self.device)
        free, total = cu.call("cuMemGetInfo")
        return int(free), int(total)

    @property
    def torch_device(self):
        import torch

        return torch.device(f"{self.name}:{self.device}")

    def new_file_store(self, budget_bytes, spill_dir, layout: str = "private") -> BackupStore:
        """Spill files under ``spill_dir``, written and read through a host staging buffer."""
        from unisleep.backends.host.staged_spill import StagedSpillStore

        return StagedSpillStore(budget_bytes, spill_dir, layout=layout)

    def new_backup_store(self, budget_bytes: Optional[int], spill_dir: Optional[str]) -> BackupStore:
        arena = PinnedArena(self.device, budget_bytes)
        if _capturing():  # its first copy sets the stream up instead
            return arena
        try:
            arena.warm_stream()
        except Exception as e:  # only the first sleep's free memory depends on it
            log.debug("copy stream warm-up failed: %s", e)
        return arena

    def digest_scratch(self):
        """The digests' device temporaries in a private pool, freed once they are read."""
        from unisleep.backends._pool import DigestScratch

        from .descriptor import BACKEND

        return DigestScratch.for_device(self.device, BACKEND.device_module())

    # ---- composite ---------------------------------------------------------------------
    def suspend(self, saves, discards, store):
        """Reserve, queue every backup copy, take the digests the lifecycle asked for
        (:meth:`take_digests`, while the copies run), release discarded memory under the copies,
        then release each backed-up chunk as soon as the copy covering it has completed.

        Transactional up to the *release point* (the first release): the room the backup needs
        is checked against the arena's budget and host memory first (``HostBudgetError``), and
        the arena is grown in the background to the full backup size while the first copies
        already run; every copy is queued (so every byte of room is held) before anything is
        released.  A failure before the release point (no room, a failed registration, a CUDA
        error, KeyboardInterrupt) waits for the queued copies, gives back the arena room this
        call took, drops the store's backups of every job it was copying (their slots may hold
        part-new bytes: they no longer match any digest) and re-raises: every region is still
        mapped, device bytes are untouched (copies only read them), skipped jobs keep their
        backups.  After the release point, a failure leaves each chunk of a saved region either
        mapped with its bytes, or released with its whole copy complete in the store (so the
        lifecycle can map it again and ``load_range`` it back); discarded regions are released
        while the copies run (``release_discards_during_copies``, the speed of the pipelined
        sleep) or, when that is False, only once every copy is complete.
        """
        import torch

        if self._warm_pending:
            self._warm_kernels()
        self.synchronize()  # nothing in flight may touch memory we are about to unmap
        if not store.queued_copies:  # the plain path: digests first, as the lifecycle
            self.take_digests(saves)  # takes them for backends without digests_during_copies
            return super().suspend(saves, discards, store)
        tr = _Trace("suspend")
        copied, tracked = 0, []
        pieces = [((job.key, off), n) for job in saves if not job.skip_copy for off, n in job.ranges]
        # what the copies found: room registered (some of it held by backups this sleep reuses)
        # and whether the arena was still growing (its copies then wait for new segments)
        if tr.on:
            tr.note(arena_bytes=store.capacity, arena_held_bytes=store.held_bytes,
                    arena_growing=store._grower is not None, copy_bytes=sum(n for _, n in pieces))
        try:
            for key, n in pieces:  # a no-op for the room the lifecycle has reserved already
                store.reserve(key, n)  # HostBudgetError before any copy is queued
            for job in saves:
                if job.skip_copy:
                    continue
                for off, n in job.ranges:
                    marks = store.save((job.key, off), self.view(job.region.va + off, n), track=True)
                    if (off, n) == (0, job.region.size):
                        tracked.append((job, marks))
                    copied += n
            tr.mark("queue copies")  # with the arena short: mostly waiting for its next segments
            # the digests run on the compute stream while the copy engine works; their values
            # are read once the copies are done (a read now would queue behind them)
            finish_digests = self.start_digests(saves)
            digests_run = torch.cuda.Event()
            digests_run.record(torch.cuda.current_stream(self.device))
            tr.mark("queue digests")
        except BaseException:
            try:
                store.abandon([key for key, _ in pieces])
            except Exception as e:  # keep the original error; this one is secondary
                log.warning("undoing the failed suspend's copies also failed: %s", e)
            raise
        # ---- the release point: from here on memory is handed back
        # discards are released here, under the copies, when there are copies to hide them
        # under: the driver's work after a release slows host<->device copies for tens of ms
        # (docs/cuda.md), which the copies of this sleep absorb and a wake right after would
        # not.  With release_behind and (next to) nothing to copy they go to the release thread
        # at the end instead: its cuMemRelease calls would hold up this thread's waits
        cfg = self.config
        early = cfg.release_discards_during_copies and (
            not cfg.release_behind or copied >= cfg.early_release_min_copy)
        released = self._release_regions(discards) if early else 0
        tr.mark("release discarded")
        digests_run.synchronize()  # the digest kernels have read every saved region
        for job, marks in tracked:
            for c in job.region.chunks:
                end = c.offset + c.size
                ev = next(e for done, e in marks if done >= end)
                ev.synchronize()
                released += job.region.release_chunk(self, c)
        tr.mark("release copied chunks")
        store.flush()
        self.synchronize()
        # every copy and digest kernel is complete: reading the values waits for nothing (and,
        # with release_behind, is done before the release thread starts its driver calls)
        try:
            finish_digests()
        except Exception as e:  # the backups are complete; without a digest the next sleep copies
            log.warning("reading the digests of the backed-up memory failed (%s); the next sleep copies it all", e)
            for job in saves:
                job.digest = None
        tr.mark("read digests")
        # the discards (unless released above) and the rest, in one call (with release_behind:
        # all unmapped, then handed over at once)
        released += self.release_regions(([] if early else list(discards)) + [job.region for job in saves])
        tr.mark("release the rest")
        tr.done(copied)
        return released, copied

    def release_regions(self, regions) -> int:
        if self.config.release_behind:  # unmap now, release on the thread
            return super().release_regions(regions)
        return self._release_regions(regions)

    def _release_regions(self, regions) -> int:
        """Unmap and release every mapped chunk of ``regions`` (the context made current once,
        not per call); returns bytes released."""
        cu.ensure_context(self.device)
        cuda, released = self._cu, 0
        for r in regions:
            for c in r.chunks:
                h = c.handle
                if h is None:
                    continue
                (err,) = cuda.cuMemUnmap(r.va + c.offset, c.size)
                if int(err) != 0:
                    raise cu.CudaError("cuMemUnmap", err)
                (err,) = cuda.cuMemRelease(h.handle)
                h.handle = None
                c.handle = None
                if int(err) != 0:
                    raise cu.CudaError("cuMemRelease", err)
                released += h.size
        self._note_released(released)
        return released

    # ---- wake ---------------------------------------------------------------------------
    def restore_regions(self, jobs: list[RestoreJob], store: BackupStore) -> int:
        """The whole restore step of a wake, in one pass over the jobs; returns the bytes queued
        to copy.  The store is the seam: one without queued copies of its own (the spill files
        of ``backup_to="disk"``) gets the base's plain restores.  From the pinned arena, the
        regions with a backup go first, chunk by chunk: a chunk's zeroing (where the backup
        covers its region only in part) and copies are queued as soon as it is mapped, so they
        run while the next chunk is mapped; then the regions that come back empty (the KV cache)
        are mapped and zeroed (:meth:`map_region`).

        The copies are read by the SMs instead of the copy engine when the driver's work left
        after the last sleep's releases would slow the copy engine more than the SMs' reads cost
        (a wake right after a sleep that copied nothing; :mod:`.host_reads`): mapping calls made
        while those reads run wait for them (docs/cuda.md), so every region is mapped first, and
        the same kernels zero the empty regions while they wait on the bus."""
        self.last_restore_by_sms, self.last_zeroed_by_sms = False, 0
        if self._warm_pending:
            self._warm_kernels()
        if not store.queued_copies:
            return super().restore_regions(jobs, store)
        from . import host_reads

        self.wait_releases()  # the releases behind the last sleep count in what is pending
        restores = [j for j in jobs if j.ranges]
        nbytes = sum(n for j in restores for _, n in j.ranges)
        pending = self.after_release_pending_ms()
        feed = None  # with SM reads: what they zero besides (host_reads.ZeroFeed)
        if self._restore_by_sms(nbytes, pending, store, restores):
            log.debug("restores read by the SMs: %.1f ms of the driver's after-release work pending", pending)
            self.last_restore_by_sms, self._held_off_ms = True, pending
            for job in jobs:
                job.region.map(self)
            feed = host_reads.ZeroFeed([self.view(j.region.va, j.region.size) for j in jobs
                                        if not j.ranges and self.fills_zeros(j)], nbytes)
        for job in restores:
            if feed is None:
                job.region.map(self, each=lambda c, job=job: self._restore_chunk(job, c, store, None))
            else:
                for c in job.region.chunks:
                    self._restore_chunk(job, c, store, feed)
        if feed is None:
            for job in jobs:
                if not job.ranges:
                    self.map_region(job.region, zero=self.fills_zeros(job))
        else:
            for t in feed.rest():  # more than the reads could carry: after them (the stream waits for them)
                self.zero(t.data_ptr(), t.numel())
            self.last_zeroed_by_sms = feed.zeroed
        return nbytes

    def resume(self, jobs: list[RestoreJob], store: BackupStore) -> int:
        copied = super().resume(jobs, store)
        if self.last_restore_by_sms:  # the SMs' reads held the driver's work off: it is still to do
            self._after_work_until = time.monotonic() + self._held_off_ms / 1e3
        return copied

    def _restore_by_sms(self, nbytes: int, pending_ms: float, store: BackupStore, restores) -> bool:
        from . import host_reads

        mode = self.config.restore_reads
        if not nbytes or mode == "copy-engine" or not host_reads.available():
            return False
        if mode == "auto" and pending_ms <= nbytes / 2**30 * self.config.sm_read_extra_ms_per_gib:
            return False
        return all(store.readable_by_sms((j.key, off)) for j in restores for off, _ in j.ranges)

    def _restore_chunk(self, job: RestoreJob, c, store: BackupStore, feed) -> None:
        """Queue chunk ``c``'s share of ``job`` from the arena: zeroed first where the backup
        covers it only in part, then each saved range's bytes inside it, read by the SMs when
        ``feed`` (what those reads zero besides, :class:`~.host_reads.ZeroFeed`) is given, else
        by the copy engine."""
        lo_c, hi_c = c.offset, c.offset + c.size
        if self.fills_zeros(job):
            self.zero(job.region.va + lo_c, c.size)
        for off, n in job.ranges:
            lo, hi = max(off, lo_c), min(off + n, hi_c)
            if lo < hi:
                store.load_range((job.key, off), lo - off, self.view(job.region.va + lo, hi - lo),
                                 by_sms=feed is not None, zero=feed)

    # ---- progressive wake (unisleep.lifecycle.progressive): copies on the arena's stream ----
    @contextlib.contextmanager
    def progressive_context(self, store) -> Iterator[None]:
        """The worker's zeroing and copies go on the backup store's copy stream, never on the
        caller's stream (whose later kernels wait for them through :meth:`fence_wait`)."""
        import torch

        cu.ensure_context(self.device)
        s = store.stream() if store.queued_copies else torch.cuda.Stream(device=self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            yield

    def fence(self):
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def fence_wait(self, fence) -> None:
        if fence is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(fence)

    def fence_done(self, fence) -> bool:
        return fence is None or fence.query()

    def fence_sync(self, fence) -> None:
        if fence is not None:
            fence.synchronize()

    # ---- framework allocations ---------------------------------------------------------
    def _router(self):
        from .pool import PoolRouter

        if self._pools is None:
            self._pools = PoolRouter(self)
        return self._pools

    @contextlib.contextmanager
    def pool(self, lifecycle, tag: str) -> Iterator[None]:
        with self._router().route(lifecycle, tag):
            yield

    def host_buffer(self, nbytes: int):
        from .host_buffer import pinned_host_tensor

        return pinned_host_tensor(self.device, nbytes)

    def mempool(self, lifecycle, tag: str, detach: bool = False):
        """The torch ``MemPool`` behind :meth:`pool` for (lifecycle, tag); ``detach``: handed to
        the caller and forgotten (``PoolRouter.detach``)."""
        router = self._router()
        return router.detach(lifecycle, tag) if detach else router.mempool(lifecycle, tag).pool

    def graph_pool(self, lifecycle, tag: str = "cudagraph"):
        """A memory-pool handle for ``torch.cuda.graph(..., pool=...)`` whose memory lives in ``tag``."""
        return self._router().mempool(lifecycle, tag).id

    def close(self) -> None:
        if self._pools is not None:
            self._pools.close()
            self._pools = None


def _capturing() -> bool:
    """Whether this thread is capturing (through the gate, or on its current stream)."""
    from unisleep import graph_capture

    if graph_capture.capturing_here():
        return True
    try:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # no usable CUDA in torch here: nothing can be capturing
        return False
