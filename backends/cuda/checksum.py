"""The first level of the keyed NH hash (:mod:`unisleep.keyed_hash`) in one fused Triton pass
over device memory, at HBM speed: the proof that weights are unchanged since their host backup
(so a level-1 sleep can skip the copy), and that transferred bytes arrived intact.

:func:`nh_level1` returns exactly what :func:`unisleep.keyed_hash.nh_level` returns (the words
are int32, little-endian; blocks of ``BLOCK`` words; per block lane A uses ``key[0:BLOCK]``,
lane B ``key[SHIFT:SHIFT+BLOCK]``; pairs are (even word, odd word); sums wrap mod 2**64; the last
block is zero-padded) and is found by :func:`unisleep.keyed_hash.device_level1` by its name.
Without Triton (or off the GPU) it is ``nh_level`` itself: the same words, slower.

The kernel takes the block count and the length of the last block as runtime arguments (no
integer specialisation), so the one kernel compiled at driver start serves every size.
"""

from __future__ import annotations

import os
import weakref

from unisleep.keyed_hash import BLOCK, KEY_WORDS, SHIFT, nh_level

from .lazy_kernel import LazyKernel

#: blocks hashed by one program (G * 8 KiB read per program) and warps per program: the best of
#: the H200 sweep of ``tools/cuda_probes/digest_kernel.py`` (docs/benchmarks.md has the figures)
BLOCKS_PER_PROGRAM = 4
NUM_WARPS = 4
#: "pairs": the words read as int64 pairs (16-byte loads); "split": int32 words split in registers
KIND = "pairs"

_variants: dict = {}
_key32: dict = {}  # id(key tensor) -> (weakref to it, its version, int32 words)


def _build(kind: str = "pairs"):
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["nblocks", "last"])
    def _nh1_pairs(x_ptr, k_ptr, out_ptr, nblocks, last, G: tl.constexpr, PAIRS: tl.constexpr, SH: tl.constexpr):
        # x: the words as int64 pairs (even word low, odd word high: little-endian); k: the
        # level's key as int64 pairs of its 32-bit words; out: int64 [2 * nblocks]; ``last`` is
        # the number of pairs in the last block
        pid = tl.program_id(0)
        blk = pid.to(tl.int64) * G + tl.arange(0, G).to(tl.int64)  # [G] block numbers
        j = tl.arange(0, PAIRS)
        ka = tl.load(k_ptr + j)
        kb = tl.load(k_ptr + SH // 2 + j)
        ka0, ka1 = ka.to(tl.uint32), (ka >> 32).to(tl.uint32)
        kb0, kb1 = kb.to(tl.uint32), (kb >> 32).to(tl.uint32)
        n = (nblocks.to(tl.int64) - 1) * PAIRS + last  # pairs in all
        offs = blk[:, None] * PAIRS + j[None, :]  # [G, PAIRS]
        x = tl.load(x_ptr + offs, mask=offs < n, other=0)
        m0, m1 = x.to(tl.uint32), (x >> 32).to(tl.uint32)
        pa = (m0 + ka0[None, :]).to(tl.uint64) * (m1 + ka1[None, :]).to(tl.uint64)  # adds wrap mod 2**32
        pb = (m0 + kb0[None, :]).to(tl.uint64) * (m1 + kb1[None, :]).to(tl.uint64)  # products mod 2**64
        sa = tl.sum(pa, axis=1)
        sb = tl.sum(pb, axis=1)
        ok = blk < nblocks
        tl.store(out_ptr + 2 * blk, sa.to(tl.int64, bitcast=True), mask=ok)
        tl.store(out_ptr + 2 * blk + 1, sb.to(tl.int64, bitcast=True), mask=ok)

    @triton.jit(do_not_specialize=["nblocks", "last"])
    def _nh1_split(x_ptr, k_ptr, out_ptr, nblocks, last, G: tl.constexpr, PAIRS: tl.constexpr, SH: tl.constexpr):
        # the same words from an int32 view, pairs split in registers (``last``: words)
        pid = tl.program_id(0)
        blk = pid.to(tl.int64) * G + tl.arange(0, G).to(tl.int64)
        w = tl.arange(0, PAIRS)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [PAIRS, 2]
        ka = tl.load(k_ptr + w).to(tl.uint32, bitcast=True)
        kb = tl.load(k_ptr + SH + w).to(tl.uint32, bitcast=True)
        n = (nblocks.to(tl.int64) - 1) * (PAIRS * 2) + last
        offs = blk[:, None, None] * (PAIRS * 2) + w[None, :, :]  # [G, PAIRS, 2]
        m = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.uint32, bitcast=True)
        a0, a1 = tl.split(m + ka[None, :, :])
        b0, b1 = tl.split(m + kb[None, :, :])
        sa = tl.sum(a0.to(tl.uint64) * a1.to(tl.uint64), axis=1)
        sb = tl.sum(b0.to(tl.uint64) * b1.to(tl.uint64), axis=1)
        ok = blk < nblocks
        tl.store(out_ptr + 2 * blk, sa.to(tl.int64, bitcast=True), mask=ok)
        tl.store(out_ptr + 2 * blk + 1, sb.to(tl.int64, bitcast=True), mask=ok)

    return {"pairs": _nh1_pairs, "split": _nh1_split}[kind]


