"""What an update holds (names, shapes, dtypes), how it is cut into buckets, and the checksums
that prove every byte arrived.

Bucket layout (the same rule on both ends, so only the tensor specs and the bucket size travel)::

    | tensor 0 | pad | tensor 1 | pad | ... | trailer: int64[3 + n] = seq, bucket, n, checksum_0 .. checksum_{n-1} |

Tensors start at 64-byte offsets; the trailer starts at an 8-byte offset.  A tensor larger than a
bucket gets a bucket of its own.  The sender writes the checksums into the trailer on the device
(no host round trip); the receiver recomputes them on what arrived and compares.

The checksum is a positional sum over the bytes viewed as int64 words (rows of 4 KiB summed,
then the row sums weighted by position via a cumulative sum, wrapping modulo 2**64).  It is exact
integer arithmetic, so it gives the same value on every device type, and it reads the bytes once
at memory speed.  It catches lost, truncated, zeroed, shifted or garbled data; it is not a
cryptographic hash and does not see two 8-byte words swapped inside one 4 KiB row.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

ALIGN = 64  # byte offset of every tensor inside a bucket
_ROW = 512  # int64 words per row in the checksum (4 KiB)
_K1, _K2, _K3 = 0x9E3779B97F4A7C15 - 2**64, 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of an update (dtype as torch spells it, e.g. ``"bfloat16"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def of(cls, name: str, tensor) -> "TensorSpec":
        return cls(name, tuple(int(s) for s in tensor.shape), str(tensor.dtype).replace("torch.", ""))


_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        import torch

        n = _ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return n


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits: index into the specs, byte offset in its bucket, byte length."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    index: int
    slots: tuple[Slot, ...]
    data_bytes: int  # where the trailer starts
    total_bytes: int  # data + trailer

    @property
    def trailer_words(self) -> int:
        return 3 + len(self.slots)


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[BucketPlan]:
    """Cut ``specs`` (in order) into buckets of at most ``bucket_bytes`` of tensor data; a tensor
    larger than that gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    plans: list[BucketPlan] = []
    cur: list[Slot] = []
    off = 0

    def close():
        nonlocal cur, off
        if cur:
            data = _round_up(off, 8)
            plans.append(BucketPlan(len(plans), tuple(cur), data, data + 8 * (3 + len(cur))))
        cur, off = [], 0

    for i, s in enumerate(specs):
        n = s.nbytes
        start = _round_up(off, ALIGN)
        if cur and start + n > bucket_bytes:
            close()
            start = 0
        cur.append(Slot(i, start, n))
        off = start + n
    close()
    return plans


@dataclass(frozen=True)
class Manifest:
    """The tensor specs of an update.  ``meta_id`` identifies names+shapes+dtypes, so a repeated
    update with the same structure sends only the id (metadata is reused)."""

    specs: tuple[TensorSpec, ...]

    @property
    def meta_id(self) -> str:
        h = hashlib.sha256(pickle.dumps([(s.name, s.shape, s.dtype) for s in self.specs]))
        return h.hexdigest()[:24]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @classmethod
    def of(cls, named_tensors: Iterable) -> "Manifest":
        return cls(tuple(TensorSpec.of(n, t) for n, t in named_tensors))


# ------------------------------------------------------------------------------ checksums
def checksum(buf_u8):
    """0-d int64 tensor: positional checksum of a 1-D uint8 tensor that starts 8-byte aligned.
    Computed where the bytes live (no host round trip)."""
    import torch

    n = buf_u8.numel()
    nw = n // 8
    acc = torch.zeros((), dtype=torch.int64, device=buf_u8.device) + (n & 0x7FFFFFFFFFFFFFFF)
    if nw:
        words = buf_u8[: nw * 8].view(torch.int64)
        rows = nw // _ROW
        if rows:
            fused = _fused_rows_checksum(buf_u8.device.type)
            if fused is not None:
                acc = acc + fused(words, rows, _ROW, _K1, _K2)
            else:
                rs = words[: rows * _ROW].view(rows, _ROW).sum(1)
                acc = acc + rs.sum() * _K1 + rs.cumsum(0).sum() * _K2
        if nw % _ROW:
            rest = words[rows * _ROW :]
            acc = acc + rest.cumsum(0).sum() * _K3 + rest.sum()
    if n % 8:
        tail = buf_u8[nw * 8 :].to(torch.int64)
        acc = acc + (tail.cumsum(0).sum() + 1) * _K1
    return acc


_FUSED: dict = {}


def _fused_rows_checksum(device_type: str):
    """The backend's one-pass kernel for the row part of :func:`checksum` on this device type
    (same value as the torch ops), or None (host memory, or no such kernel / no Triton)."""
    if device_type not in _FUSED:
        import importlib

        from ..platform import accelerated_module

        fn = None
        mod = accelerated_module(device_type, "transfer_kernels")
        if mod is not None:
            try:
                fn = importlib.import_module(mod).rows_checksum
            except Exception:  # no Triton: the torch ops
                fn = None
        _FUSED[device_type] = fn
    return _FUSED[device_type]


def bucket_checksums(buf_u8, plan: BucketPlan):
    """int64 tensor [n]: the checksum of every tensor of ``plan`` inside ``buf_u8``."""
    import torch

    sums = [checksum(buf_u8[s.offset : s.offset + s.nbytes]) for s in plan.slots]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=buf_u8.device)


def write_trailer(buf_u8, plan: BucketPlan, seq: int, sums) -> None:
    """Write ``seq, bucket, n, checksums`` behind the data of a packed bucket."""
    import torch

    tr = buf_u8[plan.data_bytes : plan.total_bytes].view(torch.int64)
    tr[0], tr[1], tr[2] = seq, plan.index, len(plan.slots)
    if len(plan.slots):
        tr[3:].copy_(sums)


def check_bucket(buf_u8, plan: BucketPlan, seq: int) -> tuple[Optional[str], list[int]]:
    """Verify a received bucket.  Returns (problem with the trailer or None, indices into
    ``plan.slots`` whose checksum differs)."""
    import torch

    tr = buf_u8[plan.data_bytes : plan.total_bytes].view(torch.int64)
    mine = bucket_checksums(buf_u8, plan)
    head = tr[:3].tolist()
    if head != [seq, plan.index, len(plan.slots)]:
        return (
            f"bucket {plan.index}: trailer says update {head[0]}, bucket {head[1]}, {head[2]} tensors; "
            f"expected update {seq}, bucket {plan.index}, {len(plan.slots)} tensors",
            list(range(len(plan.slots))),
        )
    if not len(plan.slots):
        return None, []
    bad = torch.nonzero(mine != tr[3:]).flatten().tolist()
    return None, bad


__all__ = [
    "TensorSpec",
    "Slot",
    "BucketPlan",
    "Manifest",
    "plan_buckets",
    "checksum",
    "bucket_checksums",
    "write_trailer",
    "check_bucket",
    "ALIGN",
]
