"""``MemoryLifecycle``: tagged memory that sleeps (freed for real) and wakes (same addresses).

Policy, in one place, for every platform:

* level 1 — tag ``"weights"`` and any ``offload_tags`` are backed up, every other tag is discarded;
* level 2 — everything is discarded, except adopted parameters matched by :meth:`preserve`
  (and ``offload_tags``, which are backed up at any level, e.g. a CUDA-graph pool);
* wake restores backed-up bytes exactly; discarded bytes come back as zeros; no address moves;
* an illegal move raises before anything changes.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from . import graph_capture
from .driver import BackupStore, Driver, RestoreJob, SaveJob, _Trace
from .errors import (
    BackupCorruptError,
    BackupError,
    BackupLostError,
    CopyInFlightError,
    HostBudgetError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidTransitionError,
    LifecycleClosedError,
    LiveTensorsError,
    UnisleepError,
    UnknownTagError,
)
from .region import Region, round_up
from .units import human_bytes

log = logging.getLogger("unisleep")

AWAKE, OFFLOADED, DISCARDED, LOST = "awake", "offloaded", "discarded", "lost"
WAKING, SLEEPING = "waking", "sleeping"  # a progressive wake / background sleep is copying
CLOSED = "closed"  # every tag of a closed lifecycle (its memory is released)
LEVELS = (1, 2)
_ALIGN = 512  # byte alignment of tensors packed into one region by adopt()


@dataclass
class Report:
    """What the last operation did."""

    operation: str
    tags: list[str]
    bytes_released: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # what the backend wants said (e.g. memory it kept)

    @property
    def gbps(self) -> float:
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "operation": self.operation,
            "tags": list(self.tags),
            "bytes_released": self.bytes_released,
            "bytes_copied": self.bytes_copied,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        return (
            f"{self.operation} {','.join(self.tags) or '-'}: released {human_bytes(self.bytes_released)}, "
            f"copied {human_bytes(self.bytes_copied)} in {self.seconds * 1e3:.1f} ms"
            + (f" ({self.gbps:.1f} GB/s)" if self.bytes_copied else "")
            + "".join(f"; {n}" for n in self.notes)
        )


@dataclass
class Allocation:
    id: int
    tag: str
    region: Region
    nbytes: int  # bytes in use (<= region.size)
    names: dict[str, tuple[int, int]] = field(default_factory=dict)  # adopted name -> (offset, nbytes)
    saved: list[tuple[int, int]] = field(default_factory=list)  # ranges in the backup now
    digest: Any = None  # (HashKey, Digest) of the retained full backup (skip-unchanged)
    external: bool = False  # created by the framework's allocator through pool()
    pending_digest: Any = None  # (HashKey, Digest) taken by the sleep in progress
    corrupt: bool = False  # the backup failed verification on wake
    keep: Any = None  # weakref to the _Keep that every handed-out tensor of this allocation holds


class _Keep:
    """Held by the storage of every tensor that ``empty``/``adopt`` hand out: it keeps the
    lifecycle (so its memory) alive while any such tensor lives, and tells ``close()`` which
    allocations are still in use."""

    __slots__ = ("lifecycle", "__weakref__")

    def __init__(self, lifecycle):
        self.lifecycle = lifecycle


def _resolve_driver(platform, device: int, options: dict) -> Driver:
    from .registry import load_driver

    return load_driver(platform, device=device, **options)


class MemoryLifecycle:
    """Tagged memory that can sleep and wake.  See the module docstring for the policy.

    Parameters
    ----------
    platform:
        ``None`` (autodetect), a platform name, a :class:`~unisleep.platform.Platform`, or a
        ready :class:`~unisleep.driver.Driver`.
    device:
        device index on accelerators.
    host_budget_bytes:
        the most host memory (or spill space) the backups may take; ``None`` = what is free.
    spill_dir:
        host backend: where level-1 backups are written (default: a temporary directory).
    chunk_bytes:
        size of the physical chunks behind each region (mapping policy); default: the driver's.
    release_behind:
        ``True``: a sleep returns once the memory it frees is unmapped, and its physical memory
        is released by a thread of the driver's behind the return (on an H200, a level-2 sleep
        of vLLM's 48 regions in ~2 ms instead of ~12-15 ms).  unisleep's own allocations, wakes,
        :meth:`resident_bytes`, :meth:`wait` and the driver's ``memory_info`` wait for those
        releases first; another allocator (torch's, another process) sees the memory come back
        over the next milliseconds — call :meth:`wait` before handing it on at once.
        ``False`` (default): released before ``sleep()`` returns.  ``None``: the
        ``UNISLEEP_RELEASE_BEHIND`` environment variable (``1`` = True).  Backends: cuda, host
        (:mod:`unisleep.release_behind`).
    """

    def __init__(
        self,
        platform=None,
        *,
        device: int = 0,
        host_budget_bytes: Optional[int] = None,
        spill_dir: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        release_behind: Optional[bool] = None,
        **driver_options: Any,
    ):
        if host_budget_bytes is not None and (not _is_int(host_budget_bytes) or host_budget_bytes < 0):
            raise InvalidArgumentError(f"host_budget_bytes must be an int >= 0 (bytes) or None, got {host_budget_bytes!r}")
        if chunk_bytes is not None and (not _is_int(chunk_bytes) or chunk_bytes <= 0):
            raise InvalidArgumentError(
                f"chunk_bytes must be a positive int (bytes) or None for the backend's default, got {chunk_bytes!r}"
            )
        from_env = release_behind is None
        if from_env:
            env = os.environ.get("UNISLEEP_RELEASE_BEHIND", "").strip()
            if env not in ("", "0", "1"):
                raise InvalidArgumentError(f"UNISLEEP_RELEASE_BEHIND must be 0 or 1, got {env!r}")
            release_behind = env == "1"
        if not isinstance(release_behind, bool):
            raise InvalidArgumentError(f"release_behind must be True, False or None, got {release_behind!r}")
        self._driver = platform if isinstance(platform, Driver) else _resolve_driver(platform, device, driver_options)
        if release_behind and not self._driver.supports_release_behind:
            if not from_env:
                raise InvalidArgumentError(
                    f"release_behind=True is not supported by the {self._driver.name} backend; leave it False"
                )
            # a variable set for a whole fleet: this backend releases before sleep() returns
            log.warning("UNISLEEP_RELEASE_BEHIND=1 is ignored: the %s backend releases memory before sleep() "
                        "returns", self._driver.name)
            release_behind = False
        self._driver.release_behind = release_behind
        self.platform_name = self._driver.name
        self.device = device
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else self._driver.default_chunk_bytes
        self._store: BackupStore = self._driver.new_backup_store(host_budget_bytes, spill_dir)
        self.host_budget_bytes = host_budget_bytes
        self._lock = threading.RLock()
        self._allocs: dict[int, Allocation] = {}
        self._by_va: dict[int, Allocation] = {}
        self._tags: dict[str, str] = {}
        self._preserve: list[str] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._shut = threading.Event()  # set by the finalizer (close, garbage collection or exit)
        self.last_report: Optional[Report] = None
        self._before_sleep: list = []
        self._after_wake: list = []
        # the progressive wake or background sleep in flight (unisleep.progressive), in a list
        # the finalizer shares so it can wait for it
        self._flight: list = [None]
        self._flight_error: Optional[BaseException] = None
        self._flight_report: Optional[Report] = None  # of the last one settled, until wait() returns it
        # runs once: at close(), when the lifecycle is collected, or at interpreter exit
        # (weakref.finalize's own exit hook: no per-lifecycle atexit entry)
        self._finalizer = weakref.finalize(
            self, MemoryLifecycle._finalize, self._driver, self._store, self._allocs, self._lock, self._shut,
            self._flight,
        )

    # ------------------------------------------------------------------ introspection
    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def torch_device(self):
        return self._driver.torch_device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the lifecycle was finalized at garbage collection or
        interpreter exit): every tag then reads ``"closed"`` and every verb raises
        :class:`~unisleep.errors.LifecycleClosedError`."""
        return self._closed or self._shut.is_set()

    def state(self) -> dict[str, str]:
        """Each tag's state: ``"awake"``, ``"offloaded"``, ``"discarded"`` or ``"lost"`` (and
        ``"waking"`` / ``"sleeping"`` while a progressive wake / background sleep copies it;
        ``"closed"`` for every tag once the lifecycle is closed).  An awake tag is checked
        against what the driver holds: one whose memory is not all mapped is reported (and
        recorded) as ``"lost"``, never as awake."""
        if self.closed:
            return {t: CLOSED for t in list(self._tags)}
        with self._lock:
            if self.closed:
                return {t: CLOSED for t in self._tags}
            self._settle_flight()
            for tag in {a.tag for a in self._allocs.values() if self._tags.get(a.tag) == AWAKE and not a.region.mapped}:
                log.error("tag %r was recorded awake but its memory is not mapped: marked lost", tag)
                self._tags[tag] = LOST
            return dict(self._tags)

    @property
    def is_sleeping(self) -> bool:
        """Some tag is not awake; a closed lifecycle raises
        :class:`~unisleep.errors.LifecycleClosedError` (it is neither awake nor asleep)."""
        with self._lock:
            self._check_open()
            return any(s != AWAKE for s in self._tags.values())

    @property
    def tags(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def resident_bytes(self, tag: Optional[str] = None) -> int:
        """Physical bytes the backend holds now, read from the backend (not from bookkeeping);
        memory still being released behind a sleep's return (``release_behind``) is waited for."""
        from .progressive import BackgroundSleep

        self._check_open()
        self._driver.settle_releases()
        f = self._flight[0]
        if isinstance(f, BackgroundSleep) and not f.done:  # its copies hold the lock: read without it
            if tag is not None:
                self._check_tags([tag])
            total = 0
            for a in list(self._allocs.values()):
                if tag in (None, a.tag):
                    for c in list(a.region.chunks):
                        h = c.handle
                        try:
                            total += self._driver.physical_bytes(h) if h is not None else 0
                        except OSError:  # released under us
                            pass
            return total
        with self._lock:
            self._check_open()
            if tag is not None:
                self._check_tags([tag])
            return sum(a.region.physical_bytes(self._driver) for a in self._allocs.values() if tag in (None, a.tag))

    def allocated_bytes(self, tag: Optional[str] = None) -> int:
        """Bytes reserved for allocations (awake or not), rounded up to the granularity."""
        with self._lock:
            self._check_open()
            return sum(a.region.size for a in self._allocs.values() if tag in (None, a.tag))

    def backup_bytes(self) -> int:
        return self._store.held_bytes

    @property
    def backup_location(self) -> str:
        return self._store.where

    def owns(self, ptr: int, nbytes: int, tag: Optional[str] = None) -> bool:
        """``[ptr, ptr + nbytes)`` lies inside one allocation of this lifecycle (of ``tag``)."""
        return self._allocation_at(ptr, nbytes, tag) is not None

    def read_backup(self, ptr: int, out) -> bool:
        """Copy the backed-up bytes at ``[ptr, ptr + out.numel())`` into the host uint8 tensor
        ``out`` (e.g. to read weights while they sleep); False when that memory has no full
        backup held (never backed up, discarded, or not retained after a wake)."""
        with self._lock:
            self._check_open()
            a = self._allocation_at(ptr, out.numel())
            if a is None or a.saved != [(0, a.region.size)] or not self._store.has((a.id, 0)):
                return False
            self._store.flush()
            self._store.load_range((a.id, 0), ptr - a.region.va, out)
            self._store.flush()
            return True

    def _allocation_at(self, ptr: int, nbytes: int, tag: Optional[str] = None) -> Optional[Allocation]:
        with self._lock:
            for a in self._allocs.values():
                if tag in (None, a.tag) and a.region.va <= ptr and ptr + nbytes <= a.region.va + max(a.nbytes, 1):
                    return a
        return None

    def names(self, tag: Optional[str] = None) -> list[str]:
        with self._lock:
            return [n for a in self._allocs.values() if tag in (None, a.tag) for n in a.names]

    # ------------------------------------------------------------------ allocation
    def empty(self, shape, dtype=None, *, tag: str):
        """A new tensor of ``shape``/``dtype`` in lifecycle memory under ``tag`` (contents zero)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        for s in shape:
            if not _is_int(s) or s < 0:
                raise InvalidArgumentError(f"shape must hold ints >= 0, got {shape!r}")
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            self._settle_flight()  # a progressive wake / background sleep that has ended
            self._check_can_allocate(tag)
            self._check_room(nbytes, tag)
            alloc = self._new_allocation(tag, nbytes)
            t = self._driver.view(alloc.region.va, max(nbytes, 1), owner=self._keep(alloc))[:nbytes]
            return self._hold(t.view(dtype).view(shape), alloc)

    def adopt(self, obj, *, tag: str = "weights"):
        """Move the storage of ``obj``'s tensors into lifecycle memory, in place.

        ``obj`` may be an ``nn.Module`` (parameters and buffers), an optimizer (its state), a
        tensor, a mapping or an iterable of those.  Python objects stay the same; each tensor's
        ``data_ptr()`` changes once and then stays fixed across every sleep/wake.  Tensors that
        share a storage (tied weights, views) keep sharing it.  Returns ``obj``.

        Every tensor sharing a storage must be passed (in ``obj``) together: a view whose base is
        not passed, or a tensor whose views or aliases (a held ``state_dict()``, ``.data``,
        ``.detach()``) are not, would leave the others on the old memory, silently no longer
        sharing bytes — refused with :class:`~unisleep.errors.InvalidArgumentError`, nothing moved.
        """
        import torch

        self._check_open()
        named = list(_named_tensors(obj))
        if not named:
            raise InvalidArgumentError(f"adopt() found no tensors in {type(obj).__name__}")
        for name, t in named:  # everything is checked before anything moves
            why = _cannot_adopt(t)
            if why:
                raise InvalidArgumentError(f"adopt() cannot move {name!r}: {why}. Nothing was moved.")
        with self._lock:
            self._settle_flight()
            self._check_can_allocate(tag)
            # every name of each tensor object (a tied weight has several) ...
            aliases: dict[int, tuple[torch.Tensor, list[str]]] = {}
            for name, t in named:
                aliases.setdefault(id(t), (t, []))[1].append(name)
            # ... and one slot per distinct storage, so tied weights and views stay tied
            storages: dict[tuple, list[tuple[list[str], torch.Tensor]]] = {}
            for t, names in aliases.values():
                st = t.untyped_storage()
                storages.setdefault((t.device, st.data_ptr(), st.nbytes()), []).append((names, t))
            _check_storages_passed_whole(storages)
            offsets, total = {}, 0
            for key in storages:
                offsets[key] = total
                total = round_up(total + max(key[2], 1), _ALIGN)
            self._check_room(total, tag)
            new_tag = tag not in self._tags
            alloc = self._new_allocation(tag, total)
            moved_back: list[tuple[torch.Tensor, torch.Tensor]] = []
            try:
                dev = self._driver.torch_device
                base = self._driver.view(alloc.region.va, alloc.region.size, owner=self._keep(alloc))
                for key, members in storages.items():
                    off, nbytes = offsets[key], key[2]
                    src = members[0][1]
                    src_bytes = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src.untyped_storage())
                    base[off : off + nbytes].copy_(src_bytes)
                    new_storage = base[off : off + nbytes].untyped_storage()
                    for names, t in members:
                        # the region's storage starts at its va; element offset of this tensor in it
                        elem = t.element_size()
                        byte_off = (base.data_ptr() + off - new_storage.data_ptr()) + t.storage_offset() * elem
                        moved = torch.empty(0, dtype=t.dtype, device=dev).set_(
                            new_storage, byte_off // elem, t.size(), t.stride()
                        )
                        old = t.data
                        with torch.no_grad():
                            t.data = moved
                        moved_back.append((t, old))
                        self._hold(t, alloc)
                        # byte range in the region: byte_off is already region-relative (the storage
                        # starts at the region's va); the extent covers strided views too
                        extent = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))
                        for name in names:
                            alloc.names[name] = (byte_off, extent * elem)
                self._driver.synchronize()
            except BaseException as e:  # all or nothing: put every tensor back, free the region
                with torch.no_grad():
                    for t, old in reversed(moved_back):
                        t.data = old
                self._free_allocation(alloc, drop_tag=new_tag)
                if isinstance(e, UnisleepError) or not isinstance(e, Exception):
                    raise
                raise InvalidArgumentError(f"adopt() failed and was undone, nothing was moved: {e}") from e
            return obj

    def preserve(self, patterns: Sequence[str] | str) -> list[str]:
        """Globs over adopted names kept across a level-2 sleep (like vLLM's
        ``--sleep-preserve-parameter-names``).  Returns the names matched; a pattern matching
        nothing raises."""
        pats = [patterns] if isinstance(patterns, str) else list(patterns)
        with self._lock:
            self._check_open()
            known = self.names()
            matched = []
            for p in pats:
                hit = [n for n in known if fnmatch.fnmatchcase(n, p)]
                if not hit:
                    raise InvalidArgumentError(
                        f"preserve pattern {p!r} matches no adopted name; adopted names start with: "
                        + ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
                    )
                matched += hit
            self._preserve = pats
            return sorted(set(matched))

    def prepare_backup(self, nbytes: Optional[int] = None, *, background: bool = True) -> int:
        """Reserve backup room ahead of the first level-1 sleep (e.g. register a pinned host
        arena while the model loads), so even the first sleep copies at full speed.  ``nbytes``
        defaults to what the "weights" tag holds now.  Returns the bytes asked for."""
        if nbytes is not None and (not _is_int(nbytes) or nbytes < 0):
            raise InvalidArgumentError(
                f"prepare_backup(nbytes) takes an int >= 0 (bytes) or None for what the 'weights' tag holds, got "
                f"{nbytes!r}. Nothing was reserved."
            )
        if not isinstance(background, bool):
            raise InvalidArgumentError(f"prepare_backup(background=) must be True or False, got {background!r}")
        with self._lock:
            self._check_open()
            if not background:  # waits for the arena's growth, which waits for the capture to end
                graph_capture.refuse_if_capturing("prepare_backup(background=False)")
            if nbytes is None:
                nbytes = sum(a.region.size for a in self._allocs.values() if a.tag == "weights")
            if nbytes > 0:
                self._store.ensure_fits(nbytes)
                self._store.prepare(nbytes, background=background)
            return nbytes

    def add_hooks(self, before_sleep=None, after_wake=None) -> None:
        """Run ``before_sleep(level, tags)`` after a sleep is validated and before any memory is
        released, and ``after_wake(tags)`` once woken memory is mapped and restored.  Policies
        such as the extra cleanup (collective teardown/restore, graph recapture) plug in here."""
        with self._lock:
            self._check_open()
            if before_sleep is not None:
                self._before_sleep.append(before_sleep)
            if after_wake is not None:
                self._after_wake.append(after_wake)

    @contextmanager
    def pool(self, tag: str) -> Iterator[None]:
        """Route the framework's own allocations (e.g. ``torch.empty`` on the device) into ``tag``."""
        _check_tag_name(tag)
        with self._lock:
            self._check_can_allocate(tag)
        with self._driver.pool(self, tag):
            yield

    # called by drivers' pool hooks -------------------------------------------------------
    def _register_region(self, tag: str, region: Region, nbytes: int) -> Allocation:
        with self._lock:
            self._check_can_allocate(tag)
            alloc = Allocation(next(self._ids), tag, region, nbytes, external=True)
            self._allocs[alloc.id] = alloc
            self._by_va[region.va] = alloc
            self._tags.setdefault(tag, AWAKE)
            return alloc

    def _forget_region(self, va: int) -> Optional[Region]:
        """The framework freed this region: drop its bookkeeping and backups; the caller frees it."""
        with self._lock:
            if self._shut.is_set():  # close() already freed every region
                return None
            alloc = self._by_va.pop(va, None)
            if alloc is None:
                return None
            self._allocs.pop(alloc.id, None)
            for off, _ in alloc.saved:
                self._store.drop((alloc.id, off))
            return alloc.region

    # ------------------------------------------------------------------ sleep / wake
    def sleep(
        self, level: int = 1, *, offload_tags: Optional[Iterable[str]] = None, tags: Optional[Iterable[str]] = None,
        background: bool = False,
    ) -> Report:
        """Release memory.  Level 1 backs up ``"weights"`` (and ``offload_tags``) and discards the
        rest; level 2 discards everything but preserved parameters (and ``offload_tags``).
        ``tags`` limits the sleep to those tags (the others stay as they are); ``offload_tags``
        must then be among them.

        Transactional: all the room the backup needs is taken first; if anything fails (no
        room, ENOSPC, EIO, a read-only spill directory, a driver error, a hook raising), every
        tag is put back as it was — mapped, bytes exact — the partial backup is removed, and
        :class:`~unisleep.errors.BackupError` says what failed where.

        ``background=True`` returns as soon as the discarded tags (the KV cache) are released;
        the backed-up tags are ``"sleeping"`` while their copies finish behind the call (a worker
        thread runs the same transactional sleep for them), ``wait()`` waits for it and raises
        its error, if any (the backed-up tags are then awake again, bytes exact)."""
        if not _is_int(level) or level not in LEVELS:
            raise InvalidArgumentError(f"sleep level must be the int 1 or 2, got {level!r}")
        if not isinstance(background, bool):
            raise InvalidArgumentError(f"background must be True or False, got {background!r}")
        offload = set(_as_tag_list(offload_tags, "offload_tags")) if offload_tags is not None else set()
        only = set(_as_tag_list(tags, "tags")) if tags is not None else None
        if only is not None and not offload <= only:
            raise InvalidArgumentError(
                f"offload_tags {sorted(offload - only)} are not among tags {sorted(only)}; add them to tags"
            )
        self._refuse_in_flight(only, "sleep")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("sleep()")
            self._check_tags(offload if only is None else only)
            self._refuse_in_flight(only, "sleep")
            self.state()  # an awake tag that lost its mapping is reported as lost
            plan: dict[str, str] = {}
            settle: dict[str, str] = {}  # corrupt / lost tags that become discarded (no memory moves)
            for tag, cur in self._tags.items():
                if only is not None and tag not in only:
                    continue
                want = OFFLOADED if (tag in offload or (level == 1 and tag == "weights")) else DISCARDED
                if cur == AWAKE:
                    plan[tag] = want
                elif cur == want:
                    continue
                elif want == DISCARDED and (cur == LOST or (cur == OFFLOADED and self._is_corrupt(tag))):
                    settle[tag] = DISCARDED
                elif cur == LOST:
                    raise BackupLostError(
                        f"tag {tag!r} is lost (its memory could not be brought back); discard it "
                        f"(discard([{tag!r}])), wake it and load it again — nothing was changed.", tag=tag
                    )
                else:
                    raise InvalidTransitionError(
                        f"tag {tag!r} is already asleep as {cur!r}; a level-{level} sleep would make it {want!r}. "
                        f"Wake it first (wake_up([{tag!r}])) — nothing was changed."
                    )
            if background:
                return self._sleep_background(level, plan, settle)
            return self._sleep_core(level, plan, settle)

    def _sleep_core(self, level: int, plan: dict, settle: dict, run_hooks: bool = True, t0=None) -> Report:
        """The transactional sleep of the tags in ``plan`` (validated by :meth:`sleep`)."""
        t0 = time.perf_counter() if t0 is None else t0
        tr = _Trace("sleep")
        saves, discards = self._plan_sleep(plan)
        tr.mark("plan + unchanged check")
        need = sum(n for j in saves if not j.skip_copy for _, n in j.ranges)
        retained = sum(n for j in saves if j.skip_copy for _, n in j.ranges)
        for job in saves:  # a retained backup of bytes that changed since is stale: its room
            if not job.skip_copy and self._allocs[job.key].saved:  # counts for the new one
                self._drop_backup(self._allocs[job.key])
        try:
            self._ensure_backup_fits(need, keep_ids={j.key for j in saves})
        except BaseException:
            self._forget_pending(saves)
            raise
        reserved = self._reserve(saves)
        tr.mark("reserve")
        hooks_ran = False
        try:
            for hook in self._before_sleep if run_hooks else ():
                hooks_ran = True
                hook(level, sorted(plan))
            if not self._driver.digests_during_copies:
                self._driver.take_digests(saves)
            released, copied = self._driver.suspend(saves, discards, self._store)
            tr.mark("suspend")
        except BaseException as e:
            self._undo_sleep(saves, discards, reserved, sorted(plan) if hooks_ran else None)
            self._forget_pending(saves)
            if isinstance(e, BackupError) and e.tag is not None:
                raise
            raise self._backup_error(e, saves, "sleep") from e
        for job in saves:
            a = self._allocs[job.key]
            a.saved = list(job.ranges)
            a.digest = (job.digest_key, job.digest) if job.digest is not None else a.pending_digest
            a.pending_digest = None
            a.corrupt = False
        for region in discards:
            a = self._by_va[region.va]
            self._drop_backup(a)
        released += self._settle(settle)
        for tag, st in {**plan, **settle}.items():
            self._tags[tag] = st
        rep = Report(f"sleep(level={level})", sorted({**plan, **settle}), released, copied, time.perf_counter() - t0)
        kept = self._driver.last_sleep_kept
        if kept:  # e.g. ROCm keeping address reservations it could not safely give back
            rep.notes.append(
                f"{human_bytes(kept.get('bytes', 0))} in {kept.get('regions', '?')} region(s) not returned to the "
                f"device: {kept.get('reason', 'the backend kept them')}"
            )
        if retained:
            log.debug("skipped copying %d unchanged bytes", retained)
        tr.mark("bookkeeping")
        tr.done(copied)
        return self._done(rep)

    def _sleep_background(self, level: int, plan: dict, settle: dict) -> Report:
        """Release the tags that are only discarded now; copy the others out behind the call."""
        from .progressive import BackgroundSleep

        t0 = time.perf_counter()
        now = {t for t, want in plan.items() if want == DISCARDED
               and not any(self._preserved_ranges(a) for a in self._allocs.values() if a.tag == t)}
        later = {t: want for t, want in plan.items() if t not in now}
        ran = False
        try:
            for hook in self._before_sleep:  # once, for every tag, before anything is released
                ran = True
                hook(level, sorted(plan))
        except BaseException as e:
            if ran:
                for hook in self._after_wake:  # undo what the hooks did; nothing was released
                    try:
                        hook(sorted(plan))
                    except Exception as e2:  # pragma: no cover
                        log.error("after_wake hook failed while undoing a sleep: %s", e2)
            if not isinstance(e, Exception):
                raise
            raise BackupError(f"sleep(background=True) failed before anything was released: {type(e).__name__}: "
                              f"{e}. Every tag is as it was.", cause=e) from e
        regions = [a.region for a in self._allocs.values() if a.tag in now]
        released, _ = self._driver.suspend([], regions, self._store)
        for a in self._allocs.values():
            if a.tag in now:
                self._drop_backup(a)
        released += self._settle(settle)
        for t in list(now) + list(settle):
            self._tags[t] = DISCARDED
        rep = Report(f"sleep(level={level}, background)", sorted(now | set(settle)), released, 0, time.perf_counter() - t0)
        if not later:
            return self._done(rep)
        for t in later:
            self._tags[t] = SLEEPING

        def work():
            with self._lock:
                for t in later:
                    self._tags[t] = AWAKE
                try:
                    return self._sleep_core(level, later, {}, run_hooks=False, t0=t0)
                except BaseException:
                    for t in later:  # put back awake (or lost) by the undo
                        if self._tags.get(t) == SLEEPING:
                            self._tags[t] = AWAKE
                    raise

        bg = BackgroundSleep(sorted(later), work)
        self._flight[0] = bg
        bg.start()  # its worker takes the lock once this call returns
        rep.notes.append(f"tag(s) {', '.join(map(repr, sorted(later)))} are copied out behind this call; wait() waits")
        return self._done(rep)

    def discard(self, tags: Iterable[str]) -> Report:
        """Release the memory of ``tags`` now, with no backup (e.g. the KV cache only).  An
        offloaded tag is refused (its backup would be lost) unless its backup failed
        verification or the tag is lost: then discarding it is the way out."""
        tags = _as_tag_list(tags, "tags")
        self._refuse_in_flight(tags, "discard")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("discard()")
            self._check_tags(tags)
            self._refuse_in_flight(tags, "discard")
            self.state()
            settle = {}
            for t in tags:
                if self._tags[t] == LOST or (self._tags[t] == OFFLOADED and self._is_corrupt(t)):
                    settle[t] = DISCARDED
                elif self._tags[t] == OFFLOADED:
                    raise InvalidTransitionError(
                        f"tag {t!r} is offloaded (its backup is kept); discarding it would lose the backup. "
                        f"Wake it first — nothing was changed."
                    )
            todo = [t for t in tags if self._tags[t] == AWAKE]
            t0 = time.perf_counter()
            regions = [a.region for a in self._allocs.values() if a.tag in todo]
            released, _ = self._driver.suspend([], regions, self._store)
            for a in self._allocs.values():
                if a.tag in todo:
                    self._drop_backup(a)
            released += self._settle(settle)
            for t in todo + list(settle):
                self._tags[t] = DISCARDED
            return self._done(Report("discard", todo + list(settle), released, 0, time.perf_counter() - t0))

    def wake_up(self, tags: Optional[Iterable[str]] = None, *, progressive: bool = False, order=None):
        """Map memory back at the same addresses: all tags, or only ``tags`` (e.g. ``["weights"]``
        then ``["kv_cache"]``).  Waking an awake tag is a no-op.

        ``progressive=True`` returns at once with a :class:`~unisleep.progressive.ProgressiveWake`:
        the tags are ``"waking"`` while a worker maps and restores them piece by piece in the
        order the model uses them (adoption order, or first the tensors of ``order``, a list of
        modules or tensors); :meth:`ready` (or the hooks of :meth:`install_ready_hooks`) makes
        the caller's work wait for the pieces it needs, :meth:`wait` for all of them.

        Backups are verified before their bytes are exposed: a tag whose backup fails (corrupt,
        truncated or missing spill file) is left ``"offloaded"`` with its memory unmapped and
        :class:`~unisleep.errors.BackupCorruptError` is raised after the other tags are woken."""
        if not isinstance(progressive, bool):
            raise InvalidArgumentError(f"progressive must be True or False, got {progressive!r}")
        if tags is not None:
            tags = _as_tag_list(tags, "tags")
        self._refuse_in_flight(tags, "wake_up")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("wake_up()")
            self._driver.settle_releases()  # a failed release behind the last sleep: raised before any change
            self._refuse_in_flight(tags, "wake_up")
            self._settle_flight()
            if tags is None:
                todo = [t for t, s in self._tags.items() if s != AWAKE]
            else:
                self._check_tags(tags)
                todo = [t for t in tags if self._tags[t] != AWAKE]
            lost = [t for t in todo if self._tags[t] == LOST]
            if lost:
                raise BackupLostError(
                    f"tag(s) {', '.join(map(repr, lost))} are lost (their memory could not be brought back after a "
                    f"failure); discard them (discard({lost!r})), then wake them (zeros) and load them again — "
                    "nothing was changed.", tag=lost[0]
                )
            t0 = time.perf_counter()
            if progressive:
                return self._wake_progressive(todo, order, t0)
            copied, woken, failures = 0, [], []
            by_tag = {tag: [a for a in self._allocs.values() if a.tag == tag] for tag in todo}

            def jobs_of(tags):
                return [RestoreJob(a.id, a.region, list(a.saved), zero=a.saved != [(0, a.region.size)])
                        for t in tags for a in by_tag[t]]

            groups, retry = [todo], False  # one pass over every tag: the backend overlaps restores and mapping
            try:
                copied += self._driver.resume(jobs_of(todo), self._store)
            except BaseException as e:
                if not isinstance(e, Exception):
                    self._failed_wake(",".join(todo), [a for t in todo for a in by_tag[t]], e)
                    raise
                # unmap what that pass mapped, then tag by tag: which ones are bad, wake the rest
                for t in todo:
                    for a in by_tag[t]:
                        a.region.release(self._driver)
                groups, copied, retry = [[t] for t in todo], 0, True
            for group in groups:
                if retry:
                    tag = group[0]
                    try:
                        copied += self._driver.resume(jobs_of(group), self._store)
                    except BaseException as e:
                        failures.append(self._failed_wake(tag, by_tag[tag], e))
                        if not isinstance(e, Exception):
                            raise
                        continue
                for tag in group:
                    for a in by_tag[tag]:
                        self._after_restore_safely(a)
                    self._tags[tag] = AWAKE  # mapped, restored and verified
                    woken.append(tag)
            if woken:
                for hook in self._after_wake:
                    hook(None if (tags is None and not failures) else list(woken))
            rep = self._done(Report("wake_up", woken, 0, copied, time.perf_counter() - t0))
            if failures:
                first = failures[0]
                if len(failures) > 1:
                    first.args = (str(first) + f" (also failed: {', '.join(f.tag for f in failures[1:])})",)
                raise first
            return rep

    # ------------------------------------------------------------------ progressive
    def _wake_progressive(self, todo: list[str], order, t0: float):
        from .progressive import ProgressiveWake, plan_steps

        allocs = [a for t in todo for a in self._allocs.values() if a.tag == t]
        steps = plan_steps(allocs, self._driver.progressive_piece, order)
        pw = ProgressiveWake(self, todo, allocs, steps, t0)
        pw.previous = {t: self._tags[t] for t in todo}
        for t in todo:
            self._tags[t] = WAKING
        if not steps:
            pw._finished.set()
        self._flight[0] = pw
        self._flight_error = None
        pw.start() if steps else None
        pw.returned_s = time.perf_counter() - t0
        return pw

    def ready(self, obj) -> None:
        """Make the caller's later work wait until the tensors of ``obj`` (a module, a tensor,
        or a list of tensors) are restored by the progressive wake in flight; a no-op when none
        is (or it does not hold them).  Accelerators: the current stream waits on the device
        (the host thread does not block); host: blocks until the bytes are read back and
        verified.  Takes no lock: call it from the forward pass."""
        from .progressive import ProgressiveWake

        if self.closed:
            self._check_open()
        f = self._flight[0]
        if isinstance(f, ProgressiveWake):
            f.ready(obj)

    def install_ready_hooks(self, model) -> list:
        """Install a forward pre-hook on every module of ``model`` holding tensors of its own,
        calling :meth:`ready` for them, so a forward pass right after a progressive wake waits,
        layer by layer, for that layer's bytes only (a no-op when no wake is in flight).
        Returns the handles (``h.remove()``)."""
        from .progressive import install_ready_hooks

        self._check_open()
        return install_ready_hooks(self, model)

    def wait(self) -> Optional[Report]:
        """Wait for the progressive wake or background sleep in flight, settle its tags and
        return its report (also when it already ended and was settled by another call; None
        when there is nothing to wait for); with ``release_behind``, also wait until the memory
        the last sleep freed is released.  Raises its error, if it failed:
        a failed progressive wake leaves its tags asleep as before (memory unmapped), a failed
        background sleep leaves its tags awake with their bytes (or lost, as a plain sleep)."""
        self._check_open()
        f = self._flight[0]
        if f is not None:
            f._complete()
        self._driver.settle_releases()  # memory released behind the last sleep is back
        with self._lock:
            self._settle_flight(block=True)
            err, self._flight_error = self._flight_error, None
            rep, self._flight_report = self._flight_report, None
            if err is not None:
                raise err
            return rep

    def _refuse_in_flight(self, tags, what: str) -> None:
        """Refuse, before anything changes, a call touching tags whose copies are in flight
        (``tags`` None: every tag)."""
        f = self._flight[0]
        if f is None or f.done or f._settled:
            return
        hit = sorted(f.tags) if tags is None else sorted(set(tags) & set(f.tags))
        if hit:
            kind = "a progressive wake" if self._tags.get(hit[0]) == WAKING else "a background sleep"
            raise CopyInFlightError(
                f"{what}() touches tag(s) {', '.join(map(repr, hit))} while {kind} is still copying them; "
                "call wait() first (or let the copies finish). Nothing was changed."
            )

    def _settle_flight(self, block: bool = False) -> Optional[Report]:
        """Under the lock: end the progressive wake / background sleep whose copies are complete."""
        from .progressive import ProgressiveWake

        f = self._flight[0]
        if f is None or f._settled:
            return None
        if not f.done:
            if not block:
                return None
            f._complete()
        f._settled = True
        self._flight[0] = None
        self._flight_report = None
        if not isinstance(f, ProgressiveWake):  # background sleep: its worker settled the tags
            self._flight_report = f.report
            if f.error is not None:
                self._flight_error = f.error
                for hook in self._after_wake:  # its before_sleep hooks ran; the tags are back
                    try:
                        hook(list(f.tags))
                    except Exception as e:  # pragma: no cover
                        log.error("after_wake hook failed after a failed background sleep: %s", e)
            return f.report
        if f.error is not None:
            for t in f.tags:
                self._tags[t] = f.previous[t]
            err = self._failed_wake(", ".join(f.tags), f._allocs, f.error)
            self._flight_error = err
            log.error("%s", err)
            return None
        copied = 0
        for st in f.steps:
            copied += sum(hi - lo for _, lo, hi in st.loads)
        for a in f._allocs:
            if not a.region.mapped:  # a chunk no step covered (cannot happen: every chunk has one)
                a.region.map(self._driver)
            self._after_restore_safely(a)
        for t in f.tags:
            self._tags[t] = AWAKE
        for hook in self._after_wake:
            hook(list(f.tags))
        rep = Report("wake_up(progressive)", list(f.tags), 0, copied, time.perf_counter() - f._t0)
        rep.notes.append(f"returned after {1e3 * (f.returned_s or 0):.2f} ms; {len(f.steps)} steps")
        self._flight_report = rep
        return self._done(rep)

    # ------------------------------------------------------------------ close
    def close(self, *, strict: bool = False) -> None:
        """Free every region and backup.  Idempotent; also runs when the lifecycle is collected
        and at interpreter exit.

        Tensors handed out by :meth:`empty`/:meth:`adopt` keep the lifecycle alive, so it is
        never collected under them.  ``close()`` while some of them are still referenced frees
        the memory anyway (and logs which tags were live), but the address ranges of those
        tensors stay reserved and inaccessible until they die: touching one faults
        (SIGSEGV on the host, an illegal-address error on a device) instead of reading or
        corrupting memory that a later allocation got.  ``close(strict=True)`` refuses instead,
        with :class:`~unisleep.errors.LiveTensorsError` listing the live tags.  A progressive
        wake or background sleep in flight is waited for first."""
        f = self._flight[0]
        if f is not None and not self._closed:
            f._complete()
        with self._lock:
            if self._closed:
                return
            live = self.live_tags()
            if live and strict:
                raise LiveTensorsError(
                    f"tensors of tag(s) {', '.join(map(repr, live))} are still referenced; drop them (del, or let "
                    "them go out of scope) before close(strict=True), or call close(): their memory is then freed "
                    "and their addresses stay reserved and inaccessible until they die. Nothing was changed."
                )
            if live:
                log.info("close(): tensors of tag(s) %s are still referenced; their addresses stay fenced "
                         "(inaccessible) until they die", ", ".join(live))
            self._closed = True
            self._finalizer()

    def live_tags(self) -> list[str]:
        """Tags with tensors (from :meth:`empty`/:meth:`adopt`) still referenced somewhere."""
        with self._lock:
            return sorted({a.tag for a in self._allocs.values() if a.keep is not None and a.keep() is not None})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _finalize(driver: Driver, store: BackupStore, allocs: dict, lock=None, shut=None, flight=None) -> None:
        # at interpreter exit another (daemon) thread may be inside sleep/wake: wait for it to
        # finish instead of freeing memory under it; later calls then raise "closed"
        import sys

        if flight and flight[0] is not None:  # a progressive wake's worker maps and copies without the lock
            try:
                flight[0]._finished.wait(60)
            except Exception:  # pragma: no cover
                pass

        locked = lock.acquire(timeout=60) if lock is not None else False
        exiting = sys.is_finalizing()
        try:
            if shut is not None:
                shut.set()
            try:
                driver.synchronize()
            except Exception:
                pass
            try:
                driver.settle_releases()
            except Exception as e:  # best effort at shutdown
                log.warning("%s", e)
            for a in list(allocs.values()):
                keep = a.keep() if a.keep is not None else None
                try:
                    if keep is None or exiting:
                        a.region.free(driver)
                    else:  # live tensors point here: free the memory, keep the addresses fenced
                        a.region.release(driver)
                        weakref.finalize(keep, _free_address, driver, a.region.va, a.region.size)
                except Exception:  # best effort at shutdown
                    pass
            allocs.clear()
            try:
                store.close()
            finally:
                driver.close()
        finally:
            if locked:
                lock.release()

    # ------------------------------------------------------------------ internals
    def _done(self, rep: Report) -> Report:
        self.last_report = rep
        log.info("%s", rep)
        return rep

    def _check_open(self) -> None:
        if self._closed or self._shut.is_set():
            raise LifecycleClosedError(
                "this MemoryLifecycle is closed (close(), garbage collection or interpreter exit): its memory was "
                "released and every tag reads 'closed'. Create a new MemoryLifecycle; nothing was touched."
            )

    def _check_tags(self, tags: Iterable[str]) -> None:
        unknown = [t for t in tags if t not in self._tags]
        if unknown:
            known = ", ".join(repr(t) for t in self._tags) or "none yet"
            raise UnknownTagError(f"unknown tag(s) {', '.join(map(repr, unknown))}; known tags: {known}")

    def _check_can_allocate(self, tag: str) -> None:
        _check_tag_name(tag)
        self._check_open()
        st = self._tags.get(tag, AWAKE)
        if st in (WAKING, SLEEPING):
            raise CopyInFlightError(
                f"tag {tag!r} is {st} (its copies are in flight); call wait() before allocating into it. "
                "Nothing was allocated."
            )
        if st != AWAKE:
            raise InvalidTransitionError(
                f"tag {tag!r} is asleep ({st}); wake it (wake_up([{tag!r}])) before allocating into it"
            )

    def _keep(self, alloc: Allocation) -> "_Keep":
        keep = alloc.keep() if alloc.keep is not None else None
        if keep is None:
            keep = _Keep(self)
            alloc.keep = weakref.ref(keep)
        return keep

    def _hold(self, t, alloc: Allocation):
        """Make sure ``t`` holds its allocation's keeper (drivers whose views cannot carry an
        owner get it as an attribute of the tensor)."""
        if not self._driver.views_hold_owner:
            try:
                t._unisleep_keep = self._keep(alloc)
            except (AttributeError, RuntimeError):
                pass
        return t

    def _check_room(self, nbytes: int, tag: str) -> None:
        """Refuse, before anything is committed, an allocation larger than the free memory."""
        if nbytes <= 0:
            return
        self._driver.settle_releases()  # its error is raised, not taken for "cannot tell"
        try:
            free, total = self._driver.memory_info()
        except Exception:  # a backend that cannot tell: let the allocation itself fail
            return
        if free and nbytes > free:
            raise InsufficientMemoryError(
                f"{human_bytes(nbytes)} asked for tag {tag!r}, but only {human_bytes(free)} of "
                f"{human_bytes(total)} {self._driver.name} memory is free. Ask for less, or free memory "
                "first (e.g. sleep another lifecycle). Nothing was allocated."
            )

    def _free_allocation(self, alloc: Allocation, drop_tag: bool) -> None:
        self._allocs.pop(alloc.id, None)
        self._by_va.pop(alloc.region.va, None)
        self._drop_backup(alloc)
        try:
            alloc.region.free(self._driver)
        finally:
            if drop_tag and not any(a.tag == alloc.tag for a in self._allocs.values()):
                self._tags.pop(alloc.tag, None)

    def _is_corrupt(self, tag: str) -> bool:
        return any(a.corrupt for a in self._allocs.values() if a.tag == tag)

    def _reserve(self, saves) -> list:
        """Take the room of every backup that will be written; on failure give it all back."""
        reserved = []
        try:
            for job in saves:
                if job.skip_copy:
                    continue
                for off, n in job.ranges:
                    self._store.reserve((job.key, off), n)
                    reserved.append((job.key, off))
        except BaseException as e:
            for key in reserved:
                self._store.drop(key)
            self._forget_pending(saves)
            raise self._backup_error(e, saves, "sleep") from e
        return reserved

    def _forget_pending(self, saves) -> None:
        for job in saves:
            a = self._allocs.get(job.key)
            if a is not None:
                a.pending_digest = None

    def _undo_sleep(self, saves, discards, reserved, hooked_tags) -> None:
        """Put every region of a failed sleep back as it was: remap what was released and read
        its bytes back from the (complete) backup; remove the partial backup.  A region that
        cannot be brought back exactly marks its tag lost."""
        lost: set[str] = set()
        try:
            self._store.flush()
        except BaseException:
            pass
        for job in saves:
            a = self._allocs[job.key]
            region = job.region
            released = [c for c in region.chunks if c.handle is None]
            if not released:
                continue
            full = job.ranges == [(0, region.size)]
            try:
                region.map(self._driver)
                if not full:
                    raise BackupLostError(f"a partly saved region of tag {a.tag!r} was released")
                for c in released:
                    self._store.load_range((job.key, 0), c.offset, self._driver.view(region.va + c.offset, c.size))
                self._store.flush()
                self._driver.synchronize()
            except BaseException as e:  # pragma: no cover - needs a second failure during the undo
                log.error("could not bring back tag %r after a failed sleep: %s", a.tag, e)
                lost.add(a.tag)
        for region in discards:
            if not region.mapped:
                try:
                    region.map(self._driver)
                    if not self._driver.fresh_memory_is_zero:
                        self._driver.zero(region.va, region.size)
                except BaseException:  # pragma: no cover
                    pass
                lost.add(self._by_va[region.va].tag)  # discarded bytes are gone
        for key in reserved:
            self._store.drop(key)
        for tag in lost:
            self._tags[tag] = LOST
        if hooked_tags:
            for hook in self._after_wake:
                try:
                    hook(hooked_tags)
                except Exception as e:  # pragma: no cover
                    log.error("after_wake hook failed while undoing a sleep: %s", e)

    def _backup_error(self, e: BaseException, saves, what: str) -> BackupError:
        tags = sorted({self._allocs[j.key].tag for j in saves if j.key in self._allocs})
        nbytes = sum(n for j in saves if not j.skip_copy for _, n in j.ranges)
        lost = sorted(t for t, s in self._tags.items() if s == LOST)
        path = getattr(e, "path", None) or getattr(e, "filename", None)
        state = (
            f"tag(s) {', '.join(map(repr, lost))} could not be restored and are marked lost"
            if lost
            else "nothing was released: every tag is as it was (mapped, bytes exact) and the partial backup was removed"
        )
        cause = str(e) if isinstance(e, BackupError) else f"{type(e).__name__}: {e}"
        where = "" if (path and path in cause) else (f" to {path}" if path else f" ({self._store.where})")
        msg = (
            f"{what} failed while backing up {human_bytes(nbytes)} of tag(s) {', '.join(map(repr, tags)) or '-'}"
            f"{where}: {cause}. {state[0].upper() + state[1:]}."
        )
        err = (BackupLostError if lost else BackupError)(msg, tag=(lost or tags or [None])[0], nbytes=nbytes, path=path, cause=e)
        return err

    def _failed_wake(self, tag: str, allocs: list, e: BaseException) -> BackupError:
        """A wake of ``tag`` failed: unmap what it mapped so nothing unverified is exposed and
        the tag stays asleep; a corrupt backup is remembered (the tag may then be discarded)."""
        try:
            for a in allocs:
                a.region.release(self._driver)
        except BaseException as e2:  # pragma: no cover
            log.error("could not unmap tag %r after a failed wake: %s", tag, e2)
            self._tags[tag] = LOST
        if isinstance(e, BackupCorruptError):
            for a in allocs:
                if a.saved:
                    a.corrupt = True
            err = BackupCorruptError(
                f"tag {tag!r} was not woken: {e}. It stays {self._tags[tag]!r} with its memory unmapped; discard it "
                f"(discard([{tag!r}]) or sleep(level=2)), then wake it (zeros) and load the weights again, e.g. by a "
                "weight transfer.", tag=tag, nbytes=e.nbytes, path=e.path, cause=e,
            )
        else:
            err = BackupError(
                f"tag {tag!r} was not woken: {type(e).__name__}: {e}. It stays {self._tags[tag]!r}; wake it again "
                "once the cause is fixed.", tag=tag, cause=e,
            )
        return err

    def _settle(self, settle: dict[str, str]) -> int:
        """Corrupt or lost tags that become discarded: drop their backup, release what is mapped."""
        released = 0
        for a in self._allocs.values():
            if a.tag in settle:
                released += a.region.release(self._driver)
                self._drop_backup(a)
                a.corrupt = False
        return released

    def _new_allocation(self, tag: str, nbytes: int) -> Allocation:
        self._check_can_allocate(tag)
        region = Region.allocate(self._driver, nbytes, self.chunk_bytes)
        if not self._driver.fresh_memory_is_zero:
            self._driver.zero(region.va, region.size)
        alloc = Allocation(next(self._ids), tag, region, nbytes)
        self._allocs[alloc.id] = alloc
        self._by_va[region.va] = alloc
        self._tags.setdefault(tag, AWAKE)
        return alloc

    def _preserved_ranges(self, a: Allocation) -> list[tuple[int, int]]:
        if not self._preserve or not a.names:
            return []
        spans = sorted(
            (off, n) for name, (off, n) in a.names.items() if any(fnmatch.fnmatchcase(name, p) for p in self._preserve)
        )
        merged: list[list[int]] = []
        for off, n in spans:  # merge overlaps (tied names)
            if merged and off <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], off + n - merged[-1][0])
            else:
                merged.append([off, n])
        return [(o, n) for o, n in merged if n]

    def _plan_sleep(self, plan: dict[str, str]):
        saves, discards, offloads = [], [], []
        for a in self._allocs.values():
            want = plan.get(a.tag)
            if want is None:
                continue
            if want == OFFLOADED:
                offloads.append(a)
            else:
                keep = self._preserved_ranges(a)
                if keep:
                    self._drop_backup(a)
                    saves.append(SaveJob(a.id, a.region, keep))
                else:
                    discards.append(a.region)
        retain = self._driver.retain_backups
        skip = self._unchanged(offloads) if retain else set()
        for a in offloads:
            copy = a.id not in skip
            saves.append(SaveJob(a.id, a.region, [(0, a.region.size)], skip_copy=not copy, want_digest=retain and copy))
        return saves, discards

    def _unchanged(self, allocs: list) -> set:
        """Ids of the allocations whose bytes equal their retained full backup, proven by the
        keyed digest under that backup's key (one batch, one device wait); those keep their
        digest (``pending_digest``).  Every other one is copied, and its save job gets a fresh
        key: the driver digests it while the copies run (:meth:`Driver.take_digests`)."""
        retained = [a for a in allocs if a.digest is not None and a.saved == [(0, a.region.size)] and not a.corrupt]
        same = set()
        if retained:
            views = [self._driver.view(a.region.va, a.region.size) for a in retained]
            now = self._driver.keyed_digests(views, [a.digest[0] for a in retained])
            same = {a.id for a, d in zip(retained, now) if d == a.digest[1]}
        for a in allocs:
            a.pending_digest = a.digest if a.id in same else None
        return same

    def _ensure_backup_fits(self, need: int, keep_ids: set[int]) -> None:
        if need <= 0:
            return
        try:
            self._store.ensure_fits(need)
            return
        except HostBudgetError:
            pass
        # evict retained backups of memory that is awake (they only speed up the next sleep)
        for a in self._allocs.values():
            if a.saved and self._tags.get(a.tag) == AWAKE and a.id not in keep_ids:
                self._drop_backup(a)
        self._store.ensure_fits(need)

    def _drop_backup(self, a: Allocation) -> None:
        for off, _ in a.saved:
            self._store.drop((a.id, off))
        a.saved = []
        a.digest = None

    def _after_restore_safely(self, a: Allocation) -> None:
        """:meth:`_after_restore` once the bytes are back and verified: a failure of that
        bookkeeping (dropping a backup no longer needed) never makes the restored memory look
        asleep — the tag is awake, the failure is logged."""
        try:
            self._after_restore(a)
        except Exception as e:
            log.warning("tag %r is awake (its bytes were restored and verified), but dropping its backup failed: "
                        "%s: %s; the backup stays recorded", a.tag, type(e).__name__, e)

    def _after_restore(self, a: Allocation) -> None:
        full = a.saved == [(0, a.region.size)]
        if not (full and self._driver.retain_backups and a.digest is not None):
            # device bytes equal a retained full backup (digest taken when it was written);
            # anything else is dropped
            self._drop_backup(a)


