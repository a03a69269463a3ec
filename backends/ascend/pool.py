"""``pool(tag)`` on Ascend: torch_npu's pluggable allocator and ``MemPool`` route the
framework's own ``torch.empty(..., device="npu")`` calls into lifecycle regions.

WRITTEN AGAINST torch_npu's API BUT NOT RUN: there is no Ascend NPU (and no torch_npu) on the
machines this was developed on, and the simulated ACL library cannot host torch_npu's caching
allocator.  The calls used are ``torch_npu._C._npu_customAllocator(alloc_fn_ptr, free_fn_ptr)``
(what ``NPUPluggableAllocator`` does after loading a .so), ``torch.npu.memory.MemPool(allocator)``
and ``torch.npu.memory.use_mem_pool(pool)``.  Callback types follow
``torch_npu/csrc/npu/NPUPluggableAllocator.h``: ``void* alloc(size_t, int device, aclrtStream)``
and ``void free(void*, size_t, int device, aclrtStream)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Iterator

from unisleep.errors import UnsupportedError
from unisleep.region import Region

log = logging.getLogger("unisleep.ascend")

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

_KEEP: list = []  # callbacks and pools live as long as the process: torch may free late
_LOCK = threading.Lock()


class _Hooks:
    def __init__(self, driver, lifecycle, tag):
        self.driver, self.lifecycle, self.tag = driver, lifecycle, tag
        self.alloc = ALLOC_FN(self._alloc)
        self.free = FREE_FN(self._free)

    def _alloc(self, size, device, stream):
        try:
            region = Region.allocate(self.driver, int(size), self.driver.config.chunk_bytes)
            self.lifecycle.register_region(self.tag, region, int(size))
            return region.va
        except BaseException:  # an exception must not cross the C ABI: report OOM (NULL)
            log.exception("unisleep NPU pool allocation of %d bytes failed", size)
            return None

    def _free(self, ptr, size, device, stream):
        try:
            region = self.lifecycle.forget_region(int(ptr or 0))
            if region is not None:
                self.driver.synchronize()
                region.free(self.driver)
        except BaseException:
            log.exception("unisleep NPU pool free of %#x failed", ptr or 0)


@contextlib.contextmanager
def npu_mem_pool(driver, lifecycle, tag: str) -> Iterator[None]:
    from .driver import expandable_segments_problem

    problem = expandable_segments_problem()
    if problem:
        raise UnsupportedError(problem)
    try:
        import torch
        import torch_npu  # noqa: F401
        from torch_npu import _C as npu_C
    except ImportError as e:  # pragma: no cover - needs torch_npu
        raise UnsupportedError(
            f"pool() on Ascend needs torch_npu ({e}); allocate with MemoryLifecycle.empty(..., tag=...) instead"
        ) from e
    with _LOCK:  # pragma: no cover - needs torch_npu
        hooks = _Hooks(driver, lifecycle, tag)
        alloc_ptr = ctypes.cast(hooks.alloc, ctypes.c_void_p).value
        free_ptr = ctypes.cast(hooks.free, ctypes.c_void_p).value
        allocator = npu_C._npu_customAllocator(alloc_ptr, free_ptr)
        pool = torch.npu.memory.MemPool(allocator)
        _KEEP.append((hooks, allocator, pool))
    with torch.npu.memory.use_mem_pool(pool):  # pragma: no cover - needs torch_npu
        yield
