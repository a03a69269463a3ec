"""Every module of the library is small enough to read in one sitting: at most MAX_LINES lines
under unisleep/ and backends/ (the aim is ~500 with one concern each; the bound leaves room for a
module that is one concern but long).  A module over it is split along its seams, its names kept
importable from where they were."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 600


def oversized(root: str, limit: int = MAX_LINES) -> dict[str, int]:
    """{path relative to ``root``: line count} of the .py files under unisleep/ and backends/ longer than ``limit``."""
    out = {}
    for top in ("unisleep", "backends"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    if n > limit:
                        out[os.path.relpath(p, root)] = n
    return out


def test_the_size_check_can_fail(tmp_path):
    (tmp_path / "unisleep").mkdir()
    (tmp_path / "unisleep" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "unisleep" / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert oversized(str(tmp_path)) == {os.path.join("unisleep", "big.py"): MAX_LINES + 1}


def test_every_module_is_at_most_600_lines():
    big = oversized(ROOT)
    assert not big, f"modules over {MAX_LINES} lines (split them along their seams): {big}"
