"""The NH tree of :mod:`unisleep.keyed_hash` on tensors: one level in torch ops
(:func:`nh_level`), the trees of several tensors with their small upper levels batched
(:func:`_nh_trees`), the level keys loaded onto a device in one copy, the backend's fused
kernels found by name, and the definition in plain Python integers (:func:`reference_digest`)."""

from __future__ import annotations

import struct
from typing import Callable, Optional

from .hash_key import _CHUNK_BLOCKS, _M32, BLOCK, KEY_WORDS, SHIFT, Digest, HashKey, tree_levels

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


_BACKEND_ATTRS: dict = {}  # (device type, name) -> what the backend's checksum module has, or None


def device_key_words32(device_type: str):
    """The backend's ``remember_key_words32(key64, words32)`` (its level-1 kernel reads a key's
    words as int32; told them up front it skips converting each new key), or None."""
    return _backend_checksum_attr(device_type, "remember_key_words32")


def _backend_checksum_attr(device_type: str, name: str):
    """``name`` from the ``checksum`` module of the backend of ``device_type`` (the first
    backend with that torch device that ships one; looked up once), or None."""
    k = (device_type, name)
    if k not in _BACKEND_ATTRS:
        from .registry import backends

        found = None
        for b in backends():
            if b.torch_device == device_type and b.is_accelerator and b.checksum:
                try:
                    found = getattr(b.load(b.checksum), name, None)
                except ImportError:
                    found = None
                break
        _BACKEND_ATTRS[k] = found
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
