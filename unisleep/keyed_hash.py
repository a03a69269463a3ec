"""A keyed universal hash of raw bytes: the proof that bytes are unchanged (skip-unchanged
sleeps) or arrived intact (weight-transfer manifests), which no edit can fool.

The construction is the NH hash of UMAC (Black, Halevi, Krawczyk, Krovetz, Rogaway, 1999) in
its two-lane Toeplitz form, applied as a tree:

* the bytes are read as little-endian 32-bit words ``m`` (zero-padded to a whole block of
  ``BLOCK`` words; the byte length is part of the digest);
* for each block and each lane ``l`` (key offset ``0`` or ``SHIFT`` words)::

      NH_l(block) = sum over pairs j of ((m[2j] + k[2j+l']) mod 2^32) * ((m[2j+1] + k[2j+1+l']) mod 2^32)   mod 2^64

* the two 64-bit outputs of every block, in order, form the next level's words; levels repeat
  with a fresh key each until one block remains; its two lanes are the digest.

For two inputs of the same length that differ anywhere, NH with two Toeplitz lanes collides
with probability at most ``2**-64`` per level over the random key, so the whole tree at most
``levels * 2**-64`` (8 GiB takes 4 levels, 1 TiB 6): below ``2**-60`` for **any** edit, whatever
its pattern (cancelling sums, swaps, bit flips, ±0.0, NaN payloads).  A new random key is drawn
for every backup (or derived from a group secret per update), so no fixed edit pattern is blind.

This module is the reference: exact integer arithmetic in torch, on whatever device the tensor
lives.  A backend may compute level 1 with a fused kernel (``backends/cuda/checksum.py``) as long
as it returns the same words; the levels above are a few MiB and run here.  The kernels are found
through the finder that :mod:`unisleep.registry` installs (:func:`find_kernels_with`).

In order: the key and the value (:class:`HashKey`, :class:`Digest`, the tree's constants), the
NH tree on tensors (:func:`nh_level`, the batched upper levels, :func:`reference_digest` — the
definition in plain Python integers), then the digests callers take (:func:`digest`,
:func:`digest_many`, :func:`start_digests`, the per-bucket lanes of a weight transfer) and GMAC.

Bytes in host memory take GMAC instead (AES-256-GCM's tag over the bytes as associated data,
from the ``cryptography`` package's OpenSSL: carry-less-multiply and AES instructions, several
times faster on one core than keyed BLAKE3 or NH in torch ops; docs/benchmarks.md has the figures).
GHASH is a polynomial universal hash over GF(2^128) under a secret point: two
different inputs of up to ``L`` 16-byte blocks collide with probability at most ``L / 2**128``
(``2**-98`` for 16 GiB), again for any edit.  The key is derived from the same key material; the
nonce is fixed, which is safe because a digest is never shown to anyone who lacks the key (the
lifecycle keeps them in its own memory; the transfer masks each one with a one-time pad).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass, field
from typing import Callable, Optional

BLOCK = 2048  # 32-bit words per NH block (8 KiB)
SHIFT = 4  # Toeplitz offset of the second lane, in words
KEY_WORDS = BLOCK + SHIFT
MAX_LEVELS = 12  # 2048/4 = 512-fold reduction a level: 12 levels cover any size
_M32 = 0xFFFFFFFF
_CHUNK_BLOCKS = 1024  # blocks hashed per torch pass on the reference path (8 MiB)


@dataclass(frozen=True)
class HashKey:
    """The random key of one digest: ``MAX_LEVELS`` independent NH keys of ``KEY_WORDS`` words."""

    material: bytes  # KEY_WORDS * 4 bytes per level: MAX_LEVELS, or the levels one size needs
    # the levels' key tensors per device, made on first use; they die with the key
    _tensors: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def new(cls, nbytes: Optional[int] = None) -> "HashKey":
        """A fresh key from the operating system's random source: every level, or only the
        levels the tree of ``nbytes`` bytes has (a quarter of the random bytes for a 1 GiB
        region; such a key hashes inputs of up to that tree's size)."""
        levels = MAX_LEVELS if nbytes is None else tree_levels_of_bytes(nbytes)
        return cls(secrets.token_bytes(levels * KEY_WORDS * 4))

    @property
    def levels(self) -> int:
        return len(self.material) // (KEY_WORDS * 4)


    @classmethod
    def derive(cls, secret: bytes, context: bytes, nbytes: Optional[int] = None) -> "HashKey":
        """A key derived from a shared ``secret`` and a ``context`` (e.g. group, epoch and update
        number), the same on every peer: SHAKE-256 over a domain tag, the length-prefixed secret
        and the context.  ``nbytes``: only the levels the tree of an input of that many bytes
        has (at least one: the key of an update whose largest tensor is ``nbytes``, made per
        update; SHAKE-256 is an extendable output, so these levels are the first levels of the
        full key) — None: every level (``MAX_LEVELS``).  Both peers must pass the same
        ``nbytes``: the GMAC key is made from the whole material."""
        if not secret:
            raise ValueError("derive() needs a non-empty secret")
        levels = key_levels(nbytes)
        material = b"unisleep keyed hash v1\0" + struct.pack("<I", len(secret)) + secret + context
        return cls(hashlib.shake_256(material).digest(levels * KEY_WORDS * 4))

    def level_bytes(self, level: int) -> bytes:
        """The key material of one level: ``KEY_WORDS`` little-endian uint32 words."""
        if not 0 <= level < self.levels:
            raise ValueError(f"level {level} is out of range (input too large to hash with this key)")
        size = KEY_WORDS * 4
        return self.material[level * size: (level + 1) * size]

    def level_words(self, level: int) -> list[int]:
        return list(struct.unpack(f"<{KEY_WORDS}I", self.level_bytes(level)))

    def level_tensor(self, level: int, device):
        """The level's key as int64 words (values < 2**32) on ``device``, cached per device."""
        import torch

        k = self._tensors.get((level, str(device)))
        if k is None:
            raw = bytearray(self.level_bytes(level))  # little-endian uint32 words
            k = torch.frombuffer(raw, dtype=torch.int32).to(torch.int64) & _M32
            k = k.to(device, non_blocking=True) if str(device) != "cpu" else k
            self._tensors[(level, str(device))] = k
        return k

    def __repr__(self) -> str:  # never print key material
        return "HashKey(<secret>)"


NH2, GMAC = "nh2", "gmac"
ALGORITHMS = (NH2, GMAC)


@dataclass(frozen=True)
class Digest:
    """A digest: the algorithm, the byte length and two 64-bit lanes.  Compare with ``==``."""

    nbytes: int
    lane_a: int
    lane_b: int
    algorithm: str = NH2

    def to_bytes(self) -> bytes:
        return struct.pack("<BQQQ", ALGORITHMS.index(self.algorithm), self.nbytes, self.lane_a, self.lane_b)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Digest":
        if len(raw) != 25:
            raise ValueError(f"a digest is 25 bytes, got {len(raw)}")
        algo, n, a, b = struct.unpack("<BQQQ", raw)
        if algo >= len(ALGORITHMS):
            raise ValueError(f"unknown digest algorithm number {algo}")
        return cls(n, a, b, ALGORITHMS[algo])

    def hex(self) -> str:
        return self.to_bytes().hex()



def tree_levels(nwords: int) -> int:
    """How many NH levels the tree of ``nwords`` 32-bit words has."""
    levels = 1
    while nwords > BLOCK:
        nwords = 4 * -(-nwords // BLOCK)  # two int64 lanes per block
        levels += 1
    return levels


def key_levels(nbytes: Optional[int]) -> int:
    """The levels :meth:`HashKey.derive` makes for inputs of up to ``nbytes`` bytes (None: all)."""
    return MAX_LEVELS if nbytes is None else max(1, min(MAX_LEVELS, tree_levels_of_bytes(int(nbytes))))


def tree_levels_of_bytes(nbytes: int) -> int:
    """How many NH levels the tree of ``nbytes`` bytes has (its words padded as :func:`_words` does)."""
    return tree_levels(max(2, -(-nbytes // 8) * 2))


#: a level-1 kernel: (words int32 tensor, key int64 tensor of KEY_WORDS) -> int64 tensor of
#: 2 * ceil(n / BLOCK) lane outputs, exactly as :func:`nh_level` computes them
Level1 = Callable[[object, object], object]


def nh_level(words, key):
    """One NH level: int32 words (any length) → int64 tensor ``[A0, B0, A1, B1, ...]`` (two
    wrapped 64-bit lanes per block of ``BLOCK`` words; the last block zero-padded)."""
    import torch

    n = words.numel()
    nblocks = max(1, -(-n // BLOCK))
    out = torch.empty(2 * nblocks, dtype=torch.int64, device=words.device)
    ke, ko = key[0:BLOCK:2], key[1:BLOCK:2]
    ke2, ko2 = key[SHIFT : SHIFT + BLOCK : 2], key[SHIFT + 1 : SHIFT + BLOCK : 2]
    full = n // BLOCK
    step = _CHUNK_BLOCKS
    for b0 in range(0, full, step):
        b1 = min(full, b0 + step)
        chunk = words[b0 * BLOCK : b1 * BLOCK]
        out[2 * b0 : 2 * b1] = _nh_blocks(chunk, ke, ko, ke2, ko2)
    if full < nblocks:  # the zero-padded tail block
        tail = torch.zeros(BLOCK, dtype=torch.int32, device=words.device)
        rest = words[full * BLOCK :]
        tail[: rest.numel()] = rest
        out[2 * full :] = _nh_blocks(tail, ke, ko, ke2, ko2)
    return out


def _nh_blocks(chunk, ke, ko, ke2, ko2):
    import torch

    x = chunk.view(torch.int64).view(-1, BLOCK // 2)  # one int64 = (even word, odd word)
    lo = x & _M32
    hi = (x >> 32) & _M32
    a = ((lo + ke) & _M32).mul_((hi + ko) & _M32).sum(1)
    b = ((lo + ke2) & _M32).mul_((hi + ko2) & _M32).sum(1)
    return torch.stack((a, b), 1).view(-1)


def _level1_for(src, level1: Optional[Level1]) -> Optional[Level1]:
    if level1 is not None:
        return level1
    return device_level1(src.device.type) if src.device.type != "cpu" else None


def _words(src):
    """A uint8 tensor as the int32 words the tree hashes (zero-padded to a multiple of 8 bytes)."""
    import torch

    nbytes = src.numel()
    if nbytes and src.data_ptr() % 8:  # the word views below need 8-byte alignment
        src = src.clone()
    if nbytes % 8:
        pad = torch.zeros(8 - nbytes % 8, dtype=torch.uint8, device=src.device)
        src = torch.cat((src, pad))
    return src.view(torch.int32) if src.numel() else torch.zeros(2, dtype=torch.int32, device=src.device)


def _load_level_keys(items) -> None:
    """Put the level keys that ``items`` ([(key, int32 words)]) need, and do not hold yet, on
    the words' devices: one host-to-device copy per device for all of them.  The fused kernel's
    int32 form of each key is recorded alongside (no conversion pass per key)."""
    import torch

    want: dict = {}  # device -> [(key, level)]
    for key, words in items:
        dev = words.device
        for level in range(tree_levels(words.numel())):
            if (level, str(dev)) not in key._tensors:
                want.setdefault(dev, {})[(id(key), level)] = (key, level)
    for dev, slots in want.items():
        slots = list(slots.values())
        if len(slots) == 1:  # nothing to batch
            key, level = slots[0]
            key.level_tensor(level, dev)
            continue
        blob = bytearray(b"".join(key.level_bytes(level) for key, level in slots))
        words32 = torch.frombuffer(blob, dtype=torch.int32).to(dev, non_blocking=True)  # uint32 words as int32
        words64 = words32.to(torch.int64).bitwise_and_(_M32)  # the same words as values < 2**32
        remember = device_key_words32(dev.type) if dev.type != "cpu" else None
        for j, (key, level) in enumerate(slots):
            k64 = words64[j * KEY_WORDS : (j + 1) * KEY_WORDS]
            key._tensors[(level, str(dev))] = k64
            if remember is not None:
                remember(k64, words32[j * KEY_WORDS : (j + 1) * KEY_WORDS])


#: rows hashed together by one upper level at most this many bytes of words (their int64
#: temporaries are a few times that; above it each row is hashed alone)
_ROWS_BYTES = 64 << 20


def _nh_trees(items) -> list:
    """The NH trees of ``items`` ([(int32 words, key, level-0 kernel or None)], keys already on
    the device), left on the device: per item an int64 tensor of the two lanes."""
    import torch

    outs: list = [None] * len(items)
    level_in = []  # (item index, the int32 words of the next level)
    for idx, (words, key, kern) in enumerate(items):
        k = key.level_tensor(0, words.device)
        out = kern(words, k) if kern is not None else nh_level(words, k)
        if words.numel() <= BLOCK:
            outs[idx] = out
        else:
            level_in.append((idx, out.view(torch.int32)))
    level = 1
    while level_in:
        by_device: dict = {}
        for idx, w in level_in:
            by_device.setdefault(str(w.device), []).append((idx, w))
        level_in = []
        for members in by_device.values():
            dev = members[0][1].device
            res = []  # (item index, words in, level output)
            for bucket in _row_buckets(members):
                if len(bucket) == 1:
                    i, w = bucket[0]
                    k = items[i][1].level_tensor(level, dev)
                    kern = items[i][2]
                    res.append((i, w.numel(), kern(w, k) if kern is not None else nh_level(w, k)))
                    continue
                ws = [w for _, w in bucket]
                if all(w.numel() == ws[0].numel() for w in ws):
                    stacked = torch.stack(ws)
                else:  # shorter rows zero-padded: their extra blocks are computed and dropped
                    stacked = torch.nn.utils.rnn.pad_sequence(ws, batch_first=True)
                rows = _nh_rows(stacked, torch.stack([items[i][1].level_tensor(level, dev) for i, _ in bucket]))
                for r, (i, w) in enumerate(bucket):
                    res.append((i, w.numel(), rows[r, : 2 * max(1, -(-w.numel() // BLOCK))]))
            for i, n, out in res:
                if n <= BLOCK:
                    outs[i] = out
                else:
                    level_in.append((i, out.view(torch.int32)))
        level += 1
    return outs


def _row_buckets(members):
    """``members`` ([(index, int32 words)]) in buckets hashed together by :func:`_nh_rows`:
    longest first, each bucket's rows padded to its longest at most ``_ROWS_BYTES`` in all;
    a row too long for that is a bucket of its own."""
    members = sorted(members, key=lambda m: -m[1].numel())
    buckets, cur, longest = [], [], 0
    for m in members:
        n = m[1].numel()
        if 8 * n > _ROWS_BYTES:
            buckets.append([m])
            continue
        if cur and 4 * longest * (len(cur) + 1) > _ROWS_BYTES:
            buckets.append(cur)
            cur = []
        if not cur:
            longest = n
        cur.append(m)
    if cur:
        buckets.append(cur)
    return buckets


def _nh_rows(words, keys):
    """:func:`nh_level` of each row of ``words`` (int32 ``[R, n]``) under the matching row of
    ``keys`` (int64 ``[R, KEY_WORDS]``) → int64 ``[R, 2 * nblocks]``, in one set of ops."""
    import torch

    rows, n = words.shape
    nblocks = max(1, -(-n // BLOCK))
    if n != nblocks * BLOCK:  # the zero-padded last block
        padded = torch.zeros((rows, nblocks * BLOCK), dtype=torch.int32, device=words.device)
        padded[:, :n] = words
        words = padded
    x = words.contiguous().view(torch.int64).view(rows, nblocks, BLOCK // 2)
    lo = x & _M32
    hi = (x >> 32) & _M32
    ke, ko = keys[:, 0:BLOCK:2].unsqueeze(1), keys[:, 1:BLOCK:2].unsqueeze(1)
    ke2, ko2 = keys[:, SHIFT : SHIFT + BLOCK : 2].unsqueeze(1), keys[:, SHIFT + 1 : SHIFT + BLOCK : 2].unsqueeze(1)
    a = ((lo + ke) & _M32).mul_((hi + ko) & _M32).sum(2)
    b = ((lo + ke2) & _M32).mul_((hi + ko2) & _M32).sum(2)
    return torch.stack((a, b), 2).view(rows, -1)


#: ``(torch device type, name) -> object or None``: the attribute ``name`` of the ``checksum``
#: module of the backend of that device type.  Installed by the layer that knows the backends
#: (:mod:`unisleep.registry` installs its own when it is imported, before any digest runs): the
#: backends import this module, so it looks nothing up itself.  None: the torch ops only.
KernelFinder = Callable[[str, str], object]
_finder: Optional[KernelFinder] = None
_BACKEND_ATTRS: dict = {}  # (device type, name) -> what the finder found, or None


def find_kernels_with(finder: Optional[KernelFinder]) -> None:
    """Use ``finder`` to find the backends' fused kernels from now on (None: none; the torch ops
    run on the device); forgets what the previous finder found."""
    global _finder
    _finder = finder
    _BACKEND_ATTRS.clear()


def device_key_words32(device_type: str):
    """The backend's ``remember_key_words32(key64, words32)`` (its level-1 kernel reads a key's
    words as int32; told them up front it skips converting each new key), or None."""
    return _backend_checksum_attr(device_type, "remember_key_words32")


def _backend_checksum_attr(device_type: str, name: str):
    """``name`` from the ``checksum`` module of the backend of ``device_type``, through the
    installed finder (asked once per name), or None."""
    k = (device_type, name)
    if k not in _BACKEND_ATTRS:
        _BACKEND_ATTRS[k] = _finder(device_type, name) if _finder is not None else None
    return _BACKEND_ATTRS[k]


def device_level1(device_type: str) -> Optional[Level1]:
    """The fused level-1 kernel the backend of ``device_type`` ships (``nh_level1`` in its
    ``checksum`` module), or None (then the torch ops above run on the device)."""
    return _backend_checksum_attr(device_type, "nh_level1")


def reference_digest(data: bytes, key: HashKey) -> Digest:
    """The definition in plain Python integers (slow; for tests of the fast paths)."""
    n = len(data)
    buf = data + b"\0" * (-n % 8 if n else 8)
    words = list(struct.unpack(f"<{len(buf) // 4}I", buf))
    level = 0
    while True:
        k = key.level_words(level)
        nblocks = max(1, -(-len(words) // BLOCK))
        padded = words + [0] * (nblocks * BLOCK - len(words))
        out = []
        for blk in range(nblocks):
            m = padded[blk * BLOCK : (blk + 1) * BLOCK]
            for s in (0, SHIFT):
                acc = 0
                for j in range(0, BLOCK, 2):
                    acc += ((m[j] + k[j + s]) & _M32) * ((m[j + 1] + k[j + 1 + s]) & _M32)
                out.append(acc & 0xFFFFFFFFFFFFFFFF)
        if len(words) <= BLOCK:
            return Digest(n, out[0], out[1])
        words = [w for v in out for w in (v & _M32, v >> 32)]
        level += 1


def digest(src, key: HashKey, level1: Optional[Level1] = None, algorithm: Optional[str] = None) -> Digest:
    """The keyed digest of a tensor's bytes (contiguous), computed where the bytes are.

    Bytes in host memory are hashed with GMAC (see the module's notes)
    unless ``algorithm="nh2"``; bytes on a device with the NH tree on that device.  ``level1`` optionally replaces the torch ops of every NH level with
    a fused kernel that returns the same values as :func:`nh_level` (the backend's own is found
    by :func:`device_level1`).  To verify a digest, pass its ``algorithm`` so both sides compute
    the same function."""
    return digest_many([src], [key], level1=level1, algorithm=algorithm)[0]


def digest_many(srcs, keys, level1: Optional[Level1] = None, algorithm: Optional[str] = None) -> list:
    """:func:`digest` of several tensors (each with its own key), with one wait for the device
    at the end instead of one per tensor.

    Batched so that many tensors cost little more than one: the level keys every tensor needs
    reach its device in one copy (:func:`_load_level_keys`, no wait per key); level 0 runs per
    tensor (``level1``, or the device's fused kernel); the small levels above run together
    (:func:`_nh_rows`)."""
    return start_digests(srcs, keys, level1=level1, algorithm=algorithm).result()


class PendingDigests:
    """Digests whose device work is queued (:func:`start_digests`); :meth:`result` waits for it
    and reads them (and gives the temporaries' ``scratch`` back).  Until then the device may
    still be reading the tensors hashed: a caller that frees them first waits for the device
    (e.g. an event recorded after the start)."""

    def __init__(self, out: list, pending: list, lanes, scratch=None):
        self._out, self._pending, self._lanes, self._scratch = out, pending, lanes, scratch

    @property
    def lanes(self):
        """The queued lanes ``[A0, B0, A1, B1, ...]`` of the device digests, on their device
        (None when there are none); reading them waits for the device."""
        return self._lanes

    def result(self) -> list:
        try:
            if self._lanes is not None:
                values = self._lanes.tolist()  # the one wait
                for j, (i, nbytes) in enumerate(self._pending):
                    a, b = values[2 * j] & 0xFFFFFFFFFFFFFFFF, values[2 * j + 1] & 0xFFFFFFFFFFFFFFFF
                    self._out[i] = Digest(nbytes, a, b)
        finally:
            self._lanes = None  # the last temporary, before the scratch goes
            self._close_scratch()
        return self._out

    def _close_scratch(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            scratch.close()


def start_digests(srcs, keys, level1: Optional[Level1] = None, algorithm: Optional[str] = None,
                  scratch=None) -> PendingDigests:
    """:func:`digest_many` without the wait: the device work is queued on the current stream
    and the values are read by ``.result()`` — e.g. after other transfers queued on the device
    meanwhile, which a read of the values would otherwise wait behind.

    ``scratch``: a context manager with a ``close()`` (e.g. a private pool): the hash levels'
    device temporaries are made under it, and ``.result()`` closes it once the values are read
    (so does a failure here).  The level keys, which outlive the call on their
    :class:`HashKey`, are loaded before it."""
    import contextlib

    import torch

    if len(srcs) != len(keys):
        raise ValueError("digest_many needs one key per tensor")
    out: list = [None] * len(srcs)
    pending = []  # (index, nbytes, int32 words, key, level-0 kernel)
    for i, (src, key) in enumerate(zip(srcs, keys)):
        if src.dtype != torch.uint8 or src.dim() != 1:
            src = src.reshape(-1).view(torch.uint8)
        algo = algorithm or (GMAC if src.device.type == "cpu" else NH2)
        if algo == GMAC:
            out[i] = _gmac_digest(src, key)
            continue
        if algo != NH2:
            raise ValueError(f"unknown digest algorithm {algo!r} (known: {', '.join(ALGORITHMS)})")
        pending.append((i, src.numel(), _words(src), key, _level1_for(src, level1)))
    lanes = None
    done = PendingDigests(out, [(i, nbytes) for i, nbytes, *_ in pending], None, scratch)
    try:
        if pending:
            _load_level_keys([(key, words) for _, _, words, key, _ in pending])
            with scratch if scratch is not None else contextlib.nullcontext():
                lanes = torch.cat(_nh_trees([(words, key, kern) for _, _, words, key, kern in pending]))
    except BaseException:
        done._close_scratch()
        raise
    done._lanes = lanes
    return done


def nh_lanes_many(srcs, keys, level1: Optional[Level1] = None):
    """The NH digests of several tensors left where they are, without any wait: an int64 tensor
    ``[A0, B0, A1, B1, ...]`` on the tensors' device (lanes as signed int64; byte lengths are not
    in it).  For code that compares digests on the device (the transfer's bucket trailers)."""
    return start_digests(srcs, keys, level1=level1, algorithm=NH2).lanes


#: a segmented NH level: ``(src, key, table, out)`` — ``src`` int64 (each element one pair of
#: 32-bit words, little-endian), ``key`` the level's int64 key, ``table`` int64 ``[4, nblocks]``
#: (per block: first element in ``src``, elements in it (at most ``BLOCK // 2``; the rest is
#: zero), an AND mask for its last element, and where its two lanes go in ``out``:
#: ``out[2 * dst]``, ``out[2 * dst + 1]``); fills ``out`` in place, queued on the device
SegmentLevel = Callable[[object, object, object, object], None]
#: the first level fused with the copy that fills a range: ``(src, dst, key, table, out, base)``
#: — as :data:`SegmentLevel` over ``dst``, whose elements are read from ``src[first - base]``
#: and written to ``dst[first]`` in the same pass
SegmentCopyLevel = Callable[[object, object, object, object, object, int], None]
_LAYOUTS: dict = {}  # (device, spans) -> _Layout, the few layouts of the buckets in use
_LAYOUTS_KEPT = 8


class _Layout:
    """The NH trees of several byte ranges of one buffer as block tables, one per level: every
    level of every range is one launch of a segmented kernel (``SegmentLevel``).  ``out``
    holds the roots (two lanes per range, in order) first, then each level's lanes.

    A table is made on the buffer's device from one row per range (a few kernel launches and
    one small copy, whatever the number of blocks): the sizes of the tables grow with the bytes
    hashed (a 4 GiB bucket has half a million first-level blocks), and a transfer whose bucket
    memory is made per update makes them again every update."""

    def __init__(self, spans, device):
        self.device = device
        half = BLOCK // 2
        tables, cursor = [], len(spans)  # lane-pair slots of out: the roots come first
        # one row per range of a level: (range index, first element, elements, AND mask of the last one)
        cur = [(i, off // 8, -(-n // 8), (1 << (8 * (n % 8))) - 1 if n % 8 else -1) for i, (off, n) in enumerate(spans)]
        self.first_blocks = []  # per range: its columns of the first level's table
        while cur:
            rows, nxt, col = [], [], 0
            for i, first, npairs, last_mask in cur:
                nb = max(1, -(-npairs // half))
                if not tables:
                    self.first_blocks.append((col, col + nb))
                col += nb
                if nb == 1:
                    dst = i  # a one-block tree: its lanes are the range's root
                else:
                    dst = cursor
                    nxt.append((i, 2 * cursor, 2 * nb, -1))  # its lanes are the next level's words
                    cursor += nb
                rows.append((first, npairs, last_mask, dst, nb))
            tables.append(self._table(rows, col))
            cur = nxt
        self.tables = tables
        self.out_lanes = 2 * cursor
        self.roots = 2 * len(spans)
        self._columns: dict = {}

    def _table(self, rows, nblocks: int):
        """The level table of ``rows`` ((first element, elements, AND mask of the last one, lane
        slot of the first block, blocks) per range): int64 ``[4, nblocks]`` of each block's first
        element, element count, AND mask of its last element and lane slot, range after range."""
        import torch

        dev, half = self.device, BLOCK // 2
        p = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)  # [ranges, 5]
        nb = p[:, 4]
        start = torch.cumsum(nb, 0) - nb  # each range's first column
        rid = torch.repeat_interleave(torch.arange(len(rows), device=dev), nb, output_size=nblocks)
        b = torch.arange(nblocks, dtype=torch.int64, device=dev) - start[rid]  # block number in its range
        first = p[:, 0][rid] + b * half
        count = (p[:, 1][rid] - b * half).clamp_(0, half)
        mask = torch.where(b == nb[rid] - 1, p[:, 2][rid], -1)
        return torch.stack((first, count, mask, p[:, 3][rid] + b))

    def columns(self, ranges: frozenset):
        """The first level's table of ``ranges`` (indices) alone, contiguous (one copy of its
        columns, on the table's device); cached."""
        import torch

        t = self._columns.get(ranges)
        if t is None:
            t0 = self.tables[0]
            t = self._columns[ranges] = torch.cat([t0[:, a:b] for a, b in (self.first_blocks[i] for i in sorted(ranges))], 1)
        return t

    @classmethod
    def of(cls, spans, device) -> "_Layout":
        key = (str(device), spans)
        lay = _LAYOUTS.pop(key, None) or cls(spans, device)
        _LAYOUTS[key] = lay  # most recent last
        while len(_LAYOUTS) > _LAYOUTS_KEPT:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        return lay


def drop_layouts(device=None) -> int:
    """Forget the block tables kept for the bucket layouts in use (on ``device``, or every
    device): they are device memory of the framework's allocator, made again (host work and one
    copy) the next time a layout is hashed.  The transfer calls this when an update that keeps
    no buffers ends.  Returns how many layouts were dropped."""
    keys = [k for k in _LAYOUTS if device is None or k[0] == str(device)]
    for k in keys:
        del _LAYOUTS[k]
    return len(keys)


def layout_bytes(device=None) -> int:
    """Bytes of the block tables kept for bucket layouts (on ``device``, or every device)."""
    n = 0
    for (dev, _), lay in list(_LAYOUTS.items()):
        if device is None or dev == str(device):
            n += sum(t.numel() * t.element_size() for t in lay.tables)
            n += sum(t.numel() * t.element_size() for t in lay._columns.values())
    return n


def segment_level(device_type: str) -> Optional[SegmentLevel]:
    """The backend's segmented NH level kernel (``nh_segments`` in its ``checksum`` module), or None."""
    return _backend_checksum_attr(device_type, "nh_segments")


def segment_copy_level(device_type: str) -> Optional[SegmentCopyLevel]:
    """The backend's first level fused with a copy (``nh_segments_copy``), or None."""
    return _backend_checksum_attr(device_type, "nh_segments_copy")


class BucketLanes:
    """The NH lanes of the byte ranges ``spans`` ([(offset, nbytes)]) of one uint8 buffer, all
    under ``key``, in two steps so that the copy filling the buffer can hash on the way.

    :meth:`fill` copies a tensor into range ``i`` and hashes its bytes in the same pass (one
    read and one write, where a copy then a hash reads them twice); :meth:`lanes` hashes the
    ranges not filled that way, then the levels above, and returns int64 ``[A0, B0, A1, B1,
    ...]`` on the buffer's device without any wait — the same values as :func:`nh_lanes_many`
    of the slices.  One kernel launch per tree level for all the ranges (``level``: a
    :data:`SegmentLevel`, default the backend's), from block tables made once per layout.
    Without such a kernel, or for offsets not on 8 bytes, :meth:`lanes` is
    :func:`nh_lanes_many` and :meth:`fill` declines."""

    #: smaller tensors are copied plainly and hashed with the rest at :meth:`lanes`: a fused
    #: launch costs more host time than a plain copy, which only large tensors hide (the
    #: threshold is measured: docs/benchmarks.md)
    fill_min = 64 << 20

    def __init__(self, buf_u8, spans, key: HashKey, level: Optional[SegmentLevel] = None,
                 copy_level: Optional[SegmentCopyLevel] = None):
        import torch

        self.buf, self.key = buf_u8, key
        self.spans = spans = tuple((int(o), int(n)) for o, n in spans)
        dev = buf_u8.device
        if level is None and dev.type != "cpu":
            level = segment_level(dev.type)
            copy_level = copy_level or segment_copy_level(dev.type)
        ok = (level is not None and spans and not buf_u8.data_ptr() % 8 and not any(o % 8 for o, _ in spans)
              and max(o + n for o, n in spans) <= buf_u8.numel())
        self.level, self.copy_level = (level, copy_level) if ok else (None, None)
        self.layout = _Layout.of(spans, dev) if ok else None
        self.filled: set = set()
        self._out = None
        if ok:
            self._out = torch.empty(self.layout.roots + self.layout.out_lanes, dtype=torch.int64, device=dev)
            self._whole = buf_u8[: buf_u8.numel() // 8 * 8].view(torch.int64)

    def fill(self, i: int, src) -> bool:
        """Copy ``src`` (a tensor of exactly range ``i``'s bytes) into range ``i`` and hash it
        on the way; False (nothing done) when that cannot be fused: the caller copies."""
        import torch

        o, n = self.spans[i]
        if (self.copy_level is None or i in self.filled or n < self.fill_min or src.device != self.buf.device
                or not src.is_contiguous() or src.numel() * src.element_size() != n or n % 8 or src.data_ptr() % 8):
            return False
        flat = src.reshape(-1).view(torch.uint8).view(torch.int64)
        table = self.layout.columns(frozenset((i,)))
        self.copy_level(flat, self._whole, self.key.level_tensor(0, self.buf.device), table, self._out, o // 8)
        self.filled.add(i)
        return True

    def lanes(self):
        if self.level is None:
            return nh_lanes_many([self.buf[o: o + n] for o, n in self.spans], [self.key] * len(self.spans))
        dev, lay, out = self.buf.device, self.layout, self._out
        if not self.filled:
            self.level(self._whole, self.key.level_tensor(0, dev), lay.tables[0], out)
        elif len(self.filled) < len(self.spans):
            rest = frozenset(range(len(self.spans))) - frozenset(self.filled)
            self.level(self._whole, self.key.level_tensor(0, dev), lay.columns(rest), out)
        for lv, table in enumerate(lay.tables[1:], 1):
            self.level(out, self.key.level_tensor(lv, dev), table, out)
        return out[: lay.roots]


def bucket_lanes(buf_u8, spans, key: HashKey, level: Optional[SegmentLevel] = None):
    """The NH lanes of the byte ranges ``spans`` of one buffer (see :class:`BucketLanes`)."""
    return BucketLanes(buf_u8, spans, key, level).lanes()


def nh_segments_copy_reference(src, dst, key, table, out, base: int) -> None:
    """:data:`SegmentCopyLevel` in torch ops (for tests)."""
    first, count = table[0], table[1]
    for f, c in zip(first.tolist(), count.tolist()):
        dst[f: f + c] = src[f - base: f - base + c]
    nh_segments_reference(dst, key, table, out)


def nh_segments_reference(src, key, table, out) -> None:
    """:data:`SegmentLevel` in torch ops (gathers every block: for tests and small inputs)."""
    import torch

    half = BLOCK // 2
    first, count, mask, dst = table.unbind(0)
    j = torch.arange(half, device=src.device)
    idx = first[:, None] + j[None, :]
    live = j[None, :] < count[:, None]
    x = torch.where(live, src[idx.clamp(0, max(0, src.numel() - 1))] if src.numel() else 0, 0)
    x = torch.where(j[None, :] == count[:, None] - 1, x & mask[:, None], x)
    lo, hi = x & _M32, (x >> 32) & _M32
    ke, ko = key[0:BLOCK:2], key[1:BLOCK:2]
    ke2, ko2 = key[SHIFT: SHIFT + BLOCK: 2], key[SHIFT + 1: SHIFT + BLOCK: 2]
    a = ((lo + ke) & _M32).mul_((hi + ko) & _M32).sum(1)
    b = ((lo + ke2) & _M32).mul_((hi + ko2) & _M32).sum(1)
    out[2 * dst] = a
    out[2 * dst + 1] = b


_GMAC_PIECE = 1 << 30  # bytes per call into OpenSSL (one call takes at most 2**31 - 1)
_NONCE = bytes(12)
#: ranges up to this size are hashed in one call (which holds the interpreter lock for it); larger
#: ones through a streaming context, whose fixed cost (tens of microseconds) they hide
_GMAC_ONE_CALL = 1 << 20


def _gmac_key(key: HashKey) -> bytes:
    k = key._tensors.get("gmac")
    if k is None:
        k = key._tensors["gmac"] = hashlib.sha256(b"unisleep keyed hash gmac v1\0" + key.material).digest()
    return k


def _gmac_digest(src, key: HashKey) -> Digest:
    import ctypes

    n = src.numel()
    if src.device.type != "cpu":
        src = src.cpu()
    if n and not src.is_contiguous():
        src = src.contiguous()
    mv = memoryview((ctypes.c_char * n).from_address(src.data_ptr())).cast("B") if n else b""
    return _gmac_of(mv, key)


def _gmac_of(mv, key: HashKey) -> Digest:
    """The GMAC digest of the bytes of ``mv`` (a flat byte buffer).  Up to :data:`_GMAC_ONE_CALL`
    bytes take one call into OpenSSL through an AES-GCM object kept with the key (a couple of
    microseconds: what makes thousands of small tensors cheap); more go through a streaming
    context, :data:`_GMAC_PIECE` bytes per call.  Both give the tag of AES-256-GCM with no
    plaintext and the bytes as associated data."""
    n = len(mv)
    if n <= _GMAC_ONE_CALL:
        tag = _gmac_aead(key).encrypt(_NONCE, b"", mv)
    else:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        enc = Cipher(algorithms.AES(_gmac_key(key)), modes.GCM(_NONCE)).encryptor()
        for off in range(0, n, _GMAC_PIECE):  # OpenSSL works without the GIL: other threads go on
            enc.authenticate_additional_data(mv[off: off + _GMAC_PIECE])
        enc.finalize()
        tag = enc.tag
    a, b = struct.unpack("<QQ", tag)
    return Digest(n, a, b, GMAC)


def _gmac_aead(key: HashKey):
    """The key's AES-GCM object (made once per key, kept with it)."""
    a = key._tensors.get("gmac-aead")
    if a is None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:  # a core dependency; say how to get it
            raise ImportError("unisleep needs the 'cryptography' package to hash host memory: "
                              "pip install 'cryptography>=42'") from e
        a = key._tensors["gmac-aead"] = AESGCM(_gmac_key(key))
    return a


def gmac_spans(buf_u8, spans, key: HashKey) -> list:
    """The GMAC :class:`Digest` of each byte range ``(offset, nbytes)`` of one contiguous uint8
    tensor in host memory, all under ``key`` — the same values as :func:`digest` of each slice,
    without a tensor per range (one buffer view, one call into OpenSSL per range)."""
    import ctypes

    if buf_u8.device.type != "cpu" or not buf_u8.is_contiguous() or buf_u8.element_size() != 1:
        raise ValueError("gmac_spans needs a contiguous uint8 tensor in host memory")
    n = buf_u8.numel()
    whole = memoryview((ctypes.c_char * n).from_address(buf_u8.data_ptr())).cast("B") if n else memoryview(b"")
    out = []
    for off, nb in spans:
        if off < 0 or nb < 0 or off + nb > n:
            raise ValueError(f"range ({off}, {nb}) is outside a buffer of {n} bytes")
        out.append(_gmac_of(whole[off: off + nb], key))
    return out


def digest_bytes(data: bytes, key: HashKey, algorithm: str = NH2) -> Digest:
    """The digest of a ``bytes`` object (host); NH by default, the definition's arithmetic."""
    import torch

    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return digest(t, key, algorithm=algorithm)
