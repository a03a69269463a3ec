"""Page-locked host buffers of their own on CUDA (``Driver.host_buffer``): ``cuMemHostAlloc``
memory under a host tensor, freed with ``cuMemFreeHost`` when the last tensor over it is gone.

Why not ``torch.empty(..., pin_memory=True)``: torch's host caching allocator keeps a freed
block pinned for reuse, so the host memory of a buffer the caller dropped would stay locked
(and the runtime would still report it as its own) for the life of the process.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import weakref

from . import cu

log = logging.getLogger("unisleep.cuda")


def _free(ptr: int) -> None:
    if sys.is_finalizing():
        return  # the driver tears the context down with the process
    try:
        cu.call("cuMemFreeHost", ptr)
    except Exception as e:  # a finalizer never raises
        log.error("could not free the page-locked host buffer at %#x: %s", ptr, e)


def pinned_host_tensor(device: int, nbytes: int):
    """A host uint8 tensor of ``nbytes`` in page-locked memory of its own (portable: every
    context may copy from it), given back to the system when the last tensor over it dies."""
    import torch

    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    cu.ensure_context(device)
    flags = int(getattr(cu.driver(), "CU_MEMHOSTALLOC_PORTABLE", 1))  # 1 in cuda.h
    ptr = int(cu.call("cuMemHostAlloc", nbytes, flags))
    try:
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        weakref.finalize(buf, _free, ptr)  # torch.frombuffer keeps ``buf`` alive with the storage
    except BaseException:
        _free(ptr)
        raise
    return torch.frombuffer(buf, dtype=torch.uint8)
