"""Route PyTorch's own allocations into tagged lifecycle memory.

A pluggable allocator (two ctypes callbacks handed to ``torch._C._cuda_customAllocator``) backs
one ``torch.cuda.MemPool`` per (lifecycle, tag).  Each segment torch asks for becomes a
:class:`~unisleep.region.Region` registered with the lifecycle under the tag, so it sleeps and
wakes with everything else of that tag.

Rules learnt from vLLM and torch_memory_saver: the callbacks make the primary context current
(they run on arbitrary threads); the free callback synchronises before unmapping (in-flight
kernels); a region that is asleep is only un-reserved (no double release); pools are released
before their allocators at exit; ``expandable_segments`` is switched off while a pool is active
(it does not work with a pluggable pool) by rewriting the whole allocator config string, and the
user's setting is restored afterwards.
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

from unisleep.region import Region

from . import cu

log = logging.getLogger("unisleep.cuda")

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def _alloc_conf() -> str:
    for v in _CONF_VARS:
        if os.environ.get(v):
            return os.environ[v]
    return ""


@contextlib.contextmanager
def _no_expandable_segments():
    import torch

    conf = _alloc_conf()
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        yield
        return
    parts = [p for p in conf.split(",") if p.strip() and not p.strip().startswith("expandable_segments")]
    off = ",".join(parts + ["expandable_segments:False"])
    torch.cuda.memory._set_allocator_settings(off)
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings(conf)


class _Tagged:
    """One pluggable allocator + MemPool bound to a lifecycle and a tag."""

    def __init__(self, router: "PoolRouter", lifecycle, tag: str):
        import torch

        self.router, self.tag = router, tag
        self.lifecycle = weakref.ref(lifecycle)
        self._malloc = MALLOC(self._on_malloc)
        self._free = FREE(self._on_free)
        mptr = ctypes.cast(self._malloc, ctypes.c_void_p).value
        fptr = ctypes.cast(self._free, ctypes.c_void_p).value
        self.allocator = torch._C._cuda_customAllocator(mptr, fptr)
        self.pool = torch.cuda.MemPool(self.allocator)

    def _on_malloc(self, size, device, stream):
        if sys.is_finalizing():
            return 0
        drv = self.router.driver
        lc = self.lifecycle()
        try:
            cu.ensure_context(drv.device)
            if lc is None:
                raise RuntimeError("the lifecycle owning this pool is gone")
            region = Region.allocate(drv, int(size), lc.chunk_bytes)
            lc._register_region(self.tag, region, int(size))
            return region.va
        except BaseException as e:  # never raise through C; torch reports the NULL as OOM
            log.error("unisleep pool %r could not allocate %d bytes: %s", self.tag, size, e)
            return 0

    def _on_free(self, ptr, size, device, stream):
        if sys.is_finalizing() or ptr is None:
            return
        drv = self.router.driver
        try:
            cu.ensure_context(drv.device)
            lc = self.lifecycle()
            region = lc._forget_region(int(ptr)) if lc is not None else None
            if region is None:
                return
            if region.mapped:
                drv.synchronize()  # in-flight kernels may still use it
            region.free(drv)  # an asleep region holds no handle: only its address is freed
        except BaseException as e:
            log.error("unisleep pool %r could not free %#x: %s", self.tag, int(ptr or 0), e)

    @property
    def id(self):
        return self.pool.id


class PoolRouter:
    def __init__(self, driver):
        self.driver = driver
        self._pools: dict[tuple[int, str], _Tagged] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def mempool(self, lifecycle, tag: str) -> _Tagged:
        key = (id(lifecycle), tag)
        with self._lock:
            p = self._pools.get(key)
            if p is None or p.lifecycle() is not lifecycle:
                p = self._pools[key] = _Tagged(self, lifecycle, tag)
            return p

    @contextlib.contextmanager
    def route(self, lifecycle, tag: str):
        import torch

        p = self.mempool(lifecycle, tag)
        with _no_expandable_segments(), torch.cuda.device(self.driver.device), torch.cuda.use_mem_pool(p.pool):
            yield

    def close(self) -> None:
        # pools first, then allocators (pytorch#145168: "pure virtual method called" otherwise)
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            p.pool = None
        for p in pools:
            p.allocator = None
