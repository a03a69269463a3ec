"""What an update holds (names, shapes, dtypes), how it is cut into buckets, and the checksums
that prove every byte arrived.

Bucket layout (the same rule on both ends, so only the tensor specs and the bucket size travel)::

    | tensor 0 | pad | tensor 1 | pad | ... | trailer: int64[3 + 4n] = seq, bucket, n, digest_0 .. digest_{n-1} (4 words each) |

Tensors start at 64-byte offsets; the trailer starts at an 8-byte offset.  A tensor larger than a
bucket gets a bucket of its own.  The sender writes a keyed digest of every tensor into the
trailer; the receiver recomputes it on what arrived and compares.

The digest is :mod:`unisleep.keyed_hash` (GMAC for host memory, the NH universal-hash tree
on a device), keyed from the group secret per update: without the secret nobody can compute it,
and no edit of the bytes (swapped words, cancelling sums, bit flips) passes it, whatever its
pattern, except with probability below 2**-60.  Each digest in a trailer is masked with a
one-time pad derived from the secret, the update, the bucket and the slot, so digests seen on the
wire reveal nothing about the key and cannot be moved between tensors or updates.

Also here: copying a tensor into its place in a bucket (:func:`pack_tensor`), the ``(name,
tensor)`` pairs of what callers pass (:func:`tensor_pairs`) and lists of names shortened for error
messages (:func:`short_names`).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple, Optional, Sequence

from ..errors import InvalidArgumentError
from .records import DTYPES, MAX_DIMS, MAX_NAME

ALIGN = 64  # byte offset of every tensor inside a bucket


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
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))


_DTYPE_NAMES: dict = {}  # torch.dtype -> its name as a spec spells it


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (cached per dtype: a spec per tensor costs little)."""
    n = _DTYPE_NAMES.get(dtype)
    if n is None:
        n = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return n


def spec_of(s, i: int) -> TensorSpec:
    """The :class:`TensorSpec` of entry ``i`` of a ``specs`` list (a TensorSpec or ``(name, shape,
    dtype)``, dtype a ``torch.dtype`` or its name); :class:`InvalidArgumentError` naming the entry
    and what is wrong with it."""
    if isinstance(s, TensorSpec):
        name, shape, dtype = s.name, s.shape, s.dtype
    else:
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) != 3:
            raise InvalidArgumentError(f"spec #{i} must be a TensorSpec or (name, shape, dtype), got {str(s)[:120]}")
        name, shape, dtype = s
    return TensorSpec(check_name(name, i), check_shape(shape, name, i), check_dtype(dtype, name, i))


def check_name(name, i: int) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise InvalidArgumentError(f"tensor #{i}: its name must be a string of 1-{MAX_NAME} characters, "
                                   f"got {str(name)[:80]!r} ({type(name).__name__})")
    return name


def check_shape(shape, name: str, i: int) -> tuple:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or len(dims) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in dims):
        raise InvalidArgumentError(f"tensor #{i} {name!r}: shape {shape!r} must be at most {MAX_DIMS} integers, "
                                   "each >= 0")
    return tuple(int(d) for d in dims)


def check_dtype(dtype, name: str, i: int) -> str:
    d = str(dtype).replace("torch.", "") if not isinstance(dtype, str) else dtype.replace("torch.", "")
    if d not in DTYPES or _torch_dtype(d) is None:
        raise InvalidArgumentError(f"tensor #{i} {name!r}: unknown dtype {str(dtype)[:40]!r}; a weight update carries "
                                   f"{', '.join(sorted(x for x in DTYPES if _torch_dtype(x) is not None))}")
    return d


def check_tensor(name, t, i: int):
    """``t`` when it is a tensor whose name, shape and dtype can travel; else
    :class:`InvalidArgumentError` naming it."""
    import torch

    if not (type(name) is str and 0 < len(name) <= MAX_NAME):
        check_name(name, i)
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"tensor #{i} {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype not in _GOOD_DTYPES:
        check_dtype(t.dtype, name, i)
        _GOOD_DTYPES.add(t.dtype)
    return t


_GOOD_DTYPES: set = set()  # torch dtypes check_dtype accepted


def _torch_dtype(name: str):
    import torch

    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else None


_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        import torch

        n = _ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return n


class Slot(NamedTuple):
    """Where one tensor sits: index into the specs, byte offset in its bucket, byte length (a
    named tuple: an update of many tensors makes one per tensor, on both sides)."""

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
        return trailer_words(len(self.slots))


TRAILER_HEAD = 3  # trailer words: update, bucket, n
WORDS_PER_TENSOR = 4  # then per tensor: algorithm, byte length, lane a (masked), lane b (masked)


