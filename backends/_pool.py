"""Route PyTorch's own allocations into tagged lifecycle memory, for every driver whose torch
device module has the pluggable allocator and memory pools (``MemPool``, ``use_mem_pool``): the
backend passes its torch device module (its descriptor's, e.g. ``torch.cuda`` on CUDA and on
ROCm, whose torch build exposes the same API over HIP) and the function that makes a pluggable
allocator from two callback addresses.

Each segment torch asks for inside ``route(lifecycle, tag)`` becomes a
:class:`~unisleep.region.Region` of the driver, registered with the lifecycle under the tag, so it
sleeps and wakes with everything else of that tag.  :class:`TagAllocator` holds the two
callbacks' logic and needs no torch (the simulated HIP tests drive it directly); the router wraps
it in torch's allocator and pool.

Rules learnt from vLLM and torch_memory_saver: the callbacks first bind the calling thread to
the device (``bind``: the primary context on CUDA, ``hipSetDevice`` on ROCm — they run on
arbitrary threads) and refuse a segment for another device than the driver's; the free callback synchronises before unmapping (in-flight kernels); a
region that is asleep is only un-reserved (no double release); pools are released before their
allocators at exit; ``expandable_segments`` is switched off while a pool is active (torch refuses
it in a pluggable pool) by rewriting the whole allocator config string, and the user's setting is
restored afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import sys
import threading
import weakref
from typing import Callable, Optional, Sequence

from unisleep.region import Region

log = logging.getLogger("unisleep.pool")

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


def alloc_conf(conf_vars: Sequence[str]) -> str:
    """The allocator settings torch read: the first of ``conf_vars`` that is set."""
    for v in conf_vars:
        if os.environ.get(v):
            return os.environ[v]
    return ""


def without_expandable(conf: str) -> str:
    """``conf`` with expandable segments switched off (the other settings kept)."""
    parts = [p for p in conf.split(",") if p.strip() and not p.strip().startswith("expandable_segments")]
    return ",".join(parts + ["expandable_segments:False"])


def expandable_on(conf: str) -> bool:
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@contextlib.contextmanager
def no_expandable_segments(conf_vars: Sequence[str], set_settings: Callable[[str], None]):
    """Expandable segments off while the block runs, when the allocator settings (the first of
    ``conf_vars`` set) turn them on: torch refuses them in a pluggable pool.  ``set_settings``
    applies a settings string to the running allocator (the device module's
    ``memory._set_allocator_settings``); the user's whole string is applied again afterwards."""
    conf = alloc_conf(conf_vars)
    if not expandable_on(conf):
        yield
        return
    set_settings(without_expandable(conf))
    try:
        yield
    finally:
        set_settings(conf)


class TagAllocator:
    """What torch's allocator callbacks do for one (lifecycle, tag): ``malloc`` makes a region
    of the driver and registers it under the tag; ``free`` forgets and frees it.  Neither raises
    (they run under C): a failure is logged and ``malloc`` returns 0, which torch reports as out
    of memory."""

    def __init__(self, driver, lifecycle, tag: str, bind: Callable[[], None]):
        self.driver, self.tag, self.bind = driver, tag, bind
        self.lifecycle = weakref.ref(lifecycle)
        self.live: dict[int, Region] = {}  # segments handed to torch and not freed yet, by address

    def malloc(self, size: int, device: Optional[int] = None) -> int:
        """A region of ``size`` bytes in the tag; ``device`` (the callback's argument) must be
        the driver's device: a segment asked for another device is refused (NULL), never
        placed on the wrong one."""
        if sys.is_finalizing():
            return 0
        lc = self.lifecycle()
        try:
            if device is not None and int(device) != self.driver.device:
                raise RuntimeError(f"the allocator asked for memory on device {device}, but this pool belongs to "
                                   f"the lifecycle of device {self.driver.device}; use one lifecycle per device and "
                                   "enter its pool with that device current")
            self.bind()
            if lc is None:
                raise RuntimeError("the lifecycle owning this pool is gone")
            region = Region.allocate(self.driver, int(size), lc.chunk_bytes)
            try:
                lc.register_region(self.tag, region, int(size))
            except BaseException:
                region.free(self.driver)
                raise
            self.live[region.va] = region
            return region.va
        except BaseException as e:  # never raise through C
            log.error("unisleep pool %r could not allocate %d bytes: %s", self.tag, size, e)
            return 0

    def free(self, ptr) -> None:
        if sys.is_finalizing() or not ptr:
            return
        mine = self.live.pop(int(ptr), None)
        try:
            self.bind()
            lc = self.lifecycle()
            region = lc.forget_region(int(ptr)) if lc is not None else None
            if region is None:  # the lifecycle is closed or gone: it released the memory and left the address
                if mine is not None:
                    mine.free(self.driver)
                return
            if region.mapped:
                self.driver.synchronize()  # in-flight kernels may still use it
            region.free(self.driver)  # an asleep region holds no handle: only its address is freed
        except BaseException as e:  # inside torch's free callback, which cannot raise: logged
            log.error("unisleep pool %r could not free %#x: %s", self.tag, int(ptr or 0), e)


