"""Helpers for the tests of options refused before anything starts: run ``python -m unisleep``
as a user does and time it, and a folder on a read-only filesystem."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what a refusal must not have imported: options are checked before torch is imported (a second
#: or more of CPU) and before any work.  Read from the child's own import log (``python -X
#: importtime``), so a slow machine does not decide it
HEAVY_MODULES = ("torch", "numpy", "vllm", "ray")
#: and the process's CPU time (user + system, its children included) stays under FAST_S: a
#: refusal does no work (Python's start and unisleep's command-line modules take about 0.2 s here
#: on a quiet day, 0.5 s on a slow one; torch alone takes more than 1 s); the wall time is bounded
#: too (WALL_S), so that a refusal that waits for something cannot pass
FAST_S = 1.0
WALL_S = 3.0


def as_from_a_terminal() -> None:
    """``preexec_fn`` for a child that a test then Ctrl-Cs: SIGINT at its default disposition, as
    a program started from a terminal has it.  A test run started in the background by a
    non-interactive shell (``make test &``, some CI runners) inherits SIGINT *ignored*, and a
    Python started that way installs no KeyboardInterrupt handler: the Ctrl-C would not reach it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "UNISLEEP_SPILL_DIR", "PYTHONWARNINGS")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return e


def unisleep(*args: str, cwd: str = ROOT, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m unisleep ARGS``; (the result, the CPU seconds it used).  ``r.wall_s`` is
    its wall time, ``r.imported`` the top-level modules it imported (Python's ``-X importtime``
    log, taken out of ``r.stderr``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "unisleep", *args], capture_output=True,
                       text=True, cwd=cwd, env=env(), timeout=timeout)
    r.wall_s = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = r.stderr.splitlines(keepends=True)
    log = [ln for ln in lines if ln.startswith("import time:")]
    r.stderr = "".join(ln for ln in lines if not ln.startswith("import time:"))
    r.imported = {ln.rsplit("|", 1)[-1].strip().split(".")[0] for ln in log}
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def refused(*args: str, cwd: str = ROOT, tries: int = 3) -> tuple[subprocess.CompletedProcess, float]:
    """Run a command that must be refused; the fastest of up to ``tries`` runs.  Every run must
    give the same answer (up to the numbers in it: memory figures move)."""
    best = None
    for _ in range(tries):
        r, cpu = unisleep(*args, cwd=cwd)
        if best is not None:
            same = [(x.returncode, re.sub(r"[0-9.]+", "N", x.stderr)) for x in (r, best[0])]
            assert same[0] == same[1], (r.stderr, best[0].stderr)
        if best is None or cpu < best[1]:
            best = (r, cpu)
        if cpu < FAST_S and r.wall_s < WALL_S:
            break
    return best


def assert_refused(r: subprocess.CompletedProcess, seconds: float, prog: str, *messages: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert re.search(rf"^{re.escape(prog)}( --[\w-]+)?: ", r.stderr, re.MULTILINE), r.stderr
    for m in messages:
        assert m in r.stderr, (m, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    what = f"{' '.join(r.args[5:])}: {seconds:.2f} s of CPU, {r.wall_s:.2f} s wall"
    heavy = sorted(set(HEAVY_MODULES) & r.imported)
    assert not heavy, f"refused only after importing {heavy}: {what}"
    assert seconds < FAST_S, f"refused too slowly (goal < {FAST_S} s): {what}"
    assert r.wall_s < WALL_S, f"refused too slowly (it waited?): {what}"


@contextlib.contextmanager
def read_only_dir():
    """A folder on a read-only filesystem (a small tmpfs remounted read-only): no user can write
    there, root included (root passes file modes, not a read-only mount).  Skips, saying why,
    where this machine does not permit mounting."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs (as CI runs)")
    mnt = tempfile.mkdtemp(prefix="unisleep-ro-")  # (not in tmp_path: tests compare its contents)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        os.mkdir(os.path.join(mnt, "inside"))
        r = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        yield mnt
    finally:
        for _ in range(50):
            if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def tree(path) -> list[str]:
    """Every path under ``path`` (to show that nothing was written)."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)
