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

The kernel is persistent (two programs per SM, each looping over 16 KiB blocks of int64 words),
so a zeroing queued on another stream (the KV cache's) runs beside it instead of after it.
Ranges that are not 8-byte aligned, and a tail shorter than a word, go to the copy engine.
Without Triton, :func:`available` is False and every restore stays on the copy engine.
"""

from __future__ import annotations

import logging

log = logging.getLogger("unisleep.cuda")

#: int64 words per block (16 KiB) and warps per program: every setting of the H200 sweep
#: (1024-8192 words, 2-16 warps, 132-528 programs) read 8 GiB in 167.3-168.6 ms
WORDS = 2048
NUM_WARPS = 8
PROGRAMS_PER_SM = 2

_kernel = None
_error: "BaseException | None" = None
_sms: dict = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def _copy_words(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for b in range(pid, tl.cdiv(n, BLOCK), step):
            offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            # .cg: the bytes go to their destination once; nothing is gained by keeping them in L1
            tl.store(dst + offs, tl.load(src + offs, mask=m, cache_modifier=".cg"), mask=m)

    return _copy_words


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


def _programs(device) -> int:
    import torch

    d = torch.device(device)
    if d.type == "cpu":  # the interpreter (tests)
        return 3
    idx = d.index if d.index is not None else torch.cuda.current_device()
    if idx not in _sms:
        _sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return PROGRAMS_PER_SM * _sms[idx]


def copy(dst, src) -> None:
    """Queue ``dst.copy_(src)`` (two uint8 tensors of one length) on the current stream, read
    by the SMs: ``src`` is page-locked host memory seen through its device mapping (a tensor on
    the device, as :func:`device_view` makes).  The aligned words go to the kernel; a misaligned
    range or a tail under 8 bytes to ``copy_``."""
    n = dst.numel()
    if n != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {n}")
    k = _copy_kernel()
    if k is None:
        raise RuntimeError(f"the SM copy kernel is unavailable: {_error}")
    if dst.data_ptr() % 8 or src.data_ptr() % 8:
        dst.copy_(src, non_blocking=True)
        return
    body = n // 8 * 8
    if body:
        import torch

        d64, s64 = dst[:body].view(torch.int64), src[:body].view(torch.int64)
        words = body // 8
        grid = (max(1, min(_programs(dst.device), -(-words // WORDS))),)
        k[grid](s64, d64, words, BLOCK=WORDS, num_warps=NUM_WARPS)
    if body < n:
        dst[body:].copy_(src[body:], non_blocking=True)


class _Mapped:
    """``[ptr, ptr+n)`` of page-locked host memory as a device tensor (its device address)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def device_view(device_ptr: int, n: int, device: int):
    """The ``n`` bytes of registered host memory at ``device_ptr`` (from
    ``cuMemHostGetDevicePointer``) as a uint8 tensor on GPU ``device``."""
    import torch

    return torch.as_tensor(_Mapped(device_ptr, n), device=f"cuda:{device}")


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