class _TorchPool:
    """A :class:`TagAllocator` as torch's pluggable allocator, and the ``MemPool`` over it."""

    def __init__(self, hooks: TagAllocator, devmod, custom_allocator: Callable[[int, int], object]):
        self.hooks = hooks
        self._malloc = MALLOC(lambda size, device, stream: hooks.malloc(size, device))
        self._free = FREE(lambda ptr, size, device, stream: hooks.free(ptr))
        mptr = ctypes.cast(self._malloc, ctypes.c_void_p).value
        fptr = ctypes.cast(self._free, ctypes.c_void_p).value
        self.allocator = custom_allocator(mptr, fptr)
        self.pool = devmod.MemPool(self.allocator)

    @property
    def id(self):
        return self.pool.id


class PoolRouter:
    """One torch pool per (lifecycle, tag) of a driver: ``bind`` binds a callback's thread to the
    device, ``conf_vars`` are where torch reads its allocator settings, ``devmod`` is the torch
    device module and ``custom_allocator(malloc_ptr, free_ptr)`` makes its pluggable allocator."""

    def __init__(self, driver, bind: Callable[[], None], conf_vars: Sequence[str], devmod,
                 custom_allocator: Callable[[int, int], object]):
        self.driver, self.bind, self.conf_vars = driver, bind, tuple(conf_vars)
        self.devmod, self.custom_allocator = devmod, custom_allocator
        self._pools: dict[tuple[int, str], _TorchPool] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def mempool(self, lifecycle, tag: str) -> _TorchPool:
        key = (id(lifecycle), tag)
        with self._lock:
            p = self._pools.get(key)
            if p is None or p.hooks.lifecycle() is not lifecycle:
                if p is not None:  # a new lifecycle at a dead one's id: the old pool's tensors may live on
                    _keep_callbacks(p)
                p = self._pools[key] = _TorchPool(TagAllocator(self.driver, lifecycle, tag, self.bind), self.devmod,
                                                  self.custom_allocator)
            return p

    def detach(self, lifecycle, tag: str):
        """Hand the torch ``MemPool`` of (lifecycle, tag) to the caller and forget it (None if
        there is none): once the caller drops it and nothing allocated in it is alive, torch
        gives its segments back through the free callback (at the latest at ``empty_cache()``),
        and the tag's regions go with them.  The next :meth:`route` into the tag makes a new
        pool."""
        with self._lock:
            p = self._pools.pop((id(lifecycle), tag), None)
            if p is None:
                return None
        _keep_callbacks(p)  # the caller's MemPool may free through them for as long as it lives
        pool, p.pool = p.pool, None
        return pool

    @contextlib.contextmanager
    def route(self, lifecycle, tag: str):
        p = self.mempool(lifecycle, tag)
        dm = self.devmod
        with no_expandable_segments(self.conf_vars, dm.memory._set_allocator_settings), dm.device(self.driver.device), \
                dm.use_mem_pool(p.pool):
            _ROUTING.depth = getattr(_ROUTING, "depth", 0) + 1
            try:
                yield
            finally:
                _ROUTING.depth -= 1

    def close(self) -> None:
        # pools first, then allocators (pytorch#145168: "pure virtual method called" otherwise);
        # a tensor of a pool may outlive this (a lifecycle closed while the framework still holds
        # one): torch frees it later through the pool's callbacks, which must still exist then
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            if p.hooks.live:
                _keep_callbacks(p)
            p.pool = None
        for p in pools:
            if not p.hooks.live:
                p.allocator = None


#: the allocators and callbacks of pools closed or replaced while torch still held segments of
#: them, and of pools handed out: torch frees each such segment through them whenever it dies
#: (torch keeps only a plain pointer to the allocator once its pool is gone: a destroyed one
#: ends the process with "pure virtual method called"), so they are never collected
_KEPT_CALLBACKS: list = []


def _keep_callbacks(p: _TorchPool) -> None:
    _KEPT_CALLBACKS.append((p.allocator, p._malloc, p._free))


_ROUTING = threading.local()


def routing_active() -> bool:
    """Whether this thread's torch allocations are routed into a tag's pool right now."""
    return getattr(_ROUTING, "depth", 0) > 0


class DigestScratch:
    """The device temporaries of a sleep's digests in a private torch ``MemPool``, given back
    to the device by :meth:`close` (torch frees a pool's cached segments when the pool goes):
    without it the caching allocator keeps them (~1/64 of the bytes hashed: 128 MiB for 8 GiB)
    and a sleep frees that much less than it put to sleep.  Routes only the calling thread;
    ``devmod`` is the torch device module."""

    def __init__(self, device: int, devmod):
        self.device, self.devmod = device, devmod
        self._pool = devmod.MemPool()
        self._ctx = None

    @classmethod
    def for_device(cls, device: int, devmod) -> Optional["DigestScratch"]:
        """None where a private pool cannot be used: this thread already routes into a tag
        (pools are never nested), a graph is being captured, or this torch has no private
        pools (the caching allocator then keeps the temporaries)."""
        if routing_active() or not hasattr(devmod, "use_mem_pool"):
            return None
        try:
            if devmod.is_current_stream_capturing():
                return None
            return cls(device, devmod)
        except Exception as e:  # the digests then use the framework's allocator: same digest
            log.debug("no private pool for the digests' temporaries: %s", e)
            return None

    def __enter__(self):
        self._ctx = self.devmod.use_mem_pool(self._pool, device=self.device)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        ctx, self._ctx = self._ctx, None
        return ctx.__exit__(*exc) if ctx is not None else False

    def close(self) -> None:
        """Give the pool's segments back (once nothing allocated in it is alive)."""
        if self._pool is not None:
            self._pool = None  # ~MemPool: releasePool + emptyCache of this pool only