def trailer_words(n: int) -> int:
    return TRAILER_HEAD + WORDS_PER_TENSOR * n


#: a bucket holds at most this many tensors, whatever their bytes: an update of many small
#: tensors then comes in several buckets, so that the receiver verifies and applies one while the
#: sender packs the next (in one bucket the two sides' work per tensor adds up instead of
#: overlapping).  Part of the bucket layout both sides compute, so of the transfer protocol
#: (:data:`~unisleep.transfer.records.PROTOCOL`).
BUCKET_TENSORS = 256


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int,
                 max_tensors: Optional[int] = BUCKET_TENSORS) -> list[BucketPlan]:
    """Cut ``specs`` (in order) into buckets of at most ``bucket_bytes`` of tensor data and at
    most ``max_tensors`` tensors (None: no limit); a tensor larger than ``bucket_bytes`` gets a
    bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if max_tensors is not None and max_tensors < 1:
        raise ValueError(f"max_tensors must be >= 1 or None, got {max_tensors}")
    plans: list[BucketPlan] = []
    cur: list[Slot] = []
    off = 0

    def close():
        nonlocal cur, off
        if cur:
            data = _round_up(off, 8)
            plans.append(BucketPlan(len(plans), tuple(cur), data, data + 8 * trailer_words(len(cur))))
        cur, off = [], 0

    for i, s in enumerate(specs):
        n = s.nbytes
        start = _round_up(off, ALIGN)
        if cur and (start + n > bucket_bytes or (max_tensors is not None and len(cur) >= max_tensors)):
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

    @cached_property
    def meta_id(self) -> str:
        h = hashlib.sha256(json.dumps([(s.name, list(s.shape), s.dtype) for s in self.specs]).encode())
        return h.hexdigest()[:24]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @classmethod
    def of(cls, named_tensors: Iterable) -> "Manifest":
        return cls(tuple(TensorSpec.of(n, t) for n, t in named_tensors))


# ------------------------------------------------------------------------------ digests


class UpdateSeal:
    """The keys of one update: the keyed-hash key (derived from the group secret, the epoch and
    the update number) and the pad key that masks every digest in a trailer (a one-time pad per
    update, bucket and tensor, so the digests on the wire reveal nothing of the hash key and a
    digest cannot be moved to another place)."""

    def __init__(self, hash_key, pad_key: bytes, group_id: str, epoch: int, seq: int):
        self.hash_key = hash_key
        self._pad_key = pad_key
        self._ctx = f"{group_id}/{epoch}/{seq}/".encode()

    def pad(self, bucket: int, slot: int) -> tuple[int, int]:
        m = hmac.digest(self._pad_key, self._ctx + struct.pack("<QQ", bucket, slot), "sha256")
        return struct.unpack_from("<QQ", m)

    def release(self) -> None:
        """Drop the device copies of this update's hash key now (they would go with the key)."""
        tensors = getattr(self.hash_key, "_tensors", None)
        if isinstance(tensors, dict):
            tensors.clear()

    @classmethod
    def prepared(cls, group, seq: int, epoch: int, plans: Sequence["BucketPlan"]) -> "UpdateSeal":
        """The seal of update ``seq`` of ``group``, its hash key's levels already on the group's
        device for the largest tensor of ``plans`` (so no bucket waits for them; host buckets
        are hashed with GMAC, which needs no level keys)."""
        from ..keyed_hash import tree_levels_of_bytes

        largest = largest_tensor(plans)
        seal = cls(group.hash_key(seq, epoch, largest), group.subkey("pad"), group.group_id, epoch, seq)
        dev = group.device
        if dev.type != "cpu":
            for level in range(tree_levels_of_bytes(largest)):
                seal.hash_key.level_tensor(level, dev)
        return seal

    def fits(self, plans: Sequence["BucketPlan"]) -> bool:
        """Whether this seal's key has exactly the levels :meth:`prepared` derives for ``plans``
        (a seal made ahead for the next update is used only then: the receivers derive theirs
        from that update's plans)."""
        from ..keyed_hash import key_levels

        return self.hash_key.levels == key_levels(largest_tensor(plans))

    def pads(self, bucket: int, n: int) -> list[int]:
        """The pads of slots ``0..n-1`` of a bucket as signed int64 words ``[a0, b0, a1, b1, ...]``."""
        key, ctx, out = self._pad_key, self._ctx, []
        for i in range(n):
            a, b = struct.unpack_from("<qq", hmac.digest(key, ctx + struct.pack("<QQ", bucket, i), "sha256"))
            out += (a, b)
        return out

    def lanes(self, buf_u8, plan: "BucketPlan"):
        """The NH lanes of every tensor of a bucket on the bucket's device, no wait: int64 [2n]
        (all tensors of the bucket together, a few kernel launches: :meth:`hasher` with nothing
        filled through it)."""
        return self.hasher(buf_u8, plan).lanes()

    def hasher(self, buf_u8, plan: "BucketPlan"):
        """A :class:`~unisleep.keyed_hash.BucketLanes` for a device bucket being packed: the
        sender fills each tensor through it (copy and first hash level in one pass) and hands
        its ``lanes()`` to :func:`write_trailer`."""
        from ..keyed_hash import BucketLanes

        return BucketLanes(buf_u8, [(s.offset, s.nbytes) for s in plan.slots], self.hash_key)

    def digests(self, buf_u8, plan: "BucketPlan", algorithm: Optional[str] = None, slots=None) -> list:
        """The keyed digest of every tensor of a bucket (or of ``slots``), one wait for the device."""
        from ..keyed_hash import GMAC, digest_many, gmac_spans

        slots = plan.slots if slots is None else slots
        if buf_u8.device.type == "cpu" and algorithm in (None, GMAC) and buf_u8.is_contiguous():
            return gmac_spans(buf_u8, [(s.offset, s.nbytes) for s in slots], self.hash_key)
        return digest_many([buf_u8[s.offset: s.offset + s.nbytes] for s in slots], [self.hash_key] * len(slots),
                           algorithm=algorithm)