# ---------------------------------------------------------------------- helpers
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _free_address(driver, va: int, size: int) -> None:
    try:
        driver.free_address(va, size)
    except Exception:  # pragma: no cover - best effort once the last tensor died
        pass


def _cannot_adopt(t) -> Optional[str]:
    import torch

    if t.device.type == "meta":
        return "it is a meta tensor (no data); materialise the model first (e.g. to_empty() and load the weights)"
    if t.layout != torch.strided:
        return f"its layout is {t.layout} (sparse or otherwise not strided); only dense tensors can be adopted"
    if t.is_quantized:
        return "it is a quantized tensor; adopt the dequantized or packed storage instead"
    try:
        t.untyped_storage()
    except Exception as e:
        return f"it has no plain storage ({e})"
    return None


def _check_storages_passed_whole(storages: dict) -> None:
    """Refuse (before anything moves) a storage some of whose tensors were not passed to
    ``adopt()``; ``storages`` maps each storage to its passed ``(names, tensor)`` pairs.

    Each tensor on a storage holds one reference to it: a count above the passed tensors (and
    the bases their views keep alive) is another tensor — an unpassed view, a held
    ``state_dict()`` entry, a ``.data``/``.detach()`` alias.  A passed view whose base was not
    passed is refused when that base is held by anyone else than its views (a variable, a
    module); a base only its views keep alive (``torch.arange(n).reshape(a, b)``) is nobody's
    to track and moves with them."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    probe = _base_refs(torch.empty(2)[:1])  # an unheld base kept alive by one view: the baseline
    for members in storages.values():
        ids = {id(t) for _, t in members}
        views: dict[int, list] = {}  # id of an unpassed base -> [(names, view)] of passed views
        for names, t in members:
            if t._base is not None and id(t._base) not in ids:
                views.setdefault(id(t._base), []).append((names, t))
        if use_count is not None:
            st = members[0][1].untyped_storage()
            extra = use_count(st._cdata) - 1 - len(ids) - len(views)  # 1: ``st`` itself
            nbytes = st.nbytes()
            del st
            if extra > 0:
                names = [n for ns, _ in members for n in ns]
                shown = ", ".join(map(repr, names[:4])) + (" ..." if len(names) > 4 else "")
                raise InvalidArgumentError(
                    f"adopt() cannot move {shown}: {extra} other tensor(s) share its storage ({human_bytes(nbytes)}) "
                    "but were not passed — a view of it, the tensor it is a view of, or an alias such as a held "
                    "state_dict() entry, .data or .detach(); after the move they would keep pointing at the old "
                    "memory and silently stop tracking it. Pass them in the same adopt() call (e.g. adopt the whole "
                    "module, or adopt({'base': t, 'view': v})), or drop them (del) first. Nothing was moved."
                )
        for passed in views.values():
            names, t = passed[0]
            refs = _base_refs(t)
            if refs[0] > probe[0] or (refs[1] >= 0 and refs[1] - (len(passed) - 1) > probe[1]):
                raise InvalidArgumentError(
                    f"adopt() cannot move {names[0]!r}: it is a view (shape {tuple(t.shape)}) of a tensor of shape "
                    f"{tuple(t._base.shape)} that was not passed and is still in use; moved alone it would leave "
                    "that base tensor on the old memory and the two would silently stop sharing their bytes. Pass "
                    f"the base tensor in the same adopt() call (e.g. adopt({{'base': base, {names[0]!r}: view}}), "
                    "or adopt the module that owns it), or pass view.clone() to adopt an independent copy. Nothing "
                    "was moved."
                )


def _base_refs(view) -> tuple[int, int]:
    """(Python references, tensor references) of ``view``'s base, as seen from here."""
    import sys

    b = view._base
    uc = getattr(b, "_use_count", None)
    return sys.getrefcount(b), (uc() if uc is not None else -1)


