"""Byte sizes for people: ``human_bytes(3 << 20) == "3.0 MiB"``."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number >= 1 (e.g. "512 B",
    "4.0 MiB", "1.50 GiB")."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.2f} {unit}" if n < 10 else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover
