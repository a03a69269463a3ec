"""The verbs that put memory under a :class:`~unisleep.lifecycle.memory.MemoryLifecycle`:
:meth:`~LifecycleAllocation.empty` (a new tensor), :meth:`~LifecycleAllocation.adopt` (existing
tensors moved in place), :meth:`~LifecycleAllocation.pool` (the framework's own allocations
routed into a tag) and the two calls a driver's pool makes — a base class of the lifecycle
(the lock, the sleep/wake verbs and the set-up stay in :mod:`.memory`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..errors import InvalidArgumentError, UnisleepError
from . import adoption
from .state import Keeper, check_tag_name


class LifecycleAllocation:
    """Allocation into a :class:`~unisleep.lifecycle.memory.MemoryLifecycle` (see the module)."""

    # ------------------------------------------------------------------ allocation
    def empty(self, shape, dtype=None, *, tag: str):
        """A new tensor of ``shape``/``dtype`` in lifecycle memory under ``tag`` (contents zero)."""
        shape, dtype, nbytes = adoption.shape_bytes(shape, dtype)
        with self._lock:
            self._settle()  # a progressive wake / background sleep that has ended
            self._check_can_allocate(tag)
            self._state.check_room(nbytes, tag)
            alloc = self._state.new(tag, nbytes)
            keeper = Keeper.of(alloc, self)
            t = self._driver.view(alloc.region.va, max(nbytes, 1), owner=keeper)[:nbytes]
            return keeper.attach(t.view(dtype).view(shape), self._driver)

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
        self._check_open()
        named = adoption.tensors_of(obj)
        with self._lock:
            self._settle()
            self._check_can_allocate(tag)
            packing = adoption.pack(named)
            self._state.check_room(packing.total, tag)
            new_tag = tag not in self._state.tags
            alloc = self._state.new(tag, packing.total)
            try:
                keeper = Keeper.of(alloc, self)
                base = self._driver.view(alloc.region.va, alloc.region.size, owner=keeper)
                adoption.move(packing, alloc, base, self._driver.torch_device,
                              lambda t: keeper.attach(t, self._driver))
                self._driver.synchronize()
            except BaseException as e:  # all or nothing: every tensor is back, the region is freed
                self._state.free(alloc, drop_tag=new_tag)
                if isinstance(e, UnisleepError) or not isinstance(e, Exception):
                    raise
                raise InvalidArgumentError(f"adopt() failed and was undone, nothing was moved: {e}") from e
            return obj

    @contextmanager
    def pool(self, tag: str) -> Iterator[None]:
        """Route the framework's own allocations (e.g. ``torch.empty`` on the device) into ``tag``."""
        check_tag_name(tag)
        with self._lock:
            self._check_can_allocate(tag)
        with self._driver.pool(self, tag):
            yield

    # the two calls a driver's pool makes for the framework's allocator ----------------------
    def register_region(self, tag: str, region, nbytes: int):
        """Record ``region`` (made by the driver for the framework's allocator inside
        :meth:`pool`) as an allocation of ``tag``; it then sleeps and wakes with the tag."""
        with self._lock:
            self._check_can_allocate(tag)
            return self._state.add(tag, region, nbytes, external=True)

    def forget_region(self, va: int):
        """The framework freed the region at ``va``: its records and backups are dropped and the
        region returned for the caller to free (None when unknown, or when the lifecycle is
        closed and freed it already)."""
        with self._lock:
            if self._shut.is_set():
                return None
            a = self._state.at(va)
            if a is None:
                return None
            self._state.forget(a)
            return a.region

    def on_free(self, fn) -> None:
        """Call ``fn(va, size)`` whenever an allocation's memory is given up — the framework
        freed a region of :meth:`pool` (e.g. torch emptied its cache), or :meth:`free`-like
        paths dropped it — after its records and backup are dropped.  ``fn`` runs under the
        lifecycle's lock, maybe on the allocator's thread: it must not call the lifecycle, and
        it must not raise (an error is logged)."""
        if not callable(fn):
            raise InvalidArgumentError(f"on_free() takes a function of (va, size), got {type(fn).__name__}")
        with self._lock:
            self._check_open()
            self._state.free_listeners.append(fn)

    def _check_can_allocate(self, tag: str) -> None:
        check_tag_name(tag)
        self._check_open()
        self._state.check_can_allocate(tag)