def _check_tag_name(tag) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"tag must be a non-empty string, got {tag!r}")


def _as_tag_list(tags, what: str = "tags") -> list[str]:
    if isinstance(tags, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a list of tags, not the string {tags!r}: write [{tags!r}]")
    try:
        out = list(tags)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a list of tag names, got {tags!r}") from None
    for t in out:
        _check_tag_name(t)
    return out


def _named_tensors(obj, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    seen: set[tuple[int, str]] = set()

    def emit(name, t):  # the same tensor may come under several names (tied weights)
        if isinstance(t, torch.Tensor) and (id(t), name) not in seen and t.numel() > 0:
            seen.add((id(t), name))
            yield name, t

    def walk(o, pre):
        if isinstance(o, torch.Tensor):
            yield from emit(pre or "tensor", o)
        elif isinstance(o, torch.nn.Module):
            for n, p in o.named_parameters(remove_duplicate=False):
                yield from emit(_join(pre, n), p)
            for n, b in o.named_buffers(remove_duplicate=False):
                yield from emit(_join(pre, n), b)
        elif isinstance(o, torch.optim.Optimizer):
            for i, (p, st) in enumerate(o.state.items()):
                for k, v in st.items():
                    yield from emit(_join(pre, f"state.{i}.{k}"), v)
        elif isinstance(o, Mapping):
            for k, v in o.items():
                yield from walk(v, _join(pre, str(k)))
        elif isinstance(o, Iterable) and not isinstance(o, (str, bytes)):
            for i, v in enumerate(o):
                yield from walk(v, _join(pre, str(i)))

    yield from walk(obj, prefix)


def _join(pre: str, name: str) -> str:
    return f"{pre}.{name}" if pre else name
