"""Progressive wake and background sleep: hide the bus behind the model's own work.

A level-1 wake cannot copy 8 GiB faster than the bus allows, but a forward pass does not need all
of it at once.  ``MemoryLifecycle.wake_up(tags, progressive=True)`` returns at once with a
:class:`ProgressiveWake`: worker threads map the regions (chunk by chunk, or the first chunk and
then all the others where the backend maps ahead) and copy the backup back in the order the model uses it (the adoption order, or a given module order), one *step*
at a time, each step with a fence (a device event on accelerators; on the host the step is
complete — read back and checksum-verified — when its fence is set).  ``lc.ready(module)``
makes the caller's later work wait for the steps holding that module's tensors only, and
:meth:`ProgressiveWake.install_hooks` (``lc.install_ready_hooks(model)``) does it in a forward
pre-hook of every module that holds tensors.

The other direction, ``sleep(level, background=True)``, is :class:`~.flight.BackgroundSleep`.

While either is in flight the tags involved are ``"waking"`` / ``"sleeping"`` in
:meth:`~unisleep.lifecycle.MemoryLifecycle.state`; ``lc.wait()`` waits for the end, and a
lifecycle call that would touch those tags (``sleep``, ``wake_up``, ``discard``, ``empty``,
``adopt``) raises :class:`~unisleep.errors.CopyInFlightError` before anything changes.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import graph_capture
from ..errors import BackupError, InvalidArgumentError

log = logging.getLogger("unisleep")


@dataclass(eq=False)
class Step:
    """One piece of a progressive wake: bytes ``[lo, hi)`` of an allocation's region."""

    index: int
    alloc: Any  # lifecycle Allocation
    lo: int
    hi: int
    chunks: list  # region chunks overlapping [lo, hi): mapped before the step's copy is queued
    loads: list  # [(saved_offset, lo, hi)] region-relative ranges restored from the backup
    zero: bool  # zero [lo, hi) first (bytes not in the backup come back zeroed)
    fence: Any = None
    error: Optional[BaseException] = None
    queued: threading.Event = field(default_factory=threading.Event)


def _tensors(obj, recurse: bool = True) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters(recurse=recurse)) + list(obj.buffers(recurse=recurse))
    try:
        return [t for t in obj if isinstance(t, torch.Tensor)]
    except TypeError:
        raise InvalidArgumentError(
            f"ready()/order take an nn.Module, a tensor or a list of tensors, got {type(obj).__name__}"
        ) from None


