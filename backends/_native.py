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
