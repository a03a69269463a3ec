"""Checksummed reads and writes of spill files (:mod:`.spill_store`): raw memory as a buffer, the
XXH3-64 hasher, and reads that hash each step right after it lands and name a truncated or
unreadable file (:class:`~unisleep.errors.BackupCorruptError`)."""

from __future__ import annotations

import ctypes
import os

from unisleep.errors import BackupCorruptError


def _buffer(ptr: int, n: int):
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if n else memoryview(b"")


def _hasher():
    import xxhash

    return xxhash.xxh3_64()


#: bytes read or written between checksum updates: small enough to still be in cache
_STEP = 4 << 20


#: verification piece of a backup written in one go
PIECE = 256 << 20

def _read_hashed(fd: int, target, offset: int, path: str, total: int) -> int:
    """Read ``target`` from ``offset``, hashing each step right after it lands; the XXH3-64."""
    h, done, n = _hasher(), 0, len(target)
    while done < n:
        end = min(n, done + _STEP)
        _read_exact(fd, target[done:end], offset + done, path, total)
        h.update(target[done:end])
        done = end
    return h.intdigest()


def _read_exact(fd: int, target, offset: int, path: str, total: int) -> None:
    done, n = 0, len(target)
    while done < n:
        try:
            got = os.preadv(fd, [target[done:]], offset + done)
        except OSError as e:
            raise BackupCorruptError(
                f"reading the backup file {path} failed at byte {offset + done}: {e.strerror}",
                path=path, nbytes=total, cause=e,
            ) from e
        if got <= 0:
            raise BackupCorruptError(
                f"the backup file {path} ended after {offset + done} of {total} bytes: it was truncated while asleep",
                path=path, nbytes=total,
            )
        done += got