def _span(t) -> tuple[int, int]:
    """(first byte address, bytes) a tensor touches, strides included."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    extent = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()) if s > 0)
    return t.data_ptr(), extent * t.element_size()


def plan_steps(allocs: list, piece: Optional[int], order=None) -> list[Step]:
    """The steps of a progressive wake of ``allocs`` (each Allocation's ``saved`` ranges come
    from the backup, the rest is zeroed): a step never crosses a mapping chunk and is at most
    ``piece`` bytes; steps come in region-offset order (the adoption order), or first those
    holding the tensors of ``order`` (a list of modules/tensors, in use order) and then the rest."""
    pieces = []
    for a in allocs:
        region = a.region
        full = a.saved == [(0, region.size)]
        for c in region.chunks:
            step = piece if piece else c.size
            for lo in range(c.offset, c.offset + c.size, step):
                hi = min(c.offset + c.size, lo + step)
                loads = [(s_off, max(lo, s_off), min(hi, s_off + n)) for s_off, n in a.saved
                         if max(lo, s_off) < min(hi, s_off + n)]
                pieces.append(Step(0, a, lo, hi, [c], loads, zero=not full))
    if order is not None:
        order = list(order)
        rank: dict[int, int] = {}
        starts = {id(a): [p for p in pieces if p.alloc is a] for a in allocs}
        los = {k: [p.lo for p in v] for k, v in starts.items()}
        for i, item in enumerate(order):
            for t in _tensors(item):
                ptr, n = _span(t)
                for a in allocs:
                    va = a.region.va
                    if va <= ptr < va + a.region.size:
                        lst = starts[id(a)]
                        j = max(0, bisect.bisect_right(los[id(a)], ptr - va) - 1)
                        while j < len(lst) and lst[j].lo < ptr - va + max(n, 1):
                            rank.setdefault(id(lst[j]), i)
                            j += 1
        natural = {id(p): k for k, p in enumerate(pieces)}
        pieces.sort(key=lambda p: (rank.get(id(p), len(order)), natural[id(p)]))
    for i, p in enumerate(pieces):
        p.index = i
    return pieces


class ProgressiveWake:
    """A wake in flight (see the module docstring).  Created by
    ``MemoryLifecycle.wake_up(tags, progressive=True)``; use :meth:`ready`, :meth:`install_hooks`
    and :meth:`wait` (or the lifecycle's methods of the same names).

    What the lifecycle reads once it ends: ``tags``, ``allocs``, ``steps``, ``previous`` (each
    tag's state before the wake), ``started`` (``time.perf_counter()`` of the call),
    ``returned_s`` and ``error``."""

    def __init__(self, owner, driver, store, tags: list[str], allocs: list, steps: list[Step], started: float):
        self._owner = owner  # the lifecycle: its public ready() and wait()
        self._driver, self._store = driver, store
        self.tags = list(tags)
        self.allocs = allocs
        self.steps = steps
        self.started = started
        self.previous: dict[str, str] = {}
        self.returned_s: Optional[float] = None  # how long wake_up took to return
        #: where the worker's time went: mapping the first chunk, mapping the rest (backends
        #: that map ahead), every step queued (seconds since the call)
        self.timings: dict[str, float] = {}
        self.error: Optional[BaseException] = None
        self._finished = threading.Event()  # the worker queued (host: completed) every step
        self._by_alloc = {id(a): [s for s in sorted(steps, key=lambda s: s.lo) if s.alloc is a] for a in allocs}
        self._lo = {k: [s.lo for s in v] for k, v in self._by_alloc.items()}
        self._cache: dict[int, list[Step]] = {}
        self._workers = max(1, int(driver.config.progressive_workers or 1)) if len(steps) > 1 else 1
        self._next = 0  # index of the next step a worker takes (under _take)
        self._take = threading.Lock()
        self._chunk_locks: dict[int, threading.Lock] = {}
        self._running = self._workers
        self._threads = [threading.Thread(target=self._run, name=f"unisleep-wake-{i}", daemon=True)
                         for i in range(self._workers)]

    # ---- worker --------------------------------------------------------------------------
    def start(self) -> None:
        if not self.steps:  # nothing to copy: ended already
            self._finished.set()
            return
        graph_capture.add_drainer(self.wait_queued)  # a capture waits until every step is queued
        for t in self._threads:
            t.start()

    def _take_step(self) -> Optional[Step]:
        """The next step in use order (workers take them in order; with several workers they
        complete roughly, not exactly, in order — :meth:`ready` waits for each step it needs)."""
        with self._take:
            if self.error is not None or self._next >= len(self.steps):
                return None
            step = self.steps[self._next]
            self._next += 1
            return step

    def _map(self, region, c) -> None:
        if c.handle is not None:
            return
        if self._workers == 1:
            region.map_chunk(self._driver, c)
            return
        with self._take:
            lock = self._chunk_locks.setdefault(id(c), threading.Lock())
        with lock:  # two workers may need the same chunk
            region.map_chunk(self._driver, c)

    def _run(self) -> None:
        driver, store = self._driver, self._store
        cur = None
        try:
            with graph_capture.background(), driver.progressive_context(store):
                ahead = driver.config.progressive_map_ahead and self._workers == 1
                t0 = time.perf_counter()
                while True:
                    cur = step = self._take_step()
                    if step is None:
                        break
                    region = step.alloc.region
                    if any(c.handle is None for c in step.chunks):
                        if ahead and step.index > 0:  # map every chunk left now, in one go
                            t1 = time.perf_counter()
                            for st in self.steps[step.index:]:
                                for c in st.chunks:
                                    self._map(st.alloc.region, c)
                            self.timings["map_rest_s"] = time.perf_counter() - t1
                        for c in step.chunks:
                            self._map(region, c)
                        if step.index == 0:
                            self.timings["map_first_s"] = time.perf_counter() - t0
                    hook = driver.hooks.restore
                    if hook is not None:
                        hook(region.va + step.lo, step.hi - step.lo)
                    if step.zero and not driver.capabilities.fresh_memory_is_zero:
                        driver.zero(region.va + step.lo, step.hi - step.lo)
                    for s_off, lo, hi in step.loads:
                        store.load_range((step.alloc.id, s_off), lo - s_off, driver.view(region.va + lo, hi - lo))
                    step.fence = driver.fence()
                    step.queued.set()
                    cur = None
        except BaseException as e:  # kept: ready() and the hooks raise it in the waiting thread
            with self._take:
                if self.error is None:
                    self.error = e
            if cur is not None:
                cur.error = e
                cur.queued.set()
        finally:
            with self._take:
                self._running -= 1
                last = self._running == 0
            if last:
                if self.error is not None:  # every step not done carries the error
                    for st in self.steps:
                        if not st.queued.is_set():
                            st.error = self.error
                            st.queued.set()
                else:
                    self.timings["queued_s"] = time.perf_counter() - self.started
                self._finished.set()

    # ---- the caller's side ---------------------------------------------------------------
    def _needed(self, obj) -> list[Step]:
        """The steps holding the tensors of ``obj``, in step order."""
        key = id(obj)
        if key in self._cache:
            return self._cache[key]
        need: dict[int, Step] = {}
        for t in _tensors(obj):
            ptr, n = _span(t)
            for a in self.allocs:
                va = a.region.va
                if not (va <= ptr < va + a.region.size):
                    continue
                lst, los = self._by_alloc[id(a)], self._lo[id(a)]
                j = max(0, bisect.bisect_right(los, ptr - va) - 1)
                while j < len(lst) and lst[j].lo < ptr - va + max(n, 1):
                    need[lst[j].index] = lst[j]
                    j += 1
        out = [need[i] for i in sorted(need)]
        if self._workers == 1 and out:  # one copy queue: the last step covers the others
            out = out[-1:]
        if not isinstance(obj, list):  # modules, tensors and the hooks' tuples live through the wake
            self._cache[key] = out
        return out

    def ready(self, obj) -> None:
        """Make the caller's later work wait until the tensors of ``obj`` (a module, a tensor or a
        list of tensors) are back: on accelerators the current stream waits for the device event
        of the last step holding them (the host thread does not block on the copy); on the host
        this blocks until those bytes are read back and verified.  Raises the wake's error if
        a step they need failed."""
        drv = self._driver
        for step in self._needed(obj):
            step.queued.wait()
            if step.error is not None:
                raise self._wrap(step.error)
            drv.fence_wait(step.fence)

    def _wrap(self, e: BaseException) -> BaseException:
        if isinstance(e, BackupError):
            return e
        return BackupError(f"the progressive wake of tag(s) {', '.join(map(repr, self.tags))} failed: "
                           f"{type(e).__name__}: {e}. Call wait() to settle the tags.", cause=e)

    def install_hooks(self, model) -> list:
        """A forward pre-hook on every module of ``model`` that holds tensors itself, calling
        :meth:`ready` for those tensors.  Returns the hook handles (``h.remove()``)."""
        return install_ready_hooks(self._owner, model)

    def wait_queued(self, timeout: Optional[float] = None) -> bool:
        """Block until every step is mapped and its restore queued (on the host: complete);
        False when ``timeout`` seconds passed first."""
        return self._finished.wait(timeout)

    @property
    def done(self) -> bool:
        """Every copy has completed (never blocks)."""
        if not self._finished.is_set():
            return False
        drv = self._driver
        return self.error is not None or all(drv.fence_done(s.fence) for s in self.steps)

    def wait_copies(self) -> None:
        """Block until the worker is finished and every copy has completed (not under the lock)."""
        self._finished.wait()
        drv = self._driver
        if self.error is None and self.steps:
            for st in self.steps if self._workers > 1 else self.steps[-1:]:  # one queue: the last covers all
                drv.fence_sync(st.fence)
        elif self.error is not None:  # copies queued before the failure finish before anything is unmapped
            for st in self.steps:
                if st.fence is not None:
                    drv.fence_sync(st.fence)

    def wait(self):
        """Wait for every copy, then settle the tags (awake, or as after a failed wake)."""
        return self._owner.wait()


def install_ready_hooks(lc, model) -> list:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"install_ready_hooks() takes an nn.Module, got {type(model).__name__}")
    handles = []
    for mod in model.modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if not own:
            continue

        def pre(module, args, own=tuple(own)):
            lc.ready(own)

        handles.append(mod.register_forward_pre_hook(pre))
    return handles
