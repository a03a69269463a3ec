"""Route PyTorch's own allocations into tagged lifecycle memory on CUDA: the shared router
(``unisleep.backends._pool``: a pluggable allocator + a ``MemPool`` of the descriptor's device
module per (lifecycle, tag), expandable segments switched off inside the pool and restored after) with CUDA's thread
binding — the allocator callbacks make the device's primary context current, since they run on
arbitrary threads.
"""

from __future__ import annotations

from unisleep.backends._pool import PoolRouter as _Router

from . import cu
from .descriptor import BACKEND

#: where torch reads its allocator settings on a CUDA build, first match wins
CONF_VARS = BACKEND.alloc_conf_vars


def release_library_caches() -> None:
    """torch's cuBLAS (and cuBLASLt) workspaces, kept per (handle, stream) until cleared — one
    per thread that ran a matmul, e.g. autograd's backward thread besides the caller's — back to
    the caching allocator; torch makes them again at the next matmul."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def custom_allocator(malloc_ptr: int, free_ptr: int):
    """torch's pluggable allocator over two C callbacks (the call ``CUDAPluggableAllocator``
    makes after loading a library)."""
    import torch

    return torch._C._cuda_customAllocator(malloc_ptr, free_ptr)


class PoolRouter(_Router):
    def __init__(self, driver):
        super().__init__(driver, lambda: cu.ensure_context(driver.device), CONF_VARS, BACKEND.device_module(),
                         custom_allocator)
