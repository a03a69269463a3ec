"""``unisleep bench``: what a mode cannot do here, or a value it cannot take, refused before anything
starts, as a user meets it (each a real ``python -m unisleep`` process, timed): exit 2 in under half
a second with the reason, and nothing written — no JSON, no spill file.  Where it writes by
default (``out/``), the host goal this machine cannot meet, and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from refusals import as_from_a_terminal, assert_refused, env, read_only_dir, refused, tree, unisleep

pytestmark = pytest.mark.slow  # every test here starts processes


def _no_device(name: str) -> bool:
    from unisleep.platform import detect_platform

    try:
        return not detect_platform(name).devices
    except Exception:
        return True


# ------------------------------------------------------------------------- bench: backends refused in the parent
def test_bench_backend_typo(tmp_path):
    r, dt = refused("bench", "--backend", "foo", cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", "--backend foo: no such backend; the backends are", "host", "cuda")
    r, dt = refused("bench", "--backend", "cdua", cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", "--backend cdua: no such backend (did you mean cuda?)")
    assert tree(tmp_path) == []  # before: a child's traceback, a table of "-", and bench-foo.json


@pytest.mark.parametrize("extra", [[], ["--progressive"], ["--sweep", "--no-peers"]])
def test_bench_backend_without_its_device(tmp_path, extra):
    """Before: a child's traceback ending in advice to pip install the CUDA extra (of no help
    without a GPU); with --progressive a three-part traceback."""
    if not _no_device("cuda"):
        pytest.skip("this machine has a CUDA device")
    r, dt = refused("bench", "--backend", "cuda", *extra, cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", "--backend cuda: no cuda device was found on this machine",
                   "unisleep doctor", "unisleep bench")
    assert "pip install" not in r.stderr and tree(tmp_path) == []


def test_bench_compat_tms_without_an_accelerator(tmp_path):
    """Before: a JSON of "exit 1" cells."""
    from unisleep.platform import detect_platform

    if detect_platform().is_accelerator:
        pytest.skip("this machine has an accelerator")
    r, dt = refused("bench", "--compat-tms", cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", "--compat-tms needs an accelerator", "platform host")
    assert tree(tmp_path) == []


# ------------------------------------------------------------------------- bench: values
BENCH_BAD = [
    (["--size", "-1G"], "size must be positive: '-1G'"),  # before: argparse's "expected one argument"
    (["--size", "0"], "size must be positive"),
    (["--cycles", "0"], "--cycles must be >= 1"),
    (["--transfer", "--sizes", "0"], "--sizes 0: a size must be a positive number of GiB"),
    (["--transfer", "--sizes", "-1"], "--sizes -1: a size must be a positive number of GiB"),
    (["--transfer", "--sizes", "1,nan"], "--sizes nan: a size must be a positive number of GiB"),
    (["--transfer", "--sizes", "0.0625"], "--sizes 0.0625: smaller than one tensor of the update (--chunk-mib 256"),
    (["--transfer", "--sizes", "x"], "--sizes takes GiB numbers"),
    (["--transfer", "--repeat", "0"], "--repeat must be >= 1"),
    (["--transfer", "--chunk-mib", "0"], "--chunk-mib must be >= 1"),
    (["--transfer", "--tensors", "-1"], "--tensors must be >= 0"),
    (["--transfer", "--tensors", "2000", "--chunk-kib", "0"], "--chunk-kib must be >= 1"),
    (["--transfer", "--tensors", "2000000", "--chunk-kib", "4096"], "is more than 4 GiB"),
    (["--progressive", "--weights", "0.01"], "--weights must be at least 0.125 GiB with --layers 32"),
    (["--progressive", "--layers", "0"], "--layers must be >= 1"),
]


@pytest.mark.parametrize("args,message", BENCH_BAD, ids=[" ".join(a) for a, _ in BENCH_BAD])
def test_bench_values_refused_at_once(tmp_path, args, message):
    r, dt = refused("bench", *args, cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", message)
    assert tree(tmp_path) == []


# ------------------------------------------------------------------------- bench: what it writes
@pytest.mark.parametrize("option", ["--out", "--json"])
def test_bench_output_on_a_read_only_mount(tmp_path, option):
    """Before: the whole benchmark ran, then OSError."""
    with read_only_dir() as ro:
        path = ro if option == "--out" else os.path.join(ro, "b.json")
        r, dt = refused("bench", "--size", "4M", "--cycles", "1", option, path, "--spill-dir", str(tmp_path / "s"),
                        cwd=str(tmp_path))
        assert_refused(r, dt, "unisleep bench", f"{option} {path}: cannot write in {ro}: Read-only file system")
        assert tree(ro) == ["inside"]
    assert tree(tmp_path) == []


@pytest.mark.parametrize("mode", [["--transfer"], ["--backend", "host", "--progressive"], ["--chunk-sweep"]])
def test_every_mode_checks_its_json_first(tmp_path, mode):
    f = tmp_path / "afile"
    f.write_text("mine")
    r, dt = refused("bench", *mode, "--json", str(f / "b.json"), cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", f"--json {f / 'b.json'}: {f} exists and is not a folder")
    assert tree(tmp_path) == ["afile"]


@pytest.mark.parametrize("sub", ["", "new"])
def test_bench_spill_dir_read_only(tmp_path, sub):
    """Before: a raw OSError from mkdtemp; now what the lifecycle's SpillDirError says, at once."""
    with read_only_dir() as ro:
        spill = os.path.join(ro, sub) if sub else ro
        r, dt = refused("bench", "--size", "4M", "--spill-dir", spill, cwd=str(tmp_path))
        verb = "create" if sub else "write in"
        assert_refused(r, dt, "unisleep bench", f"cannot {verb} spill_dir {spill!r}: Read-only file system",
                       "Pass --spill-dir (or set UNISLEEP_SPILL_DIR) to a writable directory")
        assert tree(ro) == ["inside"]
    assert tree(tmp_path) == []


