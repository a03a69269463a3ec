"""The lossless backup encoding ``"planes"``: floating-point bytes split into an exponent plane,
entropy-coded, and sign/mantissa planes stored as they are — decided frame by frame, byte-exact.

Trained weights are far from random: the exponent of a bf16 weight takes a few dozen values
(about 2.5–3 of its 8 bits carry information), its sign and mantissa are close to random.  So a
frame is rearranged into planes of one byte per element and only the exponent plane is coded;
the rest is copied.  Every choice is made per frame (the spill store's checksum pieces) from the
bytes themselves, so no dtype has to be known: a frame whose estimated or actual size is not
below :data:`MAX_RATIO` of its raw size is stored plain (random bytes, quantised weights).

The format (docs/backup-encoding.md has it whole, for an implementation on a device):

* **Transforms** (``transform`` byte of the header), over little-endian words of ``width`` bytes:

  ======  ==========  ======  =================================================================
  id      name        width   planes, each one byte per element, in this order
  ======  ==========  ======  =================================================================
  1       ``bf16``    2       E = ``(w >> 7) & 0xFF``; S = ``((w >> 8) & 0x80) | (w & 0x7F)``
  2       ``fp16``    2       E = ``w >> 8`` (sign, 5 exponent bits, 2 mantissa bits); S = ``w & 0xFF``
  3       ``fp32``    4       E = ``(w >> 23) & 0xFF``; then, of ``m = ((w >> 8) & 0x800000) | (w & 0x7FFFFF)``:
                              S0 = ``m & 0xFF``, S1 = ``(m >> 8) & 0xFF``, S2 = ``m >> 16``
  ======  ==========  ======  =================================================================

* **Entropy stage**: the E plane is cut into blocks of :data:`BLOCK` bytes (the last may be
  shorter), each coded on its own as a raw DEFLATE stream (RFC 1951, no zlib or gzip wrapper)
  made with Huffman coding only (zlib's ``Z_HUFFMAN_ONLY``; any valid DEFLATE stream decodes).
  Independent blocks of at most 64 KiB are what batched device decoders take (and what lets
  host threads share a frame).
* **Frame** (all integers little-endian)::

      offset  size        field
      0       4           magic b"USP1"
      4       1           transform id (above)
      5       1           coder id: 1 = raw DEFLATE blocks
      6       2           reserved, 0
      8       8           raw bytes of the frame (a multiple of the width)
      16      4           number of E blocks, B
      20      4           BLOCK (raw E bytes per block)
      24      4 * B       coded length of each E block
      ...                 the B coded E blocks, back to back
      ...                 the S planes, in the order above, raw

  A plain frame is the raw bytes themselves, with no header: which frames are encoded is kept
  with the backup's checksums (:class:`Frame`), not in the file.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional

#: the encodings a store may be asked for (``MemoryLifecycle(backup_encoding=...)``)
ENCODINGS = ("planes",)
MAGIC = b"USP1"
#: raw bytes of the exponent plane per DEFLATE block
BLOCK = 64 << 10
#: a frame is stored encoded only when it takes less than this share of its raw size
MAX_RATIO = 0.97
#: the largest frame a store writes: what encoding or decoding one frame holds in scratch (a few
#: times this) stays bounded whatever the size of the backup
MAX_FRAME = 32 << 20
#: bytes of a frame looked at to choose its transform (its start, middle and end)
SAMPLE = 16 << 10
HEADER = struct.Struct("<4sBBHQII")
TRANSFORMS = {1: ("bf16", 2), 2: ("fp16", 2), 3: ("fp32", 4)}
CODER_DEFLATE = 1


@dataclass(frozen=True)
class Frame:
    """One checksum piece of a backup as stored: raw bytes ``[offset, offset + length)`` of the
    backup, at ``[file_offset, file_offset + stored)`` of its file; ``transform`` 0 = plain;
    ``raw_sum`` the XXH3-64 of the raw bytes (checked after decoding), ``stored_sum`` that of the
    stored bytes (checked before anything is decoded or exposed)."""

    offset: int
    length: int
    file_offset: int
    stored: int
    transform: int
    raw_sum: int
    stored_sum: int


def _np():
    import numpy as np

    return np


def _exponent_plane(np, raw, transform: int):
    if transform == 1:
        w = np.frombuffer(raw, dtype="<u2")
        return ((w >> 7) & 0xFF).astype(np.uint8)
    if transform == 2:
        return np.frombuffer(raw, dtype=np.uint8)[1::2]
    w = np.frombuffer(raw, dtype="<u4")
    return ((w >> 23) & 0xFF).astype(np.uint8)


def _entropy_bits(np, plane) -> float:
    """Bits per byte of an order-0 code of ``plane`` (what Huffman coding gets close to)."""
    if plane.size == 0:
        return 8.0
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum())


def _sample(raw, n: int) -> bytes:
    if n <= 3 * SAMPLE:
        return bytes(raw)
    mid = (n // 2) // 8 * 8
    return bytes(raw[:SAMPLE]) + bytes(raw[mid:mid + SAMPLE]) + bytes(raw[n - SAMPLE:])


def choose(raw) -> int:
    """The transform id that the bytes ``raw`` (a buffer) estimate smallest under, or 0 (plain)
    when none is estimated below :data:`MAX_RATIO` of the raw size."""
    np = _np()
    n = len(raw)
    if n < 1024:
        return 0
    sample = _sample(raw, n)
    best, best_ratio = 0, MAX_RATIO
    for t, (_, width) in TRANSFORMS.items():
        if n % width or len(sample) % width:
            continue
        bits = _entropy_bits(np, _exponent_plane(np, sample, t))
        ratio = (bits / 8 + (width - 1)) / width + 0.002  # + block framing
        if ratio < best_ratio:
            best, best_ratio = t, ratio
    return best


def encode(raw, transform: Optional[int] = None) -> Optional[bytes]:
    """The encoded frame of the bytes ``raw`` (a buffer), or None when it is better stored plain
    (no transform estimated to pay, or the coded frame not below :data:`MAX_RATIO`)."""
    np = _np()
    n = len(raw)
    t = choose(raw) if transform is None else transform
    if t == 0:
        return None
    width = TRANSFORMS[t][1]
    if n % width:
        return None
    if t == 1:
        w = np.frombuffer(raw, dtype="<u2")
        e = ((w >> 7) & 0xFF).astype(np.uint8)
        rest = [(((w >> 8) & 0x80) | (w & 0x7F)).astype(np.uint8)]
    elif t == 2:
        b = np.frombuffer(raw, dtype=np.uint8)
        e, rest = b[1::2].copy(), [b[0::2].copy()]
    else:
        w = np.frombuffer(raw, dtype="<u4")
        e = ((w >> 23) & 0xFF).astype(np.uint8)
        m = ((w >> 8) & 0x800000) | (w & 0x7FFFFF)
        rest = [(m & 0xFF).astype(np.uint8), ((m >> 8) & 0xFF).astype(np.uint8), (m >> 16).astype(np.uint8)]
    ev = memoryview(e)
    spans = [ev[lo:lo + BLOCK] for lo in range(0, len(e), BLOCK)]
    blocks = list(_pool().map(_deflate, spans)) if len(spans) > 4 else [_deflate(b) for b in spans]
    size = HEADER.size + 4 * len(blocks) + sum(map(len, blocks)) + sum(r.size for r in rest)
    if size >= MAX_RATIO * n:
        return None
    out = bytearray(size)
    HEADER.pack_into(out, 0, MAGIC, t, CODER_DEFLATE, 0, n, len(blocks), BLOCK)
    pos = HEADER.size
    struct.pack_into(f"<{len(blocks)}I", out, pos, *map(len, blocks))
    pos += 4 * len(blocks)
    for blk in blocks:
        out[pos:pos + len(blk)] = blk
        pos += len(blk)
    for r in rest:
        out[pos:pos + r.size] = r.tobytes()
        pos += r.size
    return bytes(out)


def _deflate(block) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(block) + c.flush()


_POOL = None


def _pool():
    """Threads coding the blocks of a frame at once (zlib releases the GIL): one per core, at most 4."""
    global _POOL
    if _POOL is None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="unisleep-encode")
    return _POOL


class FormatError(ValueError):
    """An encoded frame that does not follow the format (its checksum passed: a writer's bug)."""


def decode(frame, out) -> None:
    """Decode the encoded ``frame`` (a buffer) into the writable buffer ``out`` (its raw length);
    raises :class:`FormatError` on a frame that does not follow the format."""
    np = _np()
    fv = memoryview(frame)
    if len(fv) < HEADER.size:
        raise FormatError("an encoded frame shorter than its header")
    magic, t, coder, _, n, nblocks, block = HEADER.unpack_from(fv, 0)
    if magic != MAGIC or t not in TRANSFORMS or coder != CODER_DEFLATE or n != len(out) or block <= 0:
        raise FormatError(f"an encoded frame with header {magic!r}/{t}/{coder}/{n} does not fit {len(out)} bytes")
    width = TRANSFORMS[t][1]
    count = n // width
    pos = HEADER.size
    lens = struct.unpack_from(f"<{nblocks}I", fv, pos)
    pos += 4 * nblocks
    e = np.empty(count, dtype=np.uint8)
    ev = memoryview(e)
    done = 0
    for ln in lens:
        d = zlib.decompressobj(-15)
        got = d.decompress(fv[pos:pos + ln], block)
        if d.unconsumed_tail or not d.eof or done + len(got) > count:
            raise FormatError("an exponent block of an encoded frame does not decode to its length")
        ev[done:done + len(got)] = got
        done += len(got)
        pos += ln
    if done != count:
        raise FormatError(f"the exponent plane of an encoded frame holds {done} of {count} bytes")
    planes = []
    for _ in range(width - 1):
        if pos + count > len(fv):
            raise FormatError("an encoded frame is shorter than its planes")
        planes.append(np.frombuffer(fv[pos:pos + count], dtype=np.uint8))
        pos += count
    if t == 1:
        s = planes[0].astype(np.uint16)
        w = (e.astype(np.uint16) << 7) | ((s & 0x80) << 8) | (s & 0x7F)
        np.frombuffer(out, dtype="<u2")[:] = w
    elif t == 2:
        o = np.frombuffer(out, dtype=np.uint8)
        o[1::2] = e
        o[0::2] = planes[0]
    else:
        p2 = planes[2].astype(np.uint32)
        w = ((e.astype(np.uint32) << 23) | ((p2 & 0x80) << 24) | ((p2 & 0x7F) << 16)
             | (planes[1].astype(np.uint32) << 8) | planes[0])
        np.frombuffer(out, dtype="<u4")[:] = w
