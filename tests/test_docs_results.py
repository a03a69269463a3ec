"""docs/results/ holds only raw results a page of the documentation cites: every file there is
named by README.md or a page under docs/ (by its name, or by a ``results/...`` reference with
``{a,b}`` alternatives or ``*`` wildcards), and every such reference names a file that exists."""

from __future__ import annotations

import fnmatch
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
REFERENCE = re.compile(r"results/([A-Za-z0-9_.,{}*?-]+)")


def pages() -> dict[str, str]:
    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                              recursive=True))
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in paths}


def expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (nested and repeated alternatives too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def citations(files: set[str], docs: dict[str, str]) -> tuple[set[str], list[tuple[str, str]]]:
    """(the files cited, the references that name no file)."""
    cited = {f for f in files if any(f in text for text in docs.values())}
    dangling = []
    for page, text in docs.items():
        for m in REFERENCE.finditer(text):
            for pattern in expand(m.group(1).rstrip(".,")):
                hits = fnmatch.filter(files, pattern)
                if not hits:
                    dangling.append((page, pattern))
                cited.update(hits)
    return cited, dangling


def test_the_check_can_fail():
    docs = {"docs/a.md": "raw: `docs/results/run-{1,2}.json`, `results/probe-*.txt` and plain.log; "
                         "`results/gone.json`"}
    files = {"run-1.json", "run-2.json", "probe-a.txt", "plain.log", "orphan.log"}
    cited, dangling = citations(files, docs)
    assert files - cited == {"orphan.log"}
    assert dangling == [("docs/a.md", "gone.json")]


def test_every_raw_result_is_cited_by_a_page():
    files = {f for f in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, f))}
    cited, _ = citations(files, pages())
    orphans = sorted(files - cited)
    assert not orphans, (f"{len(orphans)} file(s) in docs/results are cited by no page of the docs (cite each where "
                         f"its figure is given, or remove it: git history keeps it): {orphans}")


def test_every_citation_names_a_raw_result():
    files = {f for f in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, f))}
    _, dangling = citations(files, pages())
    assert not dangling, f"pages cite results that docs/results does not hold: {dangling}"
