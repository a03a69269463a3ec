"""Restores read by the SMs: a copy kernel that reads page-locked host memory through its device
mapping, for the wakes the copy engine would run slowly.

Contract: :func:`copy` queues ``dst.copy_(src)`` on the current stream, ``src`` being registered
host memory seen through its device mapping (:func:`device_view`); the bytes are exactly
those of ``src`` once the stream reaches that point.  With a :class:`ZeroFeed` the same programs
also zero other device memory while their loads are in flight; what they did not zero is
handed back (:meth:`ZeroFeed.rest`) for the caller to zero.  Without Triton, :func:`available`
is False and every restore stays on the copy engine.

Why: after ``cuMemRelease`` the driver has work left to do, and that work only progresses while
no host-to-device traffic runs, so a copy-engine restore started before it is done is slowed;
reads by the SMs are not.  :meth:`CudaDriver.restore_regions <.driver.CudaDriver.restore_regions>`
decides per wake.  docs/cuda.md ("Why a wake right after an unchanged sleep was slower", and
"the KV cache zeroed by the reads") holds the H200 measurements behind every choice below.

The kernel copies one 16 KiB block of int64 words per program; ranges that are not 16-byte
aligned, and a tail shorter than a block, go to ``copy_``.
"""

from __future__ import annotations

from collections import deque

from .lazy_kernel import LazyKernel
from .views import DeviceBuffer

#: int64 words per block (16 KiB) and warps per program (the H200 sweep in docs/cuda.md found
#: no setting faster)
WORDS = 2048
NUM_WARPS = 8
BLOCK_BYTES = WORDS * 8
#: at most this many blocks zeroed per block read (more slows the reads, docs/cuda.md);
#: zeroing left over goes to the caller's memset after the reads
MAX_ZERO_PER_BLOCK = 4
#: ranges to zero smaller than this are left to the caller's memset: carrying one takes a
#: launch of its own, too few programs to keep the bus busy
MIN_ZERO_BYTES = 4 << 20


def _build():
    import triton
    import triton.language as tl

    # the counts vary per launch: no specialisation on their values, so one build serves all
    @triton.jit(do_not_specialize=["zblocks", "zper"])
    def _copy_blocks(src, dst, z, zblocks, zper, BLOCK: tl.constexpr, ZMAX: tl.constexpr):
        # one whole block per program: no mask, so the loads stay 16 bytes wide (a masked tail
        # made them 8, and the reads took twice as long on an H200)
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        # .cg: the bytes go to their destination once; nothing is gained by keeping them in L1
        x = tl.load(src + offs, cache_modifier=".cg")
        # while the loads are in flight: this program's share of the blocks to zero (rows of
        # whole blocks, each row stored or not: the stores stay 16 bytes wide)
        rows = tl.arange(0, ZMAX)
        zb = pid * zper + rows
        keep = (rows < zper) & (zb < zblocks)
        tl.store(z + zb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], tl.zeros([ZMAX, BLOCK], tl.int64),
                 mask=keep[:, None])
        tl.store(dst + offs, x)

    return _copy_blocks


_copy = LazyKernel(_build, "SM copy kernel (restores stay on the copy engine)")


def available() -> bool:
    return _copy.get() is not None


def disable(error: BaseException) -> None:
    """Keep restores on the copy engine from now on (the kernel failed its warm-up)."""
    _copy.disable(error)