def _build_segments():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["nblocks", "base"])
    def _nh_seg(x_ptr, y_ptr, k_ptr, t_ptr, out_ptr, nblocks, base, G: tl.constexpr, PAIRS: tl.constexpr,
                SH: tl.constexpr, COPY: tl.constexpr):
        # keyed_hash.SegmentLevel: per block (row of the table) its first pair, its pair count,
        # the AND mask of its last pair and where its two lanes go in out; the pairs are x[first].
        # COPY (keyed_hash.SegmentCopyLevel): they are read from x[first - base] and written to
        # y[first] in the same pass that hashes them
        pid = tl.program_id(0)
        blk = pid.to(tl.int64) * G + tl.arange(0, G).to(tl.int64)
        ok = blk < nblocks
        first = tl.load(t_ptr + blk, mask=ok, other=0)
        count = tl.load(t_ptr + nblocks + blk, mask=ok, other=0)
        lmask = tl.load(t_ptr + 2 * nblocks + blk, mask=ok, other=-1)
        dst = tl.load(t_ptr + 3 * nblocks + blk, mask=ok, other=0)
        j = tl.arange(0, PAIRS)
        ka = tl.load(k_ptr + j)
        kb = tl.load(k_ptr + SH // 2 + j)
        ka0, ka1 = ka.to(tl.uint32), (ka >> 32).to(tl.uint32)
        kb0, kb1 = kb.to(tl.uint32), (kb >> 32).to(tl.uint32)
        live = j[None, :] < count[:, None]
        x = tl.load(x_ptr + (first - base)[:, None] + j[None, :], mask=live, other=0)
        if COPY:
            tl.store(y_ptr + first[:, None] + j[None, :], x, mask=live)
        x = tl.where(j[None, :] == count[:, None] - 1, x & lmask[:, None], x)
        m0, m1 = x.to(tl.uint32), (x >> 32).to(tl.uint32)
        pa = (m0 + ka0[None, :]).to(tl.uint64) * (m1 + ka1[None, :]).to(tl.uint64)
        pb = (m0 + kb0[None, :]).to(tl.uint64) * (m1 + kb1[None, :]).to(tl.uint64)
        tl.store(out_ptr + 2 * dst, tl.sum(pa, axis=1).to(tl.int64, bitcast=True), mask=ok)
        tl.store(out_ptr + 2 * dst + 1, tl.sum(pb, axis=1).to(tl.int64, bitcast=True), mask=ok)

    return _nh_seg


_nh1 = LazyKernel(lambda: _build(KIND), "Triton NH kernel (the torch ops give the same words)")
_segments = LazyKernel(_build_segments, "Triton segmented NH kernel (keyed_hash hashes tensor by tensor)")


def _triton_kernel(kind: str = "pairs"):
    """The compiled kernel, or None when Triton is missing or unusable (then ``nh_level``)."""
    if kind != KIND:  # another variant (the bandwidth bench compares them)
        if kind not in _variants:
            _variants[kind] = _build(kind)
        return _variants[kind]
    return _nh1.get()


def _key_words32(key):
    """The key as int32 words (the low halves of its int64 values), cached per key tensor."""
    import torch

    kid = id(key)
    hit = _key32.get(kid)
    if hit is not None and hit[0]() is key and hit[1] == key._version:
        return hit[2]
    k32 = key.to(torch.int64).contiguous().view(torch.int32)[0::2].contiguous()  # little-endian low words
    _key32[kid] = (weakref.ref(key, lambda _r, kid=kid: _key32.pop(kid, None)), key._version, k32)
    return k32


def _usable(words) -> bool:
    if words.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and words.device.type == "cpu"


def nh_level1(words, key, blocks_per_program: "int | None" = None, num_warps: "int | None" = None, kind: "str | None" = None):
    """One NH level of int32 ``words`` (any length) under the int64 ``key`` (``KEY_WORDS``
    values < 2**32) → int64 ``[A0, B0, A1, B1, ...]``, equal to ``keyed_hash.nh_level``."""
    import torch

    kind = kind or KIND
    kern = _triton_kernel() if kind == KIND else _triton_kernel(kind)
    if kern is None or not _usable(words):
        return nh_level(words, key)
    if words.dtype != torch.int32:
        raise TypeError(f"nh_level1 hashes int32 words, got {words.dtype}")
    if key.numel() != KEY_WORDS:
        raise ValueError(f"an NH level key has {KEY_WORDS} words, got {key.numel()}")
    words = words.reshape(-1)
    n = words.numel()
    nblocks = max(1, -(-n // BLOCK))
    out = torch.empty(2 * nblocks, dtype=torch.int64, device=words.device)
    k32 = _key_words32(key.to(words.device))
    g = blocks_per_program or BLOCKS_PER_PROGRAM
    grid = (-(-nblocks // g),)
    if kind == "pairs":
        if n % 2 or words.data_ptr() % 8 or not words.is_contiguous():
            # an odd count or a view off 8-byte alignment (never the case for digest()): one
            # zero word more changes nothing (the last block is zero-padded anyway)
            words = torch.cat((words, torch.zeros(n % 2, dtype=torch.int32, device=words.device)))
        x = words.view(torch.int64) if words.numel() else torch.zeros(1, dtype=torch.int64, device=words.device)
        last = words.numel() // 2 - (nblocks - 1) * (BLOCK // 2)  # pairs in the last block
        kern[grid](x, k32.view(torch.int64), out, nblocks, last, G=g, PAIRS=BLOCK // 2, SH=SHIFT,
                   num_warps=num_warps or NUM_WARPS)
    else:
        if not words.is_contiguous():
            words = words.contiguous()
        last = n - (nblocks - 1) * BLOCK  # words in the last block
        x = words if n else torch.zeros(2, dtype=torch.int32, device=words.device)
        kern[grid](x, k32, out, nblocks, last, G=g, PAIRS=BLOCK // 2, SH=SHIFT, num_warps=num_warps or NUM_WARPS)
    return out


def _nh_segments(src, key, table, out) -> None:
    """``keyed_hash.SegmentLevel`` in one Triton launch: every block of every range of one
    NH level (the transfer's buckets: all tensors of a bucket, level by level)."""
    _launch_segments(src, src, key, table, out, 0, copy=False)


def _nh_segments_copy(src, dst, key, table, out, base: int) -> None:
    """``keyed_hash.SegmentCopyLevel`` in one Triton launch: the sender's pack of one tensor
    into its bucket and the first level of its digest, reading the tensor once."""
    _launch_segments(src, dst, key, table, out, base, copy=True)


def _launch_segments(src, dst, key, table, out, base: int, copy: bool) -> None:
    import torch

    nblocks = table.shape[1]
    g = BLOCKS_PER_PROGRAM
    k32 = _key_words32(key.to(src.device)).view(torch.int64)
    _segments.get()[(-(-nblocks // g),)](src, dst, k32, table, out, nblocks, base, G=g, PAIRS=BLOCK // 2,
                                           SH=SHIFT, COPY=copy, num_warps=NUM_WARPS)


def __getattr__(name):
    # ``nh_segments`` exists only where its kernel can be built (keyed_hash asks for it by name
    # and hashes tensor by tensor without it)
    if name in ("nh_segments", "nh_segments_copy") and _segments.get() is not None:
        return _nh_segments if name == "nh_segments" else _nh_segments_copy
    raise AttributeError(name)


def warm_up(device) -> bool:
    """Compile the kernel now (driver start), not inside the first sleep; True when compiled
    and equal to the torch ops on a small input."""
    import torch

    if _triton_kernel() is None:
        return False
    from unisleep.keyed_hash import HashKey

    key = HashKey.new().level_tensor(0, device)
    w = torch.arange(3 * BLOCK + 5, dtype=torch.int32, device=device) * 7919
    return torch.equal(nh_level1(w, key), nh_level(w, key))


def remember_key_words32(key, words32) -> None:
    """Record ``words32`` (int32, the key's device) as the low words of the int64 level key
    ``key`` — what :func:`_key_words32` would compute — so a key made in a batch
    (``keyed_hash._load_level_keys``) needs no conversion pass of its own."""
    kid = id(key)
    _key32[kid] = (weakref.ref(key, lambda _r, kid=kid: _key32.pop(kid, None)), key._version, words32)