def test_bench_spill_dir_under_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    r, dt = refused("bench", "--size", "4M", "--spill-dir", str(f / "x"), cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep bench", f"cannot create spill_dir '{f / 'x'}': {f} is a file")
    assert tree(tmp_path) == ["afile"]


def test_bench_writes_under_out_by_default_and_says_where(tmp_path):
    r, _ = unisleep("bench", "--size", "4M", "--cycles", "1", "--spill-dir", str(tmp_path / "s"), cwd=str(tmp_path),
                    timeout=300)
    assert r.returncode == 0, r.stderr
    path = os.path.join("out", "bench-host.json")
    assert f"wrote {path}" in r.stdout and json.loads((tmp_path / path).read_text())["kind"] == "host"


def test_bench_check_does_not_fail_on_a_goal_out_of_reach_here(tmp_path):
    """The host level-2 goal (<= 5 ms) is out of reach where the kernel alone takes longer to free
    the pages (4 KiB shmem pages): labelled so, and not a miss for --check."""
    out = tmp_path / "b.json"
    r, _ = unisleep("bench", "--size", "64M", "--cycles", "3", "--spill-dir", str(tmp_path / "s"), "--json", str(out),
                    "--check", cwd=str(tmp_path), timeout=300)
    res = json.loads(out.read_text())["results"]
    rows = {row["operation"]: row for row in res["rows"]}
    l2 = rows["level-2 sleep (free only)"]
    if l2["limit_ms"] <= 5:
        pytest.skip(f"the kernel frees 64 MiB in {l2['limit_ms']:.1f} ms here: the goal is reachable")
    assert l2["met"] is None and "the kernel alone takes" in l2["unreachable"]
    assert "level-2 sleep (free only)" not in res["missed"]
    assert re.search(r"level-2 sleep \(free only\).*unreachable here", r.stdout), r.stdout
    assert "out of reach on this machine" in r.stdout and "Not counted as missed by --check" in r.stdout
    assert r.returncode == (1 if res["missed"] else 0), r.stdout
    for row in res["rows"][:4]:  # each ratio: the median of the cycles, with their range
        lo, hi = row["ratio_range"]
        assert lo <= row["ratio"] <= hi


# ------------------------------------------------------------------------- Ctrl-C
def _interrupt(args, wait_for: str, tmp_path, timeout: float = 120):
    """Start ``python -m unisleep ARGS`` in its own session, wait until stderr shows ``wait_for``,
    then Ctrl-C it as a terminal does (SIGINT to the whole process group)."""
    p = subprocess.Popen([sys.executable, "-u", "-m", "unisleep", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=env(), start_new_session=True,
                         preexec_fn=as_from_a_terminal)
    seen = []
    try:
        deadline = time.monotonic() + timeout
        for line in p.stderr:
            seen.append(line)
            if wait_for in line or time.monotonic() > deadline:
                break
        assert any(wait_for in s for s in seen), "".join(seen)
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        return p.returncode, out, "".join(seen) + err, time.monotonic() - t0, p.pid
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _alive_in_group(pgid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    out.append(int(pid))
            except OSError:
                pass
    return out


def test_ctrl_c_ends_the_transfer_bench_cleanly(tmp_path):
    """Before: a long traceback from the parent and each of its two processes."""
    rc, out, err, after, pgid = _interrupt(["bench", "--transfer", "--sizes", "2", "--paths", "gloo", "--repeat", "3"],
                                     "gloo: starting two processes", tmp_path)
    assert rc == 130, err
    assert err.rstrip().splitlines()[-1] == "unisleep bench: interrupted (Ctrl-C)", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert after < 10, after
    deadline = time.monotonic() + 10
    while _alive_in_group(pgid) and time.monotonic() < deadline:  # its two processes are gone too
        time.sleep(0.1)
    assert _alive_in_group(pgid) == []


def test_ctrl_c_ends_the_host_bench_cleanly(tmp_path):
    spill = tmp_path / "spill"
    rc, out, err, after, _ = _interrupt(["bench", "--size", "256M", "--cycles", "50", "--spill-dir", str(spill)],
                                     "cycle 1/50", tmp_path)
    assert rc == 130 and err.rstrip().splitlines()[-1] == "unisleep bench: interrupted (Ctrl-C)", err
    assert "Traceback" not in err, err
    assert list(spill.iterdir()) == []  # its spill files and the limit's file are gone
    assert not (tmp_path / "out").exists()
