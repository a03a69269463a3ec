"""The ``(name, tensor)`` pairs of what callers pass (a module, a mapping or pairs), and lists of
names shortened for error messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence


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
