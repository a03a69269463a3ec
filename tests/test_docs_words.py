"""The user documentation speaks in versions, dates, hardware and commands — never in the project's
own working process — and every measured figure lives on one page with its date, machine and
command.

* README.md, every page under docs/ and pyproject.toml hold no commit hash given as provenance
  ("main at 1a2b3c4", "(1a2b3c4)", "tree at ..."), no branch, none of the project's process words
  ("the issue", "this evening", "after rebasing", "design card", "no device time was left", ...)
  and no path of the machine the project was built on (its work or home folders, an
  interpreter's path, a scratch file); the raw results under docs/results/ hold no commit hash, branch or machine path either.
* docs/benchmarks.md (the figures page) is checkable: its "Machines" table names each machine; under
  "Results, newest first" every ``### `` section starts with its date (``YYYY-MM-DD``, optionally
  ``HH:MM UTC``), sections come newest first, and each has ``**Machine:**`` (starting with a machine
  of the table), ``**Versions:**`` and ``**Command:**`` (or ``**Commands:**``) lines with a value;
  every row of its "At a glance" table has a date, a known machine and a link to a section that
  exists.
* A timed result (a date with a time of day, or ``HH:MM UTC``) appears on no page but the figures
  page: other pages link to it instead of repeating it.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES_PAGE = "docs/benchmarks.md"
RESULTS = os.path.join(ROOT, "docs", "results")

# ----------------------------------------------------------------------------- process words
#: a hexadecimal token with letters and digits, 7-40 characters, standing alone
_HEX = r"(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_-])"
#: ... given as provenance: after "main at", "tree at", "commit", "branch x at", "git archive", "+",
#: or alone in parentheses / before a comma inside them
HASH_AS_PROVENANCE = re.compile(
    rf"(?:\b(?:main|tree|commit|committed as|rev|revision|sha|head|archive|at)\s+{_HEX}"
    rf"|\+\s*{_HEX}|\(\s*{_HEX}\s*[,)^]|\b{_HEX}\^)", re.IGNORECASE)

#: (pattern, what it is) — words of the project's working process, its tools, its machines
PROCESS_WORDS: list[tuple[str, str]] = [
    (r"\bmain at\b", "a commit of the project's main line as provenance"),
    (r"\btree at\b|\b(?:final|this|today's|the evening's) tree\b|\bthe tree before\b", "the project's working tree as provenance"),
    (r"\bbranch(?:es)?\b", "a branch"),
    (r"\b(?:re)?bas(?:e|ed|ing) on(?:to)? main\b|\brebas(?:e|ed|ing)\b", "rebasing"),
    (r"\buncommitted\b|\bcommitted as\b", "the project's commits"),
    (r"\bthe issue\b|\bthe issue's\b|\bissue \d+\b|\bissue \"|\bperformance issue\b", "the project's own issues"),
    (r"\bnote that is not in this repository\b|\bquoted from a note\b", "the project's notes"),
    (r"\bdesign card\b", "the project's design notes"),
    (r"\bno device time\b|\bdevice time\b|\bdevice tool\b|\bcalls? to the machine\b", "the working tools"),
    (r"\bin this session\b|\bthis session\b|\bthe lead\b|\bhelper session\b", "the working sessions"),
    (r"\btoday(?:'s)?\b|\btonight\b|\byesterday\b|\bthis (?:morning|afternoon|evening)\b"
     r"|\b(?:of|in) the (?:evening|night)\b|\bthe (?:evening|night|morning)'s\b|\bof the day\b|\bthat morning\b",
     "a time relative to when it was written (give the date)"),
    (r"(?<![\w.])/(?:work|root)/|(?<![\w.])/home/\w|/opt/torch\b|(?<![\w.])/(?:usr|opt)/\S*/bin/python|/tmp/hb\b",
     "a path of a working machine"),
]
_PROCESS = [(re.compile(p, re.IGNORECASE), why) for p, why in PROCESS_WORDS]

#: the words that may not appear in raw results either (logs and JSON keep their own English)
RAW_WORDS = [(re.compile(p, re.IGNORECASE), why) for p, why in PROCESS_WORDS
             if why in ("a commit of the project's main line as provenance", "the project's working tree as provenance",
                        "the project's commits", "a path of a working machine")]


def word_problems(text: str, rules=None) -> list[str]:
    """``line N: 'match' (what it is)`` for every process word, hash or machine path in ``text``."""
    rules = _PROCESS if rules is None else rules
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in HASH_AS_PROVENANCE.finditer(line):
            out.append(f"line {n}: {m.group(0)!r} (a commit hash as provenance)")
        for rx, why in rules:
            for m in rx.finditer(line):
                out.append(f"line {n}: {m.group(0)!r} ({why})")
    return out


def user_docs() -> dict[str, str]:
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "pyproject.toml")]
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in paths}


def raw_results() -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, name)
        if os.path.isfile(path) and not name.endswith((".png", ".jpg", ".svg")):
            out[f"docs/results/{name}"] = open(path, encoding="utf-8", errors="replace").read()
    return out


def test_the_word_check_can_fail():
    bad = {
        "main at 0f8507c": "main line",
        "(edfb975, 2026-12-01 04:07)": "hash",
        "the same code as (50062d6)": "hash",
        "git archive 891e728^": "hash",
        "tree at main at ae33df9": "main line",
        "branch h12 at d9d1e78": "branch",
        "After rebasing onto the sleep-path changes": "rebasing",
        "(no device time was left)": "working tools",
        "in one call to the machine": "working tools",
        "what the issue assumed": "issues",
        "goal (issue 13)": "issues",
        'the next step (issue "Performance")': "issues",
        "quoted from a note that is not in this repository": "notes",
        "Later this evening the figure moved": "relative",
        "today's code": "relative",
        "(design card)": "design",
        "--json /tmp/hb.json": "path",
        "/opt/torch/.venv/bin/python3 -m pytest": "path",
        "see /work/notes/brief.md": "path",
    }
    for text, kind in bad.items():
        assert word_problems(text), f"not caught ({kind}): {text!r}"
    fine = [
        "torch 2.11.0+cu130, driver 580.159.04, 2026-12-01",
        "the NH universal-hash tree on a device",
        "vLLM #52479 and ROCm/ROCm#6021; its issue #83",
        "`unisleep doctor --clean` removes /tmp/unisleep-1000 leftovers",
        "a helper thread releases each chunk",
        "sha256 of the wheel: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "at 1,024 tokens; 8388608 bytes; cafebabe",
    ]
    for text in fine:
        assert not word_problems(text), (text, word_problems(text))
    assert word_problems("tree at main at 1f32d0e", RAW_WORDS) and not word_problems("today", RAW_WORDS)


def test_user_docs_speak_in_versions_dates_hardware_and_commands():
    found = {page: p for page, text in user_docs().items() if (p := word_problems(text))}
    assert not found, ("words of the project's working process in user docs (give versions, dates, hardware and "
                       f"commands instead): {found}")


def test_raw_results_name_no_commit_branch_or_machine_path():
    found = {page: p for page, text in raw_results().items() if (p := word_problems(text, RAW_WORDS))}
    assert not found, f"raw results carry commit hashes, branches or machine paths: {found}"


# ----------------------------------------------------------------------------- the figures page
_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
_FIELD = re.compile(r"^- \*\*(Machine|Versions|Commands?):\*\*\s*(.*)$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces made hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _sections(text: str, level: str) -> list[tuple[str, str]]:
    """[(heading, body)] of the ``level`` headings (``"## "``, ``"### "``) of ``text``."""
    parts = re.split(rf"(?m)^{re.escape(level)}(?!#)", text)
    out = []
    for part in parts[1:]:
        head, _, body = part.partition("\n")
        out.append((head.strip(), body))
    return out


def _table_rows(body: str) -> list[list[str]]:
    rows = [ln for ln in body.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    return [r for r in cells[2:]]  # after the header and the |---| line


def figure_problems(text: str) -> list[str]:
    """What makes the figures page uncheckable or incomplete (empty when it is right)."""
    problems: list[str] = []
    top = dict(_sections(text, "## "))
    for need in ("Machines", "At a glance", "Results, newest first"):
        if need not in top:
            problems.append(f"no '## {need}' section")
    if problems:
        return problems
    machines = [r[0] for r in _table_rows(top["Machines"]) if r and r[0]]
    if not machines:
        problems.append("the Machines table names no machine")

    def known(value: str) -> bool:
        return any(value == m or value.startswith(m + " ") for m in machines)

    results = _sections(top["Results, newest first"], "### ")
    if not results:
        problems.append("no result under 'Results, newest first'")
    anchors = {slug(h) for h, _ in results}
    last = None
    for head, body in results:
        m = _DATE.match(head)
        if not m:
            problems.append(f"result {head!r} does not start with its date (YYYY-MM-DD)")
            continue
        if last is not None and m.group(1) > last:
            problems.append(f"result {head!r} is newer than the one before it (newest first)")
        last = m.group(1)
        fields = {}
        for line in body.splitlines():
            f = _FIELD.match(line)
            if f:
                fields["Command" if f.group(1) == "Commands" else f.group(1)] = f.group(2).strip()
        for need in ("Machine", "Versions", "Command"):
            if not fields.get(need):
                problems.append(f"result {head!r} has no **{need}:** line")
        if fields.get("Machine") and not known(fields["Machine"]):
            problems.append(f"result {head!r}: machine {fields['Machine']!r} is not in the Machines table")
    for row in _table_rows(top["At a glance"]):
        if len(row) < 8:
            problems.append(f"'At a glance' row {row} has fewer than 8 columns")
            continue
        what, date, machine, details = row[1], row[5], row[6], row[7]
        if not _DATE.fullmatch(date):
            problems.append(f"'At a glance' row {what!r}: date {date!r} is not YYYY-MM-DD")
        if not known(machine):
            problems.append(f"'At a glance' row {what!r}: machine {machine!r} is not in the Machines table")
        links = re.findall(r"\]\(#([^)]+)\)", details)
        if not links:
            problems.append(f"'At a glance' row {what!r} links to no result")
        for a in links:
            if a not in anchors:
                problems.append(f"'At a glance' row {what!r} links to #{a}, which no result heading makes")
    return problems


_GOOD_PAGE = """# Figures