def largest_tensor(plans: Sequence["BucketPlan"]) -> int:
    """Bytes of the largest tensor of an update's bucket plans (what its hash key must cover)."""
    return max((s.nbytes for p in plans for s in p.slots), default=0)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def write_trailer(buf_u8, plan: BucketPlan, seq: int, seal: Optional[UpdateSeal], lanes=None) -> None:
    """Write ``update, bucket, n`` and the masked keyed digest of every tensor (zeros when not
    verifying) behind the data of a packed bucket.  ``lanes``: the device bucket's NH lanes,
    already queued (e.g. by :meth:`UpdateSeal.hasher` while packing)."""
    import torch

    from ..keyed_hash import ALGORITHMS

    words = [seq, plan.index, len(plan.slots)]
    tr = buf_u8[plan.data_bytes: plan.total_bytes].view(torch.int64)
    if seal is not None and plan.slots and buf_u8.device.type != "cpu":
        _write_on_device(buf_u8, tr, plan, words, seal, lanes)
        return
    if seal is None:
        words += [0] * (WORDS_PER_TENSOR * len(plan.slots))
    else:
        pads = seal.pads(plan.index, len(plan.slots))
        for i, d in enumerate(seal.digests(buf_u8, plan)):
            words += (ALGORITHMS.index(d.algorithm), d.nbytes, _signed(d.lane_a) ^ pads[2 * i],
                      _signed(d.lane_b) ^ pads[2 * i + 1])
    if tr.device.type == "cpu" and tr.is_contiguous():
        tr.numpy()[:] = words  # one conversion, no temporary tensor
    else:
        tr.copy_(torch.tensor(words, dtype=torch.int64), non_blocking=True)


def _write_on_device(buf_u8, tr, plan: BucketPlan, words: list, seal: UpdateSeal, lanes=None) -> None:
    """:func:`write_trailer` for a bucket on a device: the masked NH digests are made there with
    no wait for the device (the plain words and the pads go up in one small copy; the lanes are
    XORed into them on the device)."""
    import torch

    from ..keyed_hash import ALGORITHMS, NH2

    pads = seal.pads(plan.index, len(plan.slots))
    for i, s in enumerate(plan.slots):
        words += [ALGORITHMS.index(NH2), s.nbytes, pads[2 * i], pads[2 * i + 1]]
    tr.copy_(torch.tensor(words, dtype=torch.int64), non_blocking=True)
    if lanes is None:
        lanes = seal.lanes(buf_u8, plan)
    tr[TRAILER_HEAD:].view(-1, WORDS_PER_TENSOR)[:, 2:].bitwise_xor_(lanes.view(-1, 2))


