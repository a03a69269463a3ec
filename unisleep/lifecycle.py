"""``MemoryLifecycle``: tagged memory that sleeps (freed for real) and wakes (same addresses).

Policy, in one place, for every platform:

* level 1 — tag ``"weights"`` and any ``offload_tags`` are backed up, every other tag is discarded;
* level 2 — everything is discarded, except adopted parameters matched by :meth:`preserve`
  (and ``offload_tags``, which are backed up at any level, e.g. a CUDA-graph pool);
* wake restores backed-up bytes exactly; discarded bytes come back as zeros; no address moves;
* an illegal move raises before anything changes.
"""

from __future__ import annotations

import atexit
import fnmatch
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from .driver import BackupStore, Driver, RestoreJob, SaveJob
from .errors import (
    HostBudgetError,
    InvalidArgumentError,
    InvalidTransitionError,
    UnknownTagError,
)
from .region import Region, round_up

log = logging.getLogger("unisleep")

AWAKE, OFFLOADED, DISCARDED = "awake", "offloaded", "discarded"
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
        }

    def __str__(self) -> str:
        return (
            f"{self.operation} {','.join(self.tags) or '-'}: released {self.bytes_released / 2**30:.3f} GiB, "
            f"copied {self.bytes_copied / 2**30:.3f} GiB in {self.seconds * 1e3:.1f} ms"
            + (f" ({self.gbps:.1f} GB/s)" if self.bytes_copied else "")
        )


