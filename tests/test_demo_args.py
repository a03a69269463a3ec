"""``unisleep demo`` as a newcomer meets it, every run a real ``python -m unisleep demo`` process:
wrong options are refused before anything starts, a trainer that fails or dies is reported at once
with its own error, a run that cannot learn fails, no warning is printed, and the steps are
numbered the same way in the progress line, the table and ``demo.json``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from unisleep.platform import detect_platform

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "PYTHONWARNINGS")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unisleep", "demo", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=timeout)


def _absent_accelerators() -> list[str]:
    """Accelerator platforms with no device on this machine (refused by --device)."""
    out = []
    for name in ("cuda", "rocm", "ascend"):
        try:
            if not detect_platform(name).devices:
                out.append(name)
        except Exception:
            out.append(name)
    return out


BAD = [
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--target", "99999"], "--target must be a token of the embedded model's vocabulary, 0..31"),
    (["--target", "-1"], "--target must be a token"),
    (["--max-tokens", "0"], "--max-tokens must be in 1..28"),
    (["--max-tokens", "40"], "--max-tokens must be in 1..28"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--timeout", "0"], "--timeout must be a positive number"),
] + [(["--device", name], f"--device {name}: no {name} device was found") for name in _absent_accelerators()]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_is_refused_before_anything_starts(tmp_path, args, message):
    from refusals import assert_refused, refused

    out = tmp_path / "out"
    r, cpu = refused("demo", "--out", str(out), *args)
    assert_refused(r, cpu, "unisleep demo", message)  # exit 2 at once (before torch is imported), the reason
    assert r.stderr.startswith("unisleep demo: ")
    assert not out.exists()  # no folder, no process, no server


# ------------------------------------------------------------------------- the trainer fails or dies
TRAINER_FAILS = textwrap.dedent("""
    import sys, time
    from unisleep.demo import build_parser
    from unisleep.demo.embedded import run_torch
    if __name__ == "__main__":
        args = build_parser().parse_args(["--out", sys.argv[1], "-q", "--no-plot", "--timeout", "120"])
        args.steps, args.lr = 3, -1.0  # past the option checks: the trainer's own optimizer refuses it
        t = time.monotonic()
        rc = run_torch(args)
        print(f"elapsed {time.monotonic() - t:.1f} rc {rc}")
""")


def test_a_failing_trainer_is_reported_with_its_own_error(tmp_path):
    """Before: the engine side waited for the rendezvous (2 x --timeout) and blamed the store.
    Now the trainer's own error is shown as soon as it happens."""
    script = tmp_path / "fails.py"
    script.write_text(TRAINER_FAILS)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=ROOT, env=_env(), timeout=300)
    elapsed = float(re.search(r"elapsed (\S+) rc 1", r.stdout).group(1))
    assert elapsed < 60, r.stdout  # --timeout is 120: nothing waited for it
    res = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert not res["ok"] and "Invalid learning rate: -1.0" in res["failure"], res["failure"]
    assert "[FAIL] loop ran: EngineError: the trainer process failed: ValueError: Invalid learning rate" in r.stdout
    assert "rendezvous" not in res["failure"] and "Traceback" not in r.stderr
    assert "demo: FAILED" in r.stdout


def test_a_killed_trainer_stops_the_demo_at_once(tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-u", "-m", "unisleep", "demo", "--out", str(out), "--no-plot",
                          "--steps", "500", "--batch", "8", "--timeout", "120"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    pid, seen = None, []
    try:
        for line in p.stdout:
            seen.append(line)
            m = re.search(r"trainer pid=(\d+)", line)
            if m:
                pid = int(m.group(1))
            if line.startswith("step 2/"):
                break
        assert pid is not None, "".join(seen)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest, err = p.communicate(timeout=200)
        after = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, err
    assert after < 30, after  # --timeout is 120: the death was noticed, not waited out
    assert f"the trainer process {pid} died (exit code -9)" in rest
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]


# ------------------------------------------------------------------------- learning, warnings, numbering
def test_a_run_that_cannot_learn_fails(tmp_path):
    out = tmp_path / "out"
    r = demo("--out", str(out), "--no-plot", "-q", "--steps", "8", "--batch", "32", "--lr", "1e-7")
    res = json.loads((out / "demo.json").read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert r.returncode == 1 and not res["ok"] and "demo: FAILED" in r.stdout
    assert checks["policy learned"]["ok"] is False and "[FAIL] policy learned" in r.stdout
    assert checks["weights arrived"]["ok"] and checks["memory freed"]["ok"]  # only the learning failed


def test_too_few_steps_to_tell_is_a_skip_not_a_pass(tmp_path):
    out = tmp_path / "out"
    r = demo("--out", str(out), "--no-plot", "-q", "--steps", "2", "--batch", "16")
    res = json.loads((out / "demo.json").read_text())
    learned = next(c for c in res["checks"] if c["name"] == "policy learned")
    assert learned["ok"] is None and "[SKIP] policy learned" in r.stdout
    assert r.returncode == 0 and res["ok"], r.stdout


def test_healthy_run_prints_no_warning_and_numbers_steps_alike(tmp_path):
    out = tmp_path / "out"
    r = demo("--out", str(out), "--no-plot", "--steps", "5", "--batch", "32", "--lr", "0.01")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "UserWarning" not in r.stderr and "Warning:" not in r.stderr, r.stderr
    progress = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/5 ", r.stdout, re.MULTILINE)]
    table = [int(m.group(1)) for m in re.finditer(r"^\s+(\d+)\s+(\d+)\s+2\s", r.stdout, re.MULTILINE)]
    res = json.loads((out / "demo.json").read_text())
    assert progress == table == [s["step"] for s in res["steps"]] == [1, 2, 3, 4, 5], r.stdout
    assert [s["version"] for s in res["steps"]] == ["1", "2", "3", "4", "5"]
    assert "[PASS] policy learned" in r.stdout