class ZeroFeed:
    """Device memory to zero, handed to the copy kernel a few blocks per block it reads.

    ``ranges``: uint8 device tensors to zero; ``read_bytes``: what the reads that will carry
    them copy in all (it sets how many blocks each read block zeroes, at most
    :data:`MAX_ZERO_PER_BLOCK`).  A launch zeroes part of one range; :func:`copy` splits its
    reads where a range ends.  After the reads, :meth:`rest` is what they did not zero (more
    than they could carry, a range under ``min_bytes`` or not 16-byte aligned, a tail under a
    block): the caller zeroes it."""

    def __init__(self, ranges, read_bytes: int, min_bytes: int = MIN_ZERO_BYTES):
        self._todo: deque = deque()
        self._left: list = []
        for t in ranges:
            whole = t.numel() // BLOCK_BYTES * BLOCK_BYTES if t.data_ptr() % 16 == 0 else 0
            if whole and whole >= min_bytes:
                self._todo.append(t[:whole])
            else:
                whole = 0
            if whole < t.numel():
                self._left.append(t[whole:])
        blocks = sum(t.numel() for t in self._todo) // BLOCK_BYTES
        self.per_block = min(MAX_ZERO_PER_BLOCK, -(-blocks // max(1, read_bytes // BLOCK_BYTES)))
        self.zeroed = 0  # bytes handed to the kernel

    def take(self, blocks: int):
        """(int64 tensor, its blocks): what ``blocks`` blocks of reads zero, the next blocks of
        one range (fewer where it ends); (None, 0) when nothing is left."""
        import torch

        if not self._todo or not self.per_block:
            return None, 0
        t = self._todo[0]
        n = min(t.numel(), blocks * self.per_block * BLOCK_BYTES)
        if n < t.numel():
            self._todo[0] = t[n:]
        else:
            self._todo.popleft()
        self.zeroed += n
        return t[:n].view(torch.int64), n // BLOCK_BYTES

    def rest(self) -> list:
        """What is left to zero (uint8 tensors); the feed is empty afterwards."""
        out = self._left + list(self._todo)
        self._left, self._todo = [], deque()
        return out


def copy(dst, src, zero: "ZeroFeed | None" = None) -> None:
    """Queue ``dst.copy_(src)`` (two uint8 tensors of one length) on the current stream, read
    by the SMs: ``src`` is page-locked host memory seen through its device mapping (a tensor on
    the device, as :func:`device_view` makes).  Whole 16 KiB blocks go to the kernel, one per
    program; a misaligned range and the tail under a block go to ``copy_``.  With ``zero``,
    the programs also zero their share of its ranges (:class:`ZeroFeed`)."""
    import torch

    n = dst.numel()
    if n != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {n}")
    k = _copy.get()
    if k is None:
        raise RuntimeError(f"the SM copy kernel is unavailable: {_copy.error}")
    done = 0
    if dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0:
        done = n // BLOCK_BYTES * BLOCK_BYTES
        if done:
            d64, s64 = dst[:done].view(torch.int64), src[:done].view(torch.int64)
            pos, blocks = 0, done // BLOCK_BYTES
            while pos < blocks:  # one launch per range to zero it carries, then the rest
                z, zblocks = zero.take(blocks - pos) if zero is not None else (None, 0)
                zper = zero.per_block if zblocks else 0
                m = -(-zblocks // zper) if zblocks else blocks - pos  # read blocks of this launch
                a, b = pos * WORDS, (pos + m) * WORDS
                if z is None:  # nothing to zero: ``z`` is never written; the source stands in, never the destination
                    z = s64[a: a + WORDS]
                k[(m,)](s64[a:b], d64[a:b], z, zblocks, zper, BLOCK=WORDS, ZMAX=MAX_ZERO_PER_BLOCK, num_warps=NUM_WARPS)
                pos += m
    if done < n:
        dst[done:].copy_(src[done:], non_blocking=True)


def device_view(device_ptr: int, n: int, device: int):
    """The ``n`` bytes of registered host memory at ``device_ptr`` (from
    ``cuMemHostGetDevicePointer``) as a uint8 tensor on GPU ``device``."""
    import torch

    return torch.as_tensor(DeviceBuffer(device_ptr, n), device=f"cuda:{device}")


def warm_up(device) -> bool:
    """Compile the kernel now (driver start), not inside the first wake that needs it; True
    when it built, copied a small odd-sized range exactly and zeroed what it was given."""
    import torch

    if not available():
        return False
    src = torch.arange(3 * BLOCK_BYTES + 13, dtype=torch.int64, device=device).to(torch.uint8)
    dst = torch.zeros_like(src)
    z = torch.full((2 * BLOCK_BYTES + 5,), 7, dtype=torch.uint8, device=device)
    feed = ZeroFeed([z], src.numel(), min_bytes=0)
    copy(dst, src, feed)
    ok = torch.equal(dst, src) and feed.zeroed == 2 * BLOCK_BYTES and not bool(z[: feed.zeroed].any())
    ok = ok and [t.numel() for t in feed.rest()] == [5] and bool((z[feed.zeroed:] == 7).all())
    if not ok:
        disable(RuntimeError("the SM copy kernel copied or zeroed its warm-up ranges wrongly"))
    return ok
