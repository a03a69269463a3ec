"""Every broad ``except`` (``Exception``, ``BaseException`` or bare) in unisleep/ and backends/
either ends in ``raise`` (a clean-up that handles nothing: the error goes on) or says, in a
comment on its ``except`` line or as its first line, why nothing narrower will do
(docs/architecture.md, "Rules a change keeps")."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROAD = {"Exception", "BaseException"}


def uncommented(path: str, text: str) -> list[str]:
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text, path)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        t = node.type
        names = {"<bare>"} if t is None else {getattr(e, "id", "") for e in (t.elts if isinstance(t, ast.Tuple) else [t])}
        if not names & (BROAD | {"<bare>"}):
            continue
        if isinstance(node.body[-1], ast.Raise):
            continue
        first = node.body[0].lineno
        said = "#" in lines[node.lineno - 1] or any(
            lines[i].strip().startswith("#") for i in range(node.lineno, first))
        if not said:
            out.append(f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def project_files():
    for top in ("unisleep", "backends"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__" and not os.path.islink(os.path.join(d, x))]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(d, f)


def test_the_check_can_fail():
    text = (
        "try:\n    f()\nexcept Exception:\n    pass\n"  # swallowed, no reason: found
        "try:\n    f()\nexcept Exception:  # the reason\n    pass\n"
        "try:\n    f()\nexcept BaseException:\n    # the reason, on its own line\n    pass\n"
        "try:\n    f()\nexcept BaseException:\n    undo()\n    raise\n"  # a clean-up: the error goes on
        "try:\n    f()\nexcept:\n    pass\n"  # bare: found
        "try:\n    f()\nexcept (OSError, Exception) as e:\n    log(e)\n"  # broad inside a tuple: found
        "try:\n    f()\nexcept OSError:\n    pass\n"  # narrow: fine
    )
    assert [x.split(":")[1] for x in uncommented("m.py", text)] == ["3", "21", "25"]


def test_every_broad_except_says_why():
    found = [x for p in project_files() for x in uncommented(os.path.relpath(p, ROOT), open(p, encoding="utf-8").read())]
    assert not found, ("broad excepts that neither re-raise nor say why (narrow them, or comment why nothing "
                       "narrower will do):\n" + "\n".join(found))
