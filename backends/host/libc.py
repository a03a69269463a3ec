"""The few libc calls Python's ``mmap`` module cannot make (fixed addresses, PROT_NONE
reservations).  Linux only."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE = 0x01, 0x02
MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE, MAP_POPULATE = 0x10, 0x20, 0x4000, 0x8000
MAP_FAILED = ctypes.c_void_p(-1).value

try:  # glibc's name first: ctypes.util.find_library runs ldconfig (a process) on every first import
    _libc = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # another libc (e.g. musl)
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _check(ret, what):
    if ret == MAP_FAILED or ret is None or (isinstance(ret, int) and ret == -1):
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    return _check(_libc.mmap(addr or None, size, prot, flags, fd, offset), "mmap")


def munmap(addr: int, size: int) -> None:
    _check(_libc.munmap(addr, size), "munmap")