## Machines

| machine | hardware | driver and system | notes |
|---|---|---|---|
| H200 | one NVIDIA H200 | driver 580.159.04 | |
| CPU VM | 2 cores | Debian 12 | |

## At a glance

| area | figure | goal | result | met | date | machine | details |
|---|---|---|---|---|---|---|---|
| CUDA | steady wake | <= 0.17 s | 0.161 s | yes | 2026-12-01 | H200 | [x](#2026-12-01-0712-utc--h200-sleep-and-wake) |

## Results, newest first

### 2026-12-01 07:12 UTC — H200: sleep and wake

- **Machine:** H200 — one NVIDIA H200, driver 580.159.04
- **Versions:** torch 2.11.0+cu130
- **Command:** `unisleep bench --backend cuda --cycles 3`

### 2026-11-30 — CPU VM: host

- **Machine:** CPU VM — 2 cores
- **Versions:** torch 2.13.0+cpu
- **Commands:** `unisleep bench`
"""


def test_the_figures_check_can_fail():
    assert figure_problems(_GOOD_PAGE) == []
    cases = {
        "no command": _GOOD_PAGE.replace("- **Commands:** `unisleep bench`\n", ""),
        "no versions": _GOOD_PAGE.replace("- **Versions:** torch 2.11.0+cu130\n", ""),
        "empty machine": _GOOD_PAGE.replace("- **Machine:** CPU VM — 2 cores", "- **Machine:**"),
        "unknown machine": _GOOD_PAGE.replace("- **Machine:** CPU VM — 2 cores", "- **Machine:** a laptop"),
        "no date": _GOOD_PAGE.replace("### 2026-11-30 — CPU VM: host", "### CPU VM: host"),
        "oldest first": _GOOD_PAGE.replace("### 2026-11-30 — CPU VM", "### 2026-12-02 — CPU VM"),
        "glance without date": _GOOD_PAGE.replace("| yes | 2026-12-01 | H200 |", "| yes | today | H200 |"),
        "glance, unknown machine": _GOOD_PAGE.replace("| yes | 2026-12-01 | H200 |", "| yes | 2026-12-01 | MI300 |"),
        "glance, dangling link": _GOOD_PAGE.replace("(#2026-12-01-0712-utc--h200-sleep-and-wake)", "(#gone)"),
        "no machines table": _GOOD_PAGE.replace("## Machines", "## Hardware"),
    }
    for what, page in cases.items():
        assert figure_problems(page), f"not caught: {what}"


def test_every_figure_has_its_date_machine_versions_and_command():
    text = open(os.path.join(ROOT, FIGURES_PAGE), encoding="utf-8").read()
    problems = figure_problems(text)
    assert not problems, f"{FIGURES_PAGE}: {problems}"


_TIMED = re.compile(r"\b\d{4}-\d{2}-\d{2}[ T]~?\d{2}:\d{2}\b|\b\d{2}:\d{2}(?:[–-]\d{2}:\d{2})? UTC\b")


def test_timed_results_live_only_on_the_figures_page():
    """A result given with its time of day is a figure: it belongs on the figures page, and
    another page links there instead of repeating it (so no page says "last run at 05:50" while
    another says 07:12)."""
    found = {}
    for page, text in user_docs().items():
        if page == FIGURES_PAGE:
            continue
        hits = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(text.splitlines(), 1) for m in _TIMED.finditer(line)]
        if hits:
            found[page] = hits
    assert not found, f"timed results outside {FIGURES_PAGE} (move them there and link to it): {found}"


def test_readme_and_every_page_point_to_the_figures_page():
    missing = [page for page, text in user_docs().items()
               if page.endswith(".md") and page != FIGURES_PAGE and "benchmarks.md" not in text]
    assert not missing, f"pages without a link to {FIGURES_PAGE}: {missing}"
