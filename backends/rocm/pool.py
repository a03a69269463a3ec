"""``pool(tag)`` on ROCm: a ROCm build of torch has the same pluggable allocator and
``torch.cuda.MemPool`` as a CUDA build (``torch.cuda`` is HIP there), so the shared router
(``unisleep.backends._pool``) routes ``torch.empty(..., device="cuda")`` inside a region into
lifecycle regions of this driver; the callbacks bind their thread with ``hipSetDevice``.

NOT RUN ON ROCm HARDWARE: no AMD GPU was available.  The callbacks' logic (``TagAllocator``) runs
in the tests against the simulated HIP library; torch's side of the routing is the code path the
CUDA backend runs on an H200.
"""

from __future__ import annotations

from typing import Optional

from unisleep.backends._pool import PoolRouter as _Router

from .descriptor import BACKEND

#: where a ROCm build of torch reads its allocator settings, first match wins
CONF_VARS = BACKEND.alloc_conf_vars


def pool_problem(driver) -> Optional[str]:
    """Why torch's allocations cannot be routed on this driver, or None when they can."""
    if driver.simulated:
        return ("the simulated HIP library backs host memory, which torch's device allocator never hands out; "
                "allocate with MemoryLifecycle.empty(..., tag=...) or .adopt(...)")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not installed"
    if not getattr(torch.version, "hip", None):
        return (f"this torch ({torch.__version__}) is not a ROCm build, so its allocations cannot be routed into HIP "
                "memory; install torch for ROCm, or allocate with MemoryLifecycle.empty(..., tag=...)")
    if not hasattr(torch._C, "_cuda_customAllocator") or not hasattr(torch.cuda, "MemPool"):
        return (f"this torch ({torch.__version__}) has no pluggable allocator / MemPool; use torch 2.6 or later, or "
                "allocate with MemoryLifecycle.empty(..., tag=...)")
    return None


class PoolRouter(_Router):
    def __init__(self, driver):
        from ..cuda.pool import custom_allocator  # the same torch API on a ROCm build

        super().__init__(driver, driver._set_device, CONF_VARS, BACKEND.device_module(), custom_allocator)
