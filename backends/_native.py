"""Loading a vendor's native library through ctypes, shared by the ctypes-based drivers."""

from __future__ import annotations

import ctypes
import os

from unisleep.errors import PlatformError


def load_first(candidates: list[str], missing: str):
    """``ctypes.CDLL`` of the first candidate that loads (paths that do not exist are skipped);
    otherwise a :class:`PlatformError` with ``missing`` (what to install or set) and what was tried."""
    errors = []
    for cand in candidates:
        if os.path.sep in cand and not os.path.exists(cand):
            continue
        try:
            return ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{cand}: {e}")
    raise PlatformError(f"{missing} Tried: " + "; ".join(errors or candidates))


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