def check_bucket(buf_u8, plan: BucketPlan, seq: int, seal: Optional[UpdateSeal]) -> tuple[Optional[str], list[int]]:
    """Verify a received bucket.  Returns (problem with the trailer or None, indices into
    ``plan.slots`` whose digest differs)."""
    import torch

    from ..keyed_hash import ALGORITHMS, Digest

    trd = buf_u8[plan.data_bytes: plan.total_bytes].view(torch.int64)
    if seal is not None and plan.slots and buf_u8.device.type != "cpu":
        return _check_on_device(buf_u8, trd, plan, seq, seal)
    tr = trd.tolist()
    wrong = _wrong_head(tr[:TRAILER_HEAD], plan, seq)
    if wrong:
        return wrong
    if seal is None or not plan.slots:
        return None, []
    bad, wanted = [], {}  # algorithm -> [(slot index, expected digest)]
    pads = seal.pads(plan.index, len(plan.slots))
    for i, s in enumerate(plan.slots):
        algo, n, a, b = tr[TRAILER_HEAD + WORDS_PER_TENSOR * i: TRAILER_HEAD + WORDS_PER_TENSOR * (i + 1)]
        if not 0 <= algo < len(ALGORITHMS) or n != s.nbytes:
            bad.append(i)
            continue
        wanted.setdefault(ALGORITHMS[algo], []).append(
            (i, Digest(n, (a ^ pads[2 * i]) & _M64, (b ^ pads[2 * i + 1]) & _M64, ALGORITHMS[algo])))
    for algo, items in wanted.items():  # one wait for the device per algorithm, not per tensor
        got = seal.digests(buf_u8, plan, algorithm=algo, slots=[plan.slots[i] for i, _ in items])
        bad += [i for (i, want), d in zip(items, got) if d != want]
    return None, sorted(bad)


_M64 = (1 << 64) - 1


def _wrong_head(head: list, plan: BucketPlan, seq: int) -> Optional[tuple[str, list[int]]]:
    """:func:`check_bucket`'s answer when the trailer's head is not this update's bucket."""
    n = len(plan.slots)
    if head == [seq, plan.index, n]:
        return None
    return (f"bucket {plan.index}: trailer says update {head[0]}, bucket {head[1]}, {head[2]} tensors; "
            f"expected update {seq}, bucket {plan.index}, {n} tensors", list(range(n)))


def _check_on_device(buf_u8, trd, plan: BucketPlan, seq: int, seal: UpdateSeal) -> tuple[Optional[str], list[int]]:
    """:func:`check_bucket` for a bucket on a device: the NH lanes are computed and compared
    there, and one small read (the trailer's head, each slot's algorithm and length, and one
    match flag per slot) is the only wait for the device."""
    import torch

    from ..keyed_hash import ALGORITHMS, NH2

    n = len(plan.slots)
    slots = trd[TRAILER_HEAD:].view(n, WORDS_PER_TENSOR)
    pads = torch.tensor(seal.pads(plan.index, n), dtype=torch.int64).to(trd.device, non_blocking=True).view(n, 2)
    match = ((slots[:, 2:] ^ pads) == seal.lanes(buf_u8, plan).view(n, 2)).all(1).to(torch.int64)
    got = torch.cat((trd[:TRAILER_HEAD], slots[:, :2].reshape(-1), match)).tolist()  # the one wait
    wrong = _wrong_head(got[:TRAILER_HEAD], plan, seq)
    if wrong:
        return wrong
    meta, ok = got[TRAILER_HEAD: TRAILER_HEAD + 2 * n], got[TRAILER_HEAD + 2 * n:]
    nh = ALGORITHMS.index(NH2)
    bad = [i for i, s in enumerate(plan.slots) if meta[2 * i] != nh or meta[2 * i + 1] != s.nbytes or not ok[i]]
    return None, bad


__all__ = [
    "TensorSpec",
    "Slot",
    "BucketPlan",
    "Manifest",
    "plan_buckets",
    "spec_of",
    "check_tensor",
    "UpdateSeal",
    "write_trailer",
    "check_bucket",
    "ALIGN",
]


def pack_tensor(buf, offset: int, nbytes: int, t) -> None:
    """Copy tensor ``t`` (``nbytes`` bytes, its spec checked) into ``buf[offset:]``: a plain
    memory copy when both are dense host memory (a microsecond or two, where a tensor view and
    ``copy_`` cost tens of microseconds per small tensor), else through torch."""
    import torch

    if (t.device.type == "cpu" and buf.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.numel() * t.element_size() == nbytes
            and offset + nbytes <= buf.numel()):
        ctypes.memmove(buf.data_ptr() + offset, t.data_ptr(), nbytes)
    else:
        buf[offset: offset + nbytes].view(t.dtype).view(t.shape).copy_(t)


def tensor_pairs(obj) -> list:
    """(name, tensor) pairs of a Module (parameters + buffers), a mapping or an iterable of pairs."""
    if hasattr(obj, "named_parameters") and hasattr(obj, "named_buffers"):
        return list(obj.named_parameters()) + list(obj.named_buffers())
    if isinstance(obj, Mapping):
        return list(obj.items())
    return list(obj)


def short_names(names: Sequence[str], n: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
