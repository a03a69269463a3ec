"""Every module of the library is small enough to read in one sitting: at most MAX_LINES lines
under unisleep/ and backends/ (the aim is ~500 with one concern each; the bound leaves room for a
module that is one concern but long).  A module over it is split along its seams, its callers
importing the real names from the new modules (no re-export stubs) — unless it is one mechanism
that splitting would scatter: those are listed in ONE_MECHANISM, each with why, and bounded by
ONE_MECHANISM_MAX_LINES."""

from __future__ import annotations

import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 600
#: modules that are one mechanism, longer than MAX_LINES: why each stays one file
ONE_MECHANISM = {
    os.path.join("unisleep", "transfer", "store.py"): "the group's store: its wire, table, server and clients "
                                                      "are one protocol, read together",
    os.path.join("unisleep", "transfer", "ipc.py"): "the IPC path, both ends: its messages, the sender's socket "
                                                    "and channel, the receiver's loop",
    os.path.join("unisleep", "transfer", "sender.py"): "WeightSender and its update's steps, in order",
    os.path.join("unisleep", "transfer", "receiver.py"): "WeightReceiver, its update's steps in order, and the "
                                                         "buckets of one update (RecvState)",
    os.path.join("unisleep", "transfer", "group.py"): "TransferGroup: its rendezvous, members, records and "
                                                      "liveness",
}
ONE_MECHANISM_MAX_LINES = 1000


def oversized(root: str, limit: int = MAX_LINES, exempt: Optional[dict] = None) -> dict[str, int]:
    """{path relative to ``root``: line count} of the .py files under unisleep/ and backends/ longer than
    ``limit`` (``ONE_MECHANISM_MAX_LINES`` for a path in ``exempt``)."""
    out = {}
    for top in ("unisleep", "backends"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    rel = os.path.relpath(p, root)
                    if n > (ONE_MECHANISM_MAX_LINES if rel in (exempt or {}) else limit):
                        out[rel] = n
    return out


def test_the_size_check_can_fail(tmp_path):
    (tmp_path / "unisleep").mkdir()
    (tmp_path / "unisleep" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "unisleep" / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert oversized(str(tmp_path)) == {os.path.join("unisleep", "big.py"): MAX_LINES + 1}
    one = os.path.join("unisleep", "big.py")
    assert oversized(str(tmp_path), exempt={one: "why"}) == {}
    (tmp_path / "unisleep" / "big.py").write_text("x = 1\n" * (ONE_MECHANISM_MAX_LINES + 1))
    assert oversized(str(tmp_path), exempt={one: "why"}) == {one: ONE_MECHANISM_MAX_LINES + 1}


def test_every_module_is_at_most_600_lines():
    big = oversized(ROOT, exempt=ONE_MECHANISM)
    assert not big, (f"modules over {MAX_LINES} lines ({ONE_MECHANISM_MAX_LINES} for one mechanism; split them "
                     f"along their seams): {big}")
