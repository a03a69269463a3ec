"""``pool(tag)`` on Ascend: torch_npu's pluggable allocator and ``MemPool`` route the
framework's own ``torch.empty(..., device="npu")`` calls into lifecycle regions.

The calls used, read in torch_npu's source (Ascend/pytorch, the 2.10 releases vllm-ascend pins):
``torch_npu._C._npu_customAllocator(alloc_fn_ptr, free_fn_ptr)`` (what ``NPUPluggableAllocator``
does after loading a .so; the callbacks are ``void* alloc(size_t, int device, aclrtStream)`` and
``void free(void*, size_t, int device, aclrtStream)``, ``NPUPluggableAllocator.h``),
``torch_npu.npu.memory.MemPool(allocator)``, ``torch_npu.npu.memory.use_mem_pool(pool)`` and
``torch_npu.npu.memory._set_allocator_settings`` ("Only support expandable_segments:True or False").

The callbacks are the shared :class:`~unisleep.backends._pool.TagAllocator`: they bind their
thread to the device with ``aclrtSetDevice`` and refuse a segment for another device than the
driver's.  **Expandable segments** — vllm-ascend turns ``expandable_segments:True`` on in
``PYTORCH_NPU_ALLOC_CONF`` unless vLLM runs with sleep mode, and its FAQ recommends it against
OOM — do not work in a pluggable pool: inside ``pool(tag)`` they are switched off through
torch_npu's allocator settings and the user's setting is restored afterwards, as vLLM does on
CUDA.  A torch_npu without ``_set_allocator_settings`` is refused with the fix.

NOT RUN ON AN NPU: the route is tested against a SIMULATED torch_npu module (tests/
test_ascend_sim.py) that hands the callbacks' addresses back so the test can call them as
torch_npu's caching allocator would; torch_npu's side has never run here.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator

from unisleep.backends._pool import FREE, MALLOC, TagAllocator, alloc_conf, expandable_on, no_expandable_segments
from unisleep.errors import UnsupportedError

from .descriptor import BACKEND

#: where torch_npu reads its allocator settings, first match wins
CONF_VARS = BACKEND.alloc_conf_vars

_KEEP: list = []  # callbacks and pools live as long as the process: torch_npu may free late
_LOCK = threading.Lock()


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the npu device)

        return torch_npu
    except ImportError as e:
        raise UnsupportedError(
            f"pool() on Ascend needs torch_npu ({e}); allocate with MemoryLifecycle.empty(..., tag=...) instead"
        ) from e


@contextlib.contextmanager
def npu_mem_pool(driver, lifecycle, tag: str, npu=None) -> Iterator[None]:
    """Route torch_npu's allocations made inside the block into ``tag`` (``npu``: the torch_npu
    module; tests pass a simulated one)."""
    npu = _torch_npu() if npu is None else npu
    memory = npu.npu.memory
    set_settings = getattr(memory, "_set_allocator_settings", None)
    conf = alloc_conf(CONF_VARS)
    if expandable_on(conf) and set_settings is None:
        raise UnsupportedError(
            f"{next(v for v in CONF_VARS if alloc_conf([v]))}={conf}: expandable segments do not work in a pluggable "
            f"pool, and this torch_npu ({getattr(npu, '__version__', '?')}) cannot switch them off at run time; "
            "remove expandable_segments:True from PYTORCH_NPU_ALLOC_CONF, or use torch_npu 2.10 or later")
    with _LOCK:
        hooks = TagAllocator(driver, lifecycle, tag, driver._set_device)
        alloc = MALLOC(lambda size, device, stream: hooks.malloc(size, device))
        free = FREE(lambda ptr, size, device, stream: hooks.free(ptr))
        allocator = npu._C._npu_customAllocator(ctypes.cast(alloc, ctypes.c_void_p).value,
                                                ctypes.cast(free, ctypes.c_void_p).value)
        pool = memory.MemPool(allocator)
        _KEEP.append((hooks, alloc, free, allocator, pool))
    with no_expandable_segments(CONF_VARS, set_settings), memory.use_mem_pool(pool):
        yield
