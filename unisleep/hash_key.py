"""The key and the value of the keyed digest (:mod:`unisleep.keyed_hash`): the NH tree's
constants, :class:`HashKey` (random or derived key material, one NH key per tree level, cached
on each device it is used on), :class:`Digest` (algorithm, byte length, two 64-bit lanes) and
how many levels a tree of a given size has."""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass, field
from typing import Optional

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
    def derive(cls, secret: bytes, context: bytes) -> "HashKey":
        """A key derived from a shared ``secret`` and a ``context`` (e.g. group, epoch and update
        number), the same on every peer: SHAKE-256 over a domain tag, the length-prefixed secret
        and the context (a fraction of a millisecond, so it can be done per update)."""
        if not secret:
            raise ValueError("derive() needs a non-empty secret")
        material = b"unisleep keyed hash v1\0" + struct.pack("<I", len(secret)) + secret + context
        return cls(hashlib.shake_256(material).digest(MAX_LEVELS * KEY_WORDS * 4))

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


def tree_levels_of_bytes(nbytes: int) -> int:
    """How many NH levels the tree of ``nbytes`` bytes has (its words padded as :func:`_words` does)."""
    return tree_levels(max(2, -(-nbytes // 8) * 2))
