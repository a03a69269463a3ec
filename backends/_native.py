"""Loading a vendor's native library through ctypes, shared by the ctypes-based drivers.

* :func:`load_runtime` — **the runtime already in the process wins**: a copy of the library
  already mapped (``/proc/self/maps``, e.g. the one torch loaded) is used; otherwise the first
  candidate that loads.  A second, different copy is refused, naming both files.
* :func:`bind_prototypes` — one ctypes function per entry of a binding's prototype table.
* :func:`record_fallback` / :func:`fallback_warnings` — a driver that had to fall back to a
  safer, costlier behaviour (e.g. keeping device memory reserved over a sleep) records it here,
  once per process and reason, so ``unisleep doctor`` (run in the same process) reports it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Iterable, Optional

from unisleep.errors import PlatformError


def load_first(candidates: list[str], missing: str):
    """``ctypes.CDLL`` of the first candidate that loads (paths that do not exist are skipped);
    otherwise a :class:`PlatformError` with ``missing`` (what to install or set) and what was tried."""
    errors = []
    for cand in candidates:
        if os.path.sep in cand and not os.path.exists(cand):
            continue
        try:
            lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{cand}: {e}")
            continue
        return lib
    raise PlatformError(f"{missing} Tried: " + "; ".join(errors or candidates))


def mapped_libraries(stem: str, maps_text: Optional[str] = None) -> list[str]:
    """Real paths of the distinct files named ``stem.so*`` mapped in this process, in the order
    ``/proc/self/maps`` lists them (``maps_text`` replaces the file, for tests)."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return []
    out: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        base = os.path.basename(path)
        if base == stem + ".so" or base.startswith(stem + ".so."):
            real = os.path.realpath(path)
            if real not in out:
                out.append(real)
    return out


def _two(kind: str, first: str, second: str, how: str) -> PlatformError:
    return PlatformError(
        f"two different {kind} runtimes: {first} is already loaded in this process and {second} {how}. "
        f"One process can use only one {kind} runtime: use the one already loaded (unset the override, "
        f"or point it to {first}), or start a fresh process that loads only one of them."
    )


def load_runtime(stem: str, kind: str, candidates: Iterable[str], missing: str, override: Optional[str] = None):
    """The vendor runtime ``stem.so`` for this process, preferring the one already mapped.

    ``override`` is an explicit path the user set (an environment variable): it is used when
    nothing is loaded yet, and refused when it names a different file than the one loaded.
    After loading, a second different copy in the process is refused, naming both."""
    mapped = mapped_libraries(stem)
    if len(mapped) > 1:
        raise _two(kind, mapped[0], mapped[1], "is loaded as well")
    if mapped:
        if override and os.path.exists(override) and os.path.realpath(override) != mapped[0]:
            raise _two(kind, mapped[0], os.path.realpath(override), "was asked for (the override)")
        lib = ctypes.CDLL(mapped[0], mode=ctypes.RTLD_GLOBAL)
        lib.unisleep_path = mapped[0]
        lib.unisleep_chosen = "already loaded in this process"
        return lib
    lib = load_first(([override] if override else []) + list(candidates), missing)
    now = mapped_libraries(stem)
    if len(now) > 1:
        raise _two(kind, now[0], now[1], "was loaded next to it")
    lib.unisleep_path = now[0] if now else lib._name
    lib.unisleep_chosen = "the override" if override and lib._name == override else "found by search"
    return lib


def bind_prototypes(target, lib, prototypes: dict) -> list[str]:
    """Set on ``target`` one ctypes function per ``name -> (restype, argtypes)`` of
    ``prototypes``, re-typed by address from ``lib`` (a ``CDLL`` or a simulated library, so the
    calls are marshalled exactly as against the real one).  Returns the names ``lib`` lacks."""
    missing = []
    for name, (restype, argtypes) in prototypes.items():
        try:
            raw = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        setattr(target, name, ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.cast(raw, ctypes.c_void_p).value))
    return missing


def bind_arguments(name: str, params: list[str], args: tuple, kwargs: dict) -> list:
    """``args`` then ``kwargs`` (by the C parameter names ``params``) as one positional list;
    a missing, repeated or unknown name is a TypeError naming the function."""
    if len(args) > len(params):
        raise TypeError(f"{name}() takes {len(params)} arguments ({', '.join(params)}), got {len(args)}")
    out = list(args)
    for p in params[len(args):]:
        if p not in kwargs:
            raise TypeError(f"{name}() is missing argument {p!r} (parameters: {', '.join(params)})")
        out.append(kwargs.pop(p))
    if kwargs:
        raise TypeError(f"{name}() got unexpected or repeated arguments {sorted(kwargs)} (parameters: {', '.join(params)})")
    return out


def callback_argtypes(argtypes: list) -> list:
    """A prototype's argument types as a simulated library's ``CFUNCTYPE`` callback receives
    them: every pointer (``POINTER(x)``, ``c_void_p``, ``c_char_p``) arrives as a raw address."""
    out = []
    for t in argtypes:
        is_ptr = t in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(t, type) and issubclass(t, ctypes._Pointer))
        out.append(ctypes.c_void_p if is_ptr else t)
    return out


_FALLBACKS: list[str] = []
_FALLBACK_LOCK = threading.Lock()


def record_fallback(message: str) -> None:
    """Remember, once per process, that a driver fell back to a safer, costlier behaviour."""
    with _FALLBACK_LOCK:
        if message not in _FALLBACKS:
            _FALLBACKS.append(message)


def fallback_warnings() -> list[str]:
    """What :func:`record_fallback` recorded in this process (shown by ``unisleep doctor``)."""
    with _FALLBACK_LOCK:
        return list(_FALLBACKS)


class Reservations:
    """The address ranges a driver holds reserved (``va -> size``), so that a copy can tell
    device memory of this driver from host memory by address alone (a backup store's
    ``load_range`` into a device chunk or into a host tensor).  Thread-safe."""

    def __init__(self):
        self._ranges: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, va: int, size: int) -> None:
        with self._lock:
            self._ranges[va] = size

    def remove(self, va: int) -> None:
        with self._lock:
            self._ranges.pop(va, None)

    def covers(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` lies inside one reserved range."""
        with self._lock:
            return any(va <= ptr and ptr + max(nbytes, 1) <= va + size for va, size in self._ranges.items())
