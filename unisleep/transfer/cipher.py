"""AES-256-GCM for buckets that cross a network (the collective path over gloo, between
machines): every bucket is encrypted and authenticated under a key of its update, so whoever
holds a connection of the data channel, or reads the wire, gets neither the weights nor a way to
change them unseen.

* the key of update ``seq`` in epoch ``epoch``: HMAC-SHA256 of ``group/epoch/seq`` under a sub-key
  of the group secret (every update has its own key; the secret never leaves the members);
* the nonce of bucket ``k``: ``k`` (96 bits) — unique under the update's key, so a (key, nonce)
  pair is never used twice;
* the associated data: the group, epoch, update, bucket index and length, so a bucket cannot be
  replayed into another place;
* a bucket travels in pieces of :data:`PIECE` bytes, each encrypted in place (OpenSSL through the
  ``cryptography`` package) just before it is sent and decrypted as soon as it arrived, while the
  next piece is on the wire; the 16-byte tag follows the last piece.  A receiver applies nothing of
  a bucket whose tag fails (it names the bucket's tensors as corrupt).

A buffer handed to :meth:`Crypt.piece` needs :data:`SLACK` bytes after its data (OpenSSL's output
buffer must be one block larger than the data; the slack is never written).
"""

from __future__ import annotations

import hashlib
import hmac

NAME = "aes-256-gcm"
#: bytes per piece: a bucket's pieces overlap their encryption with the transfer of the previous one
PIECE = 16 << 20
TAG = 16
#: spare bytes a buffer needs after a bucket's data
SLACK = 16


def _cipher():
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError as e:  # a core dependency; say how to get it
        raise ImportError("unisleep needs the 'cryptography' package to encrypt buckets between machines: "
                          "pip install 'cryptography>=42'") from e
    return Cipher, algorithms, modes


class Crypt:
    """One bucket's encryption or decryption, piece by piece, in place."""

    def __init__(self, ctx, decrypt: bool):
        self._ctx, self._decrypt = ctx, decrypt

    def piece(self, mv, off: int, end: int) -> None:
        """Encrypt (decrypt) ``mv[off:end]`` in place; ``mv`` has :data:`SLACK` bytes after ``end``."""
        if end > off:
            self._ctx.update_into(mv[off:end], mv[off: end + SLACK - 1])

    def into(self, src, mv, off: int) -> None:
        """Encrypt all of ``src`` (a memoryview of bytes elsewhere) into ``mv[off:]``, in stream
        order after what was encrypted before (``mv`` has :data:`SLACK` bytes after the end)."""
        n = len(src)
        if n:
            self._ctx.update_into(src, mv[off: off + n + SLACK - 1])

    def tag(self) -> bytes:
        """Encryption: the tag, once every piece is done."""
        self._ctx.finalize()
        return self._ctx.tag

    def check(self, tag: bytes) -> bool:
        """Decryption: whether the bucket is authentic (every piece done); False means that what was
        decrypted must not be used."""
        from cryptography.exceptions import InvalidTag

        try:
            self._ctx.finalize_with_tag(bytes(tag))
            return True
        except InvalidTag:
            return False


class BucketCipher:
    """The keys of one update (group, epoch, update number)."""

    def __init__(self, subkey: bytes, group_id: str, epoch: int, seq: int):
        self._ctx = f"{group_id}/{epoch}/{seq}"
        self._key = hmac.new(subkey, self._ctx.encode(), hashlib.sha256).digest()

    def _new(self, k: int, nbytes: int, decrypt: bool) -> Crypt:
        Cipher, algorithms, modes = _cipher()
        c = Cipher(algorithms.AES(self._key), modes.GCM(k.to_bytes(12, "little")))
        ctx = c.decryptor() if decrypt else c.encryptor()
        ctx.authenticate_additional_data(f"{self._ctx}/{k}/{nbytes}".encode())
        return Crypt(ctx, decrypt)

    def encryptor(self, k: int, nbytes: int) -> Crypt:
        return self._new(k, nbytes, False)

    def decryptor(self, k: int, nbytes: int) -> Crypt:
        return self._new(k, nbytes, True)

    @classmethod
    def of(cls, group, seq: int, epoch: int) -> "BucketCipher":
        return cls(group.subkey("bucket cipher"), group.group_id, epoch, seq)


def pieces(nbytes: int):
    """(start, end) of each piece of a bucket of ``nbytes``."""
    return [(off, min(nbytes, off + PIECE)) for off in range(0, nbytes, PIECE)]


def writable_view(t):
    """A writable memoryview of a contiguous uint8 CPU tensor (no copy)."""
    return memoryview(t.numpy())


__all__ = ["NAME", "PIECE", "SLACK", "BucketCipher", "Crypt", "pieces", "writable_view"]
