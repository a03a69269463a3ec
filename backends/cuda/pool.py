"""Route PyTorch's own allocations into tagged lifecycle memory on CUDA: the shared router
(``unisleep.backends._pool``: a pluggable allocator + ``torch.cuda.MemPool`` per (lifecycle,
tag), expandable segments switched off inside the pool and restored after) with CUDA's thread
binding — the allocator callbacks make the device's primary context current, since they run on
arbitrary threads.
"""

from __future__ import annotations

from unisleep.backends._pool import PoolRouter as _Router

from . import cu

#: where torch reads its allocator settings on a CUDA build, first match wins
CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


class PoolRouter(_Router):
    def __init__(self, driver):
        super().__init__(driver, lambda: cu.ensure_context(driver.device), CONF_VARS)