@dataclass
class Allocation:
    id: int
    tag: str
    region: Region
    nbytes: int  # bytes in use (<= region.size)
    names: dict[str, tuple[int, int]] = field(default_factory=dict)  # adopted name -> (offset, nbytes)
    saved: list[tuple[int, int]] = field(default_factory=list)  # ranges in the backup now
    digest: Any = None  # checksum of the retained full backup (skip-unchanged)
    external: bool = False  # created by the framework's allocator through pool()
    pending_digest: Any = None  # digest taken by the sleep in progress


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
    """

    def __init__(
        self,
        platform=None,
        *,
        device: int = 0,
        host_budget_bytes: Optional[int] = None,
        spill_dir: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        **driver_options: Any,
    ):
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise InvalidArgumentError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        self._driver = platform if isinstance(platform, Driver) else _resolve_driver(platform, device, driver_options)
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
        self._finalizer = weakref.finalize(
            self, MemoryLifecycle._finalize, self._driver, self._store, self._allocs, self._lock, self._shut
        )
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------ introspection
    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def torch_device(self):
        return self._driver.torch_device

    def state(self) -> dict[str, str]:
        with self._lock:
            return dict(self._tags)

    @property
    def is_sleeping(self) -> bool:
        with self._lock:
            return any(s != AWAKE for s in self._tags.values())

    @property
    def tags(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def resident_bytes(self, tag: Optional[str] = None) -> int:
        """Physical bytes the backend holds now, read from the backend (not from bookkeeping)."""
        with self._lock:
            if tag is not None:
                self._check_tags([tag])
            return sum(a.region.physical_bytes(self._driver) for a in self._allocs.values() if tag in (None, a.tag))

    def allocated_bytes(self, tag: Optional[str] = None) -> int:
        """Bytes reserved for allocations (awake or not), rounded up to the granularity."""
        with self._lock:
            return sum(a.region.size for a in self._allocs.values() if tag in (None, a.tag))

    def backup_bytes(self) -> int:
        return self._store.held_bytes

    @property
    def backup_location(self) -> str:
        return self._store.where

    def names(self, tag: Optional[str] = None) -> list[str]:
        with self._lock:
            return [n for a in self._allocs.values() if tag in (None, a.tag) for n in a.names]

    # ------------------------------------------------------------------ allocation
    def empty(self, shape, dtype=None, *, tag: str):
        """A new tensor of ``shape``/``dtype`` in lifecycle memory under ``tag`` (contents zero)."""
        import torch

        dtype = dtype or torch.float32
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            alloc = self._new_allocation(tag, nbytes)
            t = self._driver.view(alloc.region.va, max(nbytes, 1))[:nbytes]
            return t.view(dtype).view(shape)

    def adopt(self, obj, *, tag: str = "weights"):
        """Move the storage of ``obj``'s tensors into lifecycle memory, in place.

        ``obj`` may be an ``nn.Module`` (parameters and buffers), an optimizer (its state), a
        tensor, a mapping or an iterable of those.  Python objects stay the same; each tensor's
        ``data_ptr()`` changes once and then stays fixed across every sleep/wake.  Tensors that
        share a storage (tied weights, views) keep sharing it.  Returns ``obj``.
        """
        import torch

        named = list(_named_tensors(obj))
        if not named:
            raise InvalidArgumentError(f"adopt() found no tensors in {type(obj).__name__}")
        with self._lock:
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
            offsets, total = {}, 0
            for key in storages:
                offsets[key] = total
                total = round_up(total + max(key[2], 1), _ALIGN)
            alloc = self._new_allocation(tag, total)
            dev = self._driver.torch_device
            base = self._driver.view(alloc.region.va, alloc.region.size)
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
                    with torch.no_grad():
                        t.data = moved
                    # byte range in the region: byte_off is already region-relative (the storage
                    # starts at the region's va); the extent covers strided views too
                    extent = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))
                    for name in names:
                        alloc.names[name] = (byte_off, extent * elem)
            self._driver.synchronize()
            return obj

    def preserve(self, patterns: Sequence[str] | str) -> list[str]:
        """Globs over adopted names kept across a level-2 sleep (like vLLM's
        ``--sleep-preserve-parameter-names``).  Returns the names matched; a pattern matching
        nothing raises."""
        pats = [patterns] if isinstance(patterns, str) else list(patterns)
        with self._lock:
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
        with self._lock:
            self._check_open()
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
    def sleep(self, level: int = 1, *, offload_tags: Optional[Iterable[str]] = None) -> Report:
        """Release memory.  Level 1 backs up ``"weights"`` (and ``offload_tags``) and discards the
        rest; level 2 discards everything but preserved parameters (and ``offload_tags``)."""
        if level not in LEVELS:
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        offload = set(offload_tags or ())
        with self._lock:
            self._check_open()
            self._check_tags(offload)
            plan: dict[str, str] = {}
            for tag, cur in self._tags.items():
                want = OFFLOADED if (tag in offload or (level == 1 and tag == "weights")) else DISCARDED
                if cur == AWAKE:
                    plan[tag] = want
                elif cur != want:
                    raise InvalidTransitionError(
                        f"tag {tag!r} is already asleep as {cur!r}; a level-{level} sleep would make it {want!r}. "
                        f"Wake it first (wake_up([{tag!r}])) — nothing was changed."
                    )
            t0 = time.perf_counter()
            saves, discards = self._plan_sleep(plan)
            for job in saves:  # a retained backup of bytes that changed since is stale
                if not job.skip_copy and self._allocs[job.key].saved:
                    self._drop_backup(self._allocs[job.key])
            need = sum(n for j in saves if not j.skip_copy for _, n in j.ranges)
            retained = sum(n for j in saves if j.skip_copy for _, n in j.ranges)
            self._ensure_backup_fits(need, keep_ids={j.key for j in saves})
            for hook in self._before_sleep:
                hook(level, sorted(plan))
            released, copied = self._driver.suspend(saves, discards, self._store)
            for job in saves:
                a = self._allocs[job.key]
                a.saved = list(job.ranges)
                a.digest, a.pending_digest = a.pending_digest, None
            for region in discards:
                a = self._by_va[region.va]
                self._drop_backup(a)
            for tag, st in plan.items():
                self._tags[tag] = st
            rep = Report(f"sleep(level={level})", sorted(plan), released, copied, time.perf_counter() - t0)
            if retained:
                log.debug("skipped copying %d unchanged bytes", retained)
            return self._done(rep)

    def discard(self, tags: Iterable[str]) -> Report:
        """Release the memory of ``tags`` now, with no backup (e.g. the KV cache only)."""
        tags = _as_tag_list(tags)
        with self._lock:
            self._check_open()
            self._check_tags(tags)
            for t in tags:
                if self._tags[t] == OFFLOADED:
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
            for t in todo:
                self._tags[t] = DISCARDED
            return self._done(Report("discard", todo, released, 0, time.perf_counter() - t0))

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> Report:
        """Map memory back at the same addresses: all tags, or only ``tags`` (e.g. ``["weights"]``
        then ``["kv_cache"]``).  Waking an awake tag is a no-op."""
        with self._lock:
            self._check_open()
            if tags is None:
                todo = [t for t, s in self._tags.items() if s != AWAKE]
            else:
                tags = _as_tag_list(tags)
                self._check_tags(tags)
                todo = [t for t in tags if self._tags[t] != AWAKE]
            t0 = time.perf_counter()
            jobs = []
            for a in self._allocs.values():
                if a.tag not in todo:
                    continue
                full = a.saved == [(0, a.region.size)]
                jobs.append(RestoreJob(a.id, a.region, list(a.saved), zero=not full))
            # on failure what got mapped stays mapped; the tags stay asleep, so a retry completes
            copied = self._driver.resume(jobs, self._store)
            for a in self._allocs.values():
                if a.tag in todo:
                    self._after_restore(a)
            for t in todo:
                self._tags[t] = AWAKE
            for hook in self._after_wake:
                hook(None if tags is None else list(todo))
            return self._done(Report("wake_up", todo, 0, copied, time.perf_counter() - t0))

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free every region and backup.  Idempotent; also runs at interpreter exit.  Tensors
        that still point into lifecycle memory must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _finalize(driver: Driver, store: BackupStore, allocs: dict, lock=None, shut=None) -> None:
        # at interpreter exit another (daemon) thread may be inside sleep/wake: wait for it to
        # finish instead of freeing memory under it; later calls then raise "closed"
        locked = lock.acquire(timeout=60) if lock is not None else False
        try:
            if shut is not None:
                shut.set()
            try:
                driver.synchronize()
            except Exception:
                pass
            for a in list(allocs.values()):
                try:
                    a.region.free(driver)
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
            raise InvalidTransitionError("this MemoryLifecycle is closed; create a new one")

    def _check_tags(self, tags: Iterable[str]) -> None:
        unknown = [t for t in tags if t not in self._tags]
        if unknown:
            known = ", ".join(repr(t) for t in self._tags) or "none yet"
            raise UnknownTagError(f"unknown tag(s) {', '.join(map(repr, unknown))}; known tags: {known}")

    def _check_can_allocate(self, tag: str) -> None:
        _check_tag_name(tag)
        self._check_open()
        st = self._tags.get(tag, AWAKE)
        if st != AWAKE:
            raise InvalidTransitionError(
                f"tag {tag!r} is asleep ({st}); wake it (wake_up([{tag!r}])) before allocating into it"
            )

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
        saves, discards = [], []
        for a in self._allocs.values():
            want = plan.get(a.tag)
            if want is None:
                continue
            if want == OFFLOADED:
                whole = [(0, a.region.size)]
                skip = False
                if self._driver.retain_backups:
                    # digest of the bytes now; equal to the retained backup's digest => skip the copy
                    now = self._driver.checksum(self._driver.view(a.region.va, a.region.size))
                    skip = a.digest is not None and a.saved == whole and now == a.digest
                    a.pending_digest = now
                saves.append(SaveJob(a.id, a.region, whole, skip_copy=skip))
            else:
                keep = self._preserved_ranges(a)
                if keep:
                    self._drop_backup(a)
                    saves.append(SaveJob(a.id, a.region, keep))
                else:
                    discards.append(a.region)
        return saves, discards

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

    def _after_restore(self, a: Allocation) -> None:
        full = a.saved == [(0, a.region.size)]
        if not (full and self._driver.retain_backups and a.digest is not None):
            # device bytes equal a retained full backup (digest taken when it was written);
            # anything else is dropped
            self._drop_backup(a)


# ---------------------------------------------------------------------- helpers
def _check_tag_name(tag) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"tag must be a non-empty string, got {tag!r}")


def _as_tag_list(tags) -> list[str]:
    if isinstance(tags, str):
        tags = [tags]
    out = list(tags)
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
