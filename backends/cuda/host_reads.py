"""Restores read by the SMs: a copy kernel that reads page-locked host memory through its device
mapping, for the wakes the copy engine would run slowly.

Why: after ``cuMemRelease`` the driver has work left to do, about 2.1 ms per GiB released on an
H200 (24 GiB: ~50 ms), and that work only progresses while no host-to-device traffic runs.  A
copy-engine restore started before it is done takes that much longer (8 GiB: 208 ms right after
releasing 24 GiB, 188 ms 20 ms later, 155 ms from 50 ms on); reads by the SMs are not slowed
(167.5 ms for 8 GiB, settled or not), and compute kernels that follow are not slowed either: the
driver finishes its work under them.  A wake right after a sleep that copied nothing (unchanged
weights) is the case this is for; :meth:`CudaDriver.resume <.driver.CudaDriver.resume>` decides
per wake (docs/cuda.md, "Why a wake right after an unchanged sleep was slower").

The kernel copies one 16 KiB block of int64 words per program.
Ranges that are not 16-byte aligned, and a tail shorter than a block, go to ``copy_``.
Without Triton, :func:`available` is False and every restore stays on the copy engine.
"""

from __future__ import annotations

import logging

log = logging.getLogger("unisleep.cuda")

#: int64 words per block (16 KiB) and warps per program: every setting of the H200 sweep
#: (1024-8192 words, 2-16 warps, one block per program or 132-528 looping programs) read 8 GiB
#: in 167.3-168.6 ms
WORDS = 2048
NUM_WARPS = 8

_kernel = None
_error: "BaseException | None" = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_blocks(src, dst, BLOCK: tl.constexpr):
        # one whole block per program: no mask, so the loads stay 16 bytes wide (a masked tail
        # made them 8, and the reads took twice as long on an H200)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        # .cg: the bytes go to their destination once; nothing is gained by keeping them in L1
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg"))

    return _copy_blocks


def _copy_kernel():
    global _kernel, _error
    if _kernel is None and _error is None:
        try:
            _kernel = _build()
        except Exception as e:  # no triton, or it cannot build here: the copy engine it is
            _error = e
            log.debug("SM copy kernel unavailable: %s", e)
    return _kernel


def available() -> bool:
    return _copy_kernel() is not None


def disable(error: BaseException) -> None:
    """Keep restores on the copy engine from now on (the kernel failed its warm-up)."""
    global _kernel, _error
    _kernel, _error = None, error


def copy(dst, src) -> None:
    """Queue ``dst.copy_(src)`` (two uint8 tensors of one length) on the current stream, read
    by the SMs: ``src`` is page-locked host memory seen through its device mapping (a tensor on
    the device, as :func:`device_view` makes).  Whole 16 KiB blocks go to the kernel, one per
    program; a misaligned range and the tail under a block go to ``copy_``."""
    import torch

    n = dst.numel()
    if n != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {n}")
    k = _copy_kernel()
    if k is None:
        raise RuntimeError(f"the SM copy kernel is unavailable: {_error}")
    done = 0
    if dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0:
        done = n // (WORDS * 8) * (WORDS * 8)
        if done:
            d64, s64 = dst[:done].view(torch.int64), src[:done].view(torch.int64)
            k[(done // (WORDS * 8),)](s64, d64, BLOCK=WORDS, num_warps=NUM_WARPS)
    if done < n:
        dst[done:].copy_(src[done:], non_blocking=True)


def device_view(device_ptr: int, n: int, device: int):
    """The ``n`` bytes of registered host memory at ``device_ptr`` (from
    ``cuMemHostGetDevicePointer``) as a uint8 tensor on GPU ``device``."""
    import torch

    from .driver import _DeviceBuffer

    return torch.as_tensor(_DeviceBuffer(device_ptr, n), device=f"cuda:{device}")


def warm_up(device) -> bool:
    """Compile the kernel now (driver start), not inside the first wake that needs it; True
    when it built and copied a small odd-sized range exactly."""
    import torch

    if not available():
        return False
    src = torch.arange(3 * WORDS * 8 + 13, dtype=torch.int64, device=device).to(torch.uint8)
    dst = torch.zeros_like(src)
    copy(dst, src)
    ok = torch.equal(dst, src)
    if not ok:
        disable(RuntimeError("the SM copy kernel copied its warm-up range wrongly"))
    return ok
