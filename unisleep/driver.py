"""The contract a backend fulfils: a small table of virtual-memory primitives plus its policy.

A backend (``backends/<platform>``) subclasses :class:`Driver` and implements the primitives:

=================  ==========================================================================
``granularity``    the size every reservation, handle and mapping is a multiple of
``reserve``        reserve an address range, no memory behind it
``create``         create physical memory (a handle) of a given size
``map``            map a handle at a fixed address inside a reservation
``set_access``     grant read/write on a mapped range (no-op where mapping grants it)
``unmap``          unmap, *keeping* the address reserved
``release``        release a handle's physical memory
``free_address``   give the reservation back
``view``           a ``torch.uint8`` tensor over ``[va, va+n)`` on the device
``zero``           fill a mapped range with zeros (queued in stream order on a device)
``physical_bytes`` what a handle really holds now, read from the driver/kernel
=================  ==========================================================================

and a :class:`~unisleep.backup.BackupStore` for level-1 backups (pinned host arena, spill file...;
its contract lives in :mod:`unisleep.backup`).
:meth:`Driver.suspend` and :meth:`Driver.resume` run a sleep/wake *plan* with these
primitives; a backend may override them to pipeline copies with unmapping.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional

from .backup import BackupStore
from .errors import InvalidArgumentError, UnsupportedError
from .keyed_hash import HashKey, start_digests
from .region import Region


@dataclass(frozen=True)
class Capabilities:
    """What a driver can do: fixed per driver class (a driver may narrow them when it is
    created, e.g. ROCm's ``supports_pool`` without a ROCm build of torch)."""

    #: physical memory from ``create`` reads as zeros (no explicit zeroing needed on wake)
    fresh_memory_is_zero: bool = False
    #: keep a backup after wake so an unchanged tag can skip the copy on the next sleep
    retain_backups: bool = False
    #: ``view(..., owner=x)`` makes the tensor's storage hold ``x`` (else the lifecycle keeps
    #: it as an attribute of the tensor it hands out)
    views_hold_owner: bool = False
    #: ``pool(tag)`` can route the framework's own allocations
    supports_pool: bool = False
    #: the sleep can release behind its return (:mod:`unisleep.release_behind`): the release
    #: path goes through :meth:`Driver.release_regions`, and ``create`` and ``memory_info``
    #: call :meth:`Driver.wait_releases` first
    supports_release_behind: bool = False
    #: :meth:`Driver.suspend` itself calls :meth:`Driver.take_digests` once the backup copies
    #: are queued (the digests then run while the copies do); else the lifecycle calls it first
    digests_during_copies: bool = False


@dataclass(frozen=True)
class DriverConfig:
    """A driver's tuning knobs: ``Driver(config=...)`` or :meth:`Driver.configure`.  A backend
    with knobs of its own subclasses it."""

    #: size of the physical chunks behind each region (None = one handle per region)
    chunk_bytes: Optional[int] = None
    #: progressive wake (:mod:`unisleep.lifecycle.progressive`): the most bytes of one step, so
    #: the caller's work waits on finer pieces than the mapping chunks; None = one step per chunk
    progressive_piece: Optional[int] = None
    #: progressive wake: threads restoring steps at once (taken in use order); 1 keeps one copy
    #: queue in order (accelerators: the copy stream), more suit synchronous copies (host)
    progressive_workers: int = 1
    #: progressive wake: map the first chunk, queue its restores, then map every other chunk
    #: in one go before queueing more (backends whose mapping calls wait for copies in flight);
    #: False maps each chunk just before its first step
    progressive_map_ahead: bool = False
    #: release a sleep's physical memory behind its return (``MemoryLifecycle(release_behind=)``;
    #: only where ``Capabilities.supports_release_behind``)
    release_behind: bool = False

    def __post_init__(self):
        for name in ("chunk_bytes", "progressive_piece"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise InvalidArgumentError(f"{name} must be a positive int (bytes) or None, got {v!r}")
        w = self.progressive_workers
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise InvalidArgumentError(f"progressive_workers must be an int >= 1, got {w!r}")


@dataclass
class DriverHooks:
    """Calls a driver makes at fixed points, for tracing or for tests that delay or fail a step
    (``driver.hooks.restore = fn``); None = nothing is called."""

    #: ``restore(va, nbytes)``: a progressive wake, just before each step's restore is queued,
    #: inside :meth:`Driver.progressive_context` (on the copy stream where the backend has one)
    restore: Optional[Callable[[int, int], Any]] = None
    #: ``backup(va, nbytes)``: a sleep, after each piece is backed up and before it is released,
    #: where the backend pipelines them (host)
    backup: Optional[Callable[[int, int], Any]] = None
    #: ``release(handle)``: the release thread, just before each release behind a sleep's return
    release: Optional[Callable[[Any], Any]] = None


@dataclass
class SaveJob:
    """Bytes of one region to back up (``ranges`` of (offset, nbytes); the whole region when it
    is a full offload) before the region is released."""

    key: int
    region: Region
    ranges: list[tuple[int, int]]
    skip_copy: bool = False  # backup already holds identical bytes
    #: the lifecycle asks for the keyed digest of the whole region under a fresh key (the proof
    #: a later sleep checks to skip the copy); :meth:`Driver.take_digests` fills ``digest_key``
    #: and ``digest``
    want_digest: bool = False
    digest_key: Any = None
    digest: Any = None


@dataclass
class RestoreJob:
    key: int
    region: Region
    ranges: list[tuple[int, int]] = field(default_factory=list)  # restored from the backup
    zero: bool = True  # zero the rest (discarded bytes come back zeroed)


class Driver(abc.ABC):
    """One platform's virtual-memory primitives and policy (see the module docstring): what it
    can do (:attr:`capabilities`), its tuning knobs (:attr:`config`, changed through
    :meth:`configure`) and the calls it makes for tracing and fault tests (:attr:`hooks`)."""

    #: platform name this driver serves
    name: str = "?"
    #: the device index (set by ``__init__``), the knobs in use and the hooks
    device: int
    config: DriverConfig
    hooks: DriverHooks
    capabilities: Capabilities = Capabilities()
    #: the knobs a driver of this class starts with
    default_config: ClassVar[DriverConfig] = DriverConfig()
    #: whole-process capture (``unisleep.backends._capture``): which functions of torch's
    #: allocator library to redirect (a ``CaptureSpec``), or None where the platform has none
    capture_spec: ClassVar[Any] = None

    def __init__(self, device: int = 0, *, config: Optional[DriverConfig] = None, **options: Any):
        self.device = device
        self.options = options
        self.config = self.default_config
        if config is not None:
            if not isinstance(config, type(self.default_config)):
                raise InvalidArgumentError(
                    f"config for the {self.name} backend must be a {type(self.default_config).__name__}, "
                    f"got {type(config).__name__}")
            self.config = config
        self.hooks = DriverHooks()
        self._behind = None  # the ReleaseBehind thread, made at the first release behind

    def configure(self, **knobs: Any) -> DriverConfig:
        """Change tuning knobs (fields of :attr:`config`), checked all at once: an unknown knob
        or a bad value raises :class:`~unisleep.errors.InvalidArgumentError` and changes
        nothing.  Returns the new config."""
        known = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown knob(s) {', '.join(unknown)} for the {self.name} backend; its knobs: {', '.join(sorted(known))}")
        self.config = dataclasses.replace(self.config, **knobs)
        return self.config

    @property
    def last_sleep_kept(self) -> Optional[dict]:
        """What the last sleep kept instead of returning to the device (``{"bytes", "regions",
        "reason"}``, e.g. ROCm reservations it could not safely give back); None when nothing."""
        return None

    # ---- primitives ------------------------------------------------------------------
    @abc.abstractmethod
    def granularity(self) -> int: ...

    @abc.abstractmethod
    def reserve(self, size: int) -> int: ...

    @abc.abstractmethod
    def free_address(self, va: int, size: int) -> None: ...

    @abc.abstractmethod
    def create(self, size: int) -> Any: ...

    @abc.abstractmethod
    def map(self, va: int, size: int, handle: Any) -> None: ...

    def set_access(self, va: int, size: int) -> None:
        """Grant read/write on a fully mapped range (default: mapping already did)."""

    def grant_chunk(self, region: Region, chunk) -> None:
        """Grant read/write on one chunk of ``region`` that was just mapped by itself (a
        progressive wake maps chunk by chunk); default: :meth:`set_access` over the chunk.  A
        backend whose runtime grants access only from the start of a reservation overrides it."""
        self.set_access(region.va + chunk.offset, chunk.size)

    @abc.abstractmethod
    def unmap(self, va: int, size: int) -> None: ...

    @abc.abstractmethod
    def release(self, handle: Any) -> None: ...

    @abc.abstractmethod
    def physical_bytes(self, handle: Any) -> int: ...

    @abc.abstractmethod
    def view(self, va: int, nbytes: int, owner=None):
        """A uint8 torch tensor over mapped memory.  When ``owner`` is given, the tensor's
        storage (and so every view of it) keeps ``owner`` alive."""

    @abc.abstractmethod
    def zero(self, va: int, nbytes: int) -> None: ...

    def synchronize(self) -> None:
        pass

    @abc.abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory this driver allocates from."""

    @abc.abstractmethod
    def new_backup_store(self, budget_bytes: Optional[int], spill_dir: Optional[str]) -> BackupStore: ...

    def new_file_store(self, budget_bytes: Optional[int], spill_dir: Optional[str],
                       layout: str = "private") -> BackupStore:
        """A store of level-1 backups in spill files under ``spill_dir``
        (``MemoryLifecycle(backup_to="disk")``; ``layout``: ``"private"`` or ``"flat"``, see
        :class:`~unisleep.backends.host.spill_store.SpillStore`).  unisleep's accelerator drivers
        return the host backend's spill files written and read through a host staging buffer
        (:class:`~unisleep.backends.host.staged_spill.StagedSpillStore`); default: refused."""
        raise UnsupportedError(
            f"the {self.name} backend keeps no backups in files; leave backup_to unset (its own store)")

    def map_region(self, region: Region, zero: bool) -> None:
        """Map every unmapped chunk of ``region`` (same addresses) and, with ``zero``, zero it
        (queued, as :meth:`zero`).  A backend may interleave the two, chunk by chunk."""
        region.map(self)
        if zero:
            self.zero(region.va, region.size)

    def fills_zeros(self, job: RestoreJob) -> bool:
        """``job``'s region must be zeroed on the device (its memory does not come zeroed)."""
        return job.zero and not self.capabilities.fresh_memory_is_zero

    def restore_regions(self, jobs: list[RestoreJob], store: BackupStore) -> int:
        """Map the region of every restore job again (same addresses) and queue its restore:
        the copies of its saved ranges (zeroed first where the backup covers it only in part),
        or its zeroing when it has no saved range.  The copies are queued first, so they run
        while the rest is mapped and zeroed.  Returns the bytes queued to copy.  A backend may
        change how one job's copies are queued (:meth:`queue_restore`), or the whole step."""
        copied = sum(self.queue_restore(job, store) for job in jobs if job.ranges)
        for job in jobs:
            if not job.ranges:
                self.map_region(job.region, zero=self.fills_zeros(job))
        return copied

    def queue_restore(self, job: RestoreJob, store: BackupStore) -> int:
        """Map ``job``'s region again, zero it where the backup covers it only in part, and
        queue the copies of its saved ranges; returns the bytes queued."""
        job.region.map(self)
        if self.fills_zeros(job):
            self.zero(job.region.va, job.region.size)
        for off, n in job.ranges:
            store.load((job.key, off), self.view(job.region.va + off, n))
        return sum(n for _, n in job.ranges)

    def prepare_thread(self) -> None:
        """Make a new thread of this process ready to call the primitives (e.g. a current
        device context); a no-op where any thread can."""

    def release_regions(self, regions) -> int:
        """Unmap (keeping the addresses) and release every mapped chunk of ``regions``; returns
        bytes released.  With the ``release_behind`` knob the chunks are unmapped now and their
        handles released by the driver's release thread after this returns."""
        if not self.config.release_behind:
            return sum(r.release(self) for r in regions)
        handles, released = [], 0
        for r in regions:
            for c in r.chunks:
                if c.handle is None:
                    continue
                released += self.physical_bytes(c.handle)
                self.unmap(r.va + c.offset, c.size)
                handles.append(c.handle)
                c.handle = None
        if handles:
            if self._behind is None:
                from .release_behind import ReleaseBehind

                self._behind = ReleaseBehind(self)
            self._behind.submit(handles)
        return released

    def wait_releases(self) -> None:
        """Wait for the releases still running behind a sleep's return (none: returns at once);
        raises :class:`~unisleep.release_behind.ReleaseBehindError` if one failed."""
        if self._behind is not None:
            self._behind.wait()

    def keyed_digests(self, srcs: list, keys: list) -> list:
        """The keyed digests (:mod:`unisleep.keyed_hash`) of uint8 tensors' bytes, computed where
        the bytes are, in one wait for the device; they prove a retained backup still equal to
        the memory."""
        return start_digests(srcs, keys, scratch=self.digest_scratch()).result()

    def digest_scratch(self):
        """Where the device temporaries of a sleep's digests are made: None (where the
        framework's allocator puts them), or a context manager with a ``close()`` that gives
        them back to the device (:func:`~unisleep.keyed_hash.start_digests` closes it once the
        digests are read) — so that a sleep leaves no cached scratch behind in the memory it
        was asked to free."""
        return None

    def take_digests(self, saves: list[SaveJob]) -> None:
        """For every job that wants one, a fresh key and the keyed digest of its whole region
        under it (``job.digest_key``, ``job.digest``), in one batch; runs before any of those
        regions is released."""
        self.start_digests(saves)()

    def start_digests(self, saves: list[SaveJob]):
        """:meth:`take_digests` in two steps: queue the device work now (keys drawn and sent,
        kernels launched on the current stream) and return the function that waits for it and
        fills the jobs.  The regions may be released only once the device has run the queued
        work (the caller waits for an event recorded after this call, or calls the function)."""
        jobs = [j for j in saves if j.want_digest and j.digest is None]
        if not jobs:
            return lambda: None
        for j in jobs:
            j.digest_key = HashKey.new(j.region.size)
        pending = start_digests([self.view(j.region.va, j.region.size) for j in jobs], [j.digest_key for j in jobs],
                                scratch=self.digest_scratch())

        def finish() -> None:
            for job, d in zip(jobs, pending.result()):
                job.digest = d

        return finish

    #: ``graph_pool(lifecycle, tag)``: a graph-capture pool id whose memory lives in ``tag``
    #: (``torch.cuda.graph(..., pool=...)``), for backends that have one; None where the
    #: backend cannot route graph captures (callers then refuse, naming the option to turn off)
    graph_pool = None

    @property
    def torch_device(self):
        import torch

        return torch.device("cpu")

    def host_buffer(self, nbytes: int):
        """A host uint8 tensor of ``nbytes`` in memory of its own, for bytes read back from the
        device and handed to a caller (e.g. a backup): page-locked where the platform has it, and
        given back to the system when the last tensor over it is gone (never kept in a cache).
        Here: ordinary host memory."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def mempool(self, lifecycle, tag: str, detach: bool = False):
        """The torch memory pool behind :meth:`pool` for (lifecycle, tag), for backends whose
        pools are torch ``MemPool`` objects; ``detach``: handed to the caller and forgotten —
        once dropped (nothing allocated in it alive), torch gives its memory back and the next
        :meth:`pool` makes a new one."""
        from .errors import UnsupportedError

        raise UnsupportedError(f"the {self.name} backend has no torch memory pool to hand out")

    def pool_problem(self) -> Optional[str]:
        """Why :meth:`pool` cannot route the framework's allocations in this process, or None
        when it can (``capabilities.supports_pool``)."""
        if self.capabilities.supports_pool:
            return None
        return f"the {self.name} backend cannot route the framework's own allocations"

    @contextlib.contextmanager
    def pool(self, lifecycle, tag: str) -> Iterator[None]:
        raise UnsupportedError(
            f"the {self.name} backend cannot route the framework's own allocations; "
            "allocate with MemoryLifecycle.empty(..., tag=...) or move existing tensors with .adopt(...)"
        )
        yield  # pragma: no cover

    def close(self) -> None:
        pass

    # ---- progressive wake: the copy context and fences (defaults: synchronous copies) ----
    @contextlib.contextmanager
    def progressive_context(self, store: "BackupStore") -> Iterator[None]:
        """Entered by the progressive wake's worker thread around its steps (e.g. make the
        backup store's copy stream current there).  Default: nothing."""
        yield

    def fence(self) -> Any:
        """A marker of the work queued so far in :meth:`progressive_context` (a device
        event); None when that work is already complete (synchronous copies)."""
        return None

    def fence_wait(self, fence) -> None:
        """Make the caller's later work (its current stream) wait for ``fence`` without
        blocking the host where the device can wait by itself."""
        self.fence_sync(fence)

    def fence_done(self, fence) -> bool:
        return True

    def fence_sync(self, fence) -> None:
        """Block the calling thread until ``fence`` is complete."""

    # ---- composite operations (a backend may pipeline these) -------------------------
    def suspend(self, saves: list[SaveJob], discards: list[Region], store: BackupStore) -> tuple[int, int]:
        """Back up ``saves``, then release their regions and ``discards``.

        Returns (bytes released, bytes copied).  Nothing is released until every copy is done,
        so a failed copy leaves every region mapped with its bytes (the contract the lifecycle's
        rollback relies on: a backend that pipelines must only release a saved chunk once its
        copy is complete, and discarded regions once every copy is).
        """
        tr = _Trace("suspend")
        copied = 0
        for job in saves:
            if job.skip_copy:
                continue
            for off, n in job.ranges:
                store.save((job.key, off), self.view(job.region.va + off, n))
                copied += n
        tr.mark("queue copies")
        store.flush()
        self.synchronize()
        tr.mark("wait copies")
        released = self.release_regions(discards)
        tr.mark("release discarded")
        released += self.release_regions([job.region for job in saves])
        tr.mark("release saved")
        tr.done(copied)
        return released, copied

    def resume(self, jobs: list[RestoreJob], store: BackupStore) -> int:
        """Map every job's region again (same addresses), restore saved ranges, zero the rest
        (:meth:`restore_regions`), and wait for it all.  Returns bytes copied back."""
        tr = _Trace("resume")
        copied = self.restore_regions(jobs, store)
        tr.mark("map + queue copies and zeroing")
        store.flush()
        self.synchronize()
        tr.mark("wait")
        tr.done(copied)
        return copied


#: callables given every finished trace as a dict (:func:`add_trace_sink`)
_TRACE_SINKS: list = []


def add_trace_sink(fn) -> None:
    """Give ``fn`` every per-phase trace of a sleep or wake from now on (also without
    ``UNISLEEP_TRACE``): ``{"what", "seconds", "phases": [(phase, seconds)], "copied", **notes}``
    (e.g. a harness breaking a first sleep down); :func:`remove_trace_sink` stops it."""
    if fn not in _TRACE_SINKS:
        _TRACE_SINKS.append(fn)


def remove_trace_sink(fn) -> None:
    if fn in _TRACE_SINKS:
        _TRACE_SINKS.remove(fn)


class _Trace:
    """Per-phase timings of a sleep/wake, logged when ``UNISLEEP_TRACE=1`` (logger ``unisleep.trace``)
    and given to the trace sinks (:func:`add_trace_sink`)."""

    def __init__(self, what: str):
        self.log = os.environ.get("UNISLEEP_TRACE", "") not in ("", "0")
        self.on = self.log or bool(_TRACE_SINKS)
        if self.on:
            self.what, self.t0, self.last, self.parts, self.notes = what, time.perf_counter(), time.perf_counter(), [], {}

    def mark(self, phase: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.parts.append((phase, now - self.last))
            self.last = now

    def note(self, **values) -> None:
        """Figures that explain the phases (e.g. how much room a backup found ready)."""
        if self.on:
            self.notes.update(values)

    def done(self, copied: int) -> None:
        if not self.on:
            return
        total = time.perf_counter() - self.t0
        if self.log:
            logging.getLogger("unisleep.trace").warning(
                "%s %.2f ms (%s; %.2f GiB copied)", self.what, 1e3 * total,
                ", ".join(f"{p} {1e3 * s:.2f} ms" for p, s in self.parts), copied / 2**30)
        rec = {"what": self.what, "seconds": total, "phases": list(self.parts), "copied": copied, **self.notes}
        for fn in list(_TRACE_SINKS):
            try:
                fn(rec)
            except Exception as e:  # a sink never breaks a sleep
                logging.getLogger("unisleep.trace").warning("a trace sink failed: %s", e)
