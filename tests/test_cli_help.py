"""What the command line shows: every option with its help, plain text, and skip reasons that
name what is missing first (on a machine without a GPU: the GPU)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from refusals import ROOT, env, unisleep

pytestmark = pytest.mark.slow  # every test here starts processes


def _no_device(name: str) -> bool:
    from unisleep.platform import detect_platform

    try:
        return not detect_platform(name).devices
    except Exception:
        return True


# ------------------------------------------------------------------------- help
def _options_without_help(text: str) -> list[str]:
    """Options of an argparse help whose entry has no description."""
    lines = text.split("options:", 1)[1].splitlines()[1:]
    bare = []
    for i, ln in enumerate(lines):
        m = re.match(r"^  (-[-\w]+(?:[ ,=][^ ]+)*?)(\s{2,}\S.*)?$", ln)
        if not m or m.group(2):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^\s{6,}\S", nxt):
            bare.append(m.group(1))
    return bare


@pytest.mark.parametrize("args", [["doctor"], ["demo"], ["bench"], ["bench", "--backend", "cuda"],
                                  ["bench", "--progressive"], ["bench", "--transfer"], ["bench", "--chunk-sweep"],
                                  ["bench", "--compat-tms"], ["bench", "--devices", "all"]], ids=" ".join)
def test_every_option_has_help(args):
    r, _ = unisleep(*args, "--help")
    assert r.returncode == 0, r.stderr
    assert _options_without_help(r.stdout) == [], r.stdout
    usage = r.stdout.split("\n\n", 1)[0] if args[-1] != "bench" else r.stdout
    if "--backend" in args:  # before: "unisleep bench --backend NAME [-h] --backend BACKEND"
        assert usage.count("--backend") == 1, usage


def test_compat_help_is_plain_text():
    r = subprocess.run([sys.executable, "-m", "unisleep.compat", "--help"], capture_output=True, text=True, env=env(),
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "python -m unisleep.compat" in r.stdout
    assert "``" not in r.stdout and ":mod:" not in r.stdout, r.stdout


# ------------------------------------------------------------------------- skips on a machine without a GPU
def test_gpu_tests_skip_saying_the_gpu_first():
    """Before: tests/cuda/test_ipc.py said "needs cuda-bindings (pip install ...)" and
    tests/cuda/test_vllm_contract.py "run tools/vllm_contract/fetch.py" — neither helps without a GPU."""
    if not _no_device("cuda"):
        pytest.skip("this machine has a CUDA device")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/cuda"],
                       capture_output=True, text=True, cwd=ROOT, env=env(), timeout=300)
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:\s]+(?::\d+)?: (.*)$", r.stdout, re.MULTILINE)
    assert reasons, r.stdout[-3000:]
    assert "failed" not in r.stdout.splitlines()[-1], r.stdout[-3000:]
    wrong = [x for x in reasons if "GPU" not in re.split(r"[;(]", x, maxsplit=1)[0]]
    assert not wrong, wrong
