"""Every Python example in README.md and docs/ runs as written.

Each fenced ```python block is a complete program: it parses, and every name it uses is imported or
defined in it (checked for every block, on the CPU, in the fast lane). The blocks that can run on a
CPU machine are run, each in a fresh interpreter (slow lane). A block that cannot run here says so
in the page with an HTML comment on the line above it, which a reader sees in the source and this
test honours:

* ``<!-- needs: WHAT -->`` — hardware or a service this machine lacks (``cuda``, ``rocm``, ``npu``,
  ``vllm`` (a vLLM engine), ``sglang``, ``ray`` ...): parsed and checked for undefined names, not run;
* ``<!-- process: NAME.py -->`` — one process of an example in several (the page says to start them
  together): the blocks of a page with this marker are written to their file names and started
  together, and each must exit 0;
* ``<!-- excerpt: PATH -->`` — lines to put into another project's file PATH (not a program of
  its own): neither parsed nor run.
"""

from __future__ import annotations

import builtins
import glob
import os
import re
import subprocess
import sys
import symtable
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*(needs|process|excerpt):\s*(.+?)\s*-->$")
RUN_TIMEOUT_S = 180


def pages() -> dict[str, str]:
    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                              recursive=True))
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in paths}


def python_blocks(text: str) -> list[dict]:
    """[{line, kind, arg, code}] of the ```python blocks of a page; ``kind`` is the marker on the
    line above (None: runs on a CPU)."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = MARKER.match(lines[k].strip()) if k >= 0 else None
            out.append({"line": i + 1, "kind": m.group(1) if m else None, "arg": m.group(2) if m else None,
                        "code": "\n".join(lines[i + 1:j]) + "\n"})
            i = j
        i += 1
    return out


def undefined_names(code: str) -> list[str]:
    """Names a program uses that it neither imports nor defines (nor are builtins)."""
    top = symtable.symtable(code, "<example>", "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace() or s.is_parameter()}
    missing: set[str] = set()

    def walk(table) -> None:
        for s in table.get_symbols():
            if not s.is_referenced():
                continue
            if s.is_assigned() or s.is_imported() or s.is_parameter() or s.is_namespace() or s.is_free() \
                    or s.is_nonlocal():
                continue
            if table.get_type() == "function" and s.is_local():
                continue
            name = s.get_name()
            if name not in bound and not hasattr(builtins, name):
                missing.add(name)
        for child in table.get_children():
            walk(child)

    walk(top)
    return sorted(missing)


def block_problems(blocks_by_page: dict[str, list[dict]]) -> list[str]:
    problems = []
    for page, blocks in blocks_by_page.items():
        for b in blocks:
            where = f"{page}:{b['line']}"
            if b["kind"] == "excerpt":
                continue
            if b["kind"] == "process" and not re.fullmatch(r"[\w-]+\.py", b["arg"]):
                problems.append(f"{where}: 'process:' names a file like trainer.py, not {b['arg']!r}")
            try:
                compile(b["code"], where, "exec")
            except SyntaxError as e:
                problems.append(f"{where}: does not parse: {e.msg} (line {e.lineno} of the block)")
                continue
            missing = undefined_names(b["code"])
            if missing:
                problems.append(f"{where}: uses {', '.join(missing)} without importing or defining it")
    return problems


def all_blocks() -> dict[str, list[dict]]:
    return {page: bl for page, text in pages().items() if (bl := python_blocks(text))}


def test_the_example_check_can_fail():
    page = "\n".join([
        "```python", "import torch", "lc.sleep(1)", "```",                       # lc undefined
        "<!-- needs: cuda -->", "", "```python", "w = lc.empty((n,), torch.bfloat16)", "```",  # torch, lc, n
        "```python", "def f(:", "```",                                            # syntax
        "<!-- excerpt: openrlhf/x.py -->", "```python", '    "key": value,', "```",   # not checked
        "<!-- process: not a file -->", "```python", "print(1)", "```",
        "```python", "import os", "class A:", "    def f(self, x):", "        return os.path.join(x, y)", "```",
        "```python", "from unisleep import MemoryLifecycle", "lc = MemoryLifecycle('host')", "print(lc, len([1]))",
        "```",
    ])
    blocks = python_blocks(page)
    assert [b["kind"] for b in blocks] == [None, "needs", None, "excerpt", "process", None, None]
    problems = block_problems({"p.md": blocks})
    text = "\n".join(problems)
    assert "p.md:1: uses lc " in text
    assert "p.md:7: uses lc, n, torch " in text
    assert "p.md:10: does not parse" in text
    assert "p.md:14" not in text
    assert "p.md:18: 'process:' names a file" in text
    assert "p.md:21: uses y " in text
    assert len(problems) == 5, problems


def test_every_example_parses_and_defines_what_it_uses():
    problems = block_problems(all_blocks())
    assert not problems, "examples that cannot run as written:\n" + "\n".join(problems)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                PYTHONUNBUFFERED="1")


def _run_one(job) -> str | None:
    where, code = job
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "example.py")
        with open(path, "w") as f:
            f.write(code)
        try:
            r = subprocess.run([sys.executable, path], cwd=d, env=_env(), capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"{where}: still running after {RUN_TIMEOUT_S} s"
        if r.returncode != 0:
            return f"{where}: exit {r.returncode}\n{(r.stdout + r.stderr)[-3000:]}"
    return None


@pytest.mark.slow
def test_cpu_examples_run_as_written():
    jobs = [(f"{page}:{b['line']}", b["code"]) for page, bl in all_blocks().items() for b in bl if b["kind"] is None]
    assert jobs, "no example runs on a CPU?"
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(_run_one, jobs) if f]
    assert not failures, "examples that fail as written:\n\n" + "\n\n".join(failures)


@pytest.mark.slow
def test_examples_in_several_processes_run_together():
    groups = {page: [b for b in bl if b["kind"] == "process"] for page, bl in all_blocks().items()}
    groups = {p: g for p, g in groups.items() if g}
    assert groups, "no example in several processes?"
    for page, blocks in groups.items():
        assert len(blocks) >= 2, f"{page}: a 'process:' example needs at least two processes"
        with tempfile.TemporaryDirectory() as d:
            procs = []
            for b in blocks:
                with open(os.path.join(d, b["arg"]), "w") as f:
                    f.write(b["code"])
            for b in blocks:
                procs.append((b, subprocess.Popen([sys.executable, b["arg"]], cwd=d, env=_env(), text=True,
                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
            failures = []
            for b, p in procs:
                try:
                    out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    for _, q in procs:
                        q.kill()
                    out = p.communicate()[0]
                    failures.append(f"{page}:{b['line']} ({b['arg']}): still running after {RUN_TIMEOUT_S} s\n{out[-2000:]}")
                    continue
                if p.returncode != 0:
                    failures.append(f"{page}:{b['line']} ({b['arg']}): exit {p.returncode}\n{out[-3000:]}")
            assert not failures, "\n\n".join(failures)
