"""``unisleep demo``'s options refused before anything starts, as a user meets them (each a real
``python -m unisleep`` process, timed): exit 2 in under half a second with the reason, and nothing
written — no output folder, no process.  And where it writes by default (``out/demo``)."""

from __future__ import annotations

import os

import pytest

from refusals import assert_refused, read_only_dir, refused, tree, unisleep

pytestmark = pytest.mark.slow  # every test here starts processes


# ------------------------------------------------------------------------- demo: values, before torch
DEMO_BAD = [
    (["--timeout", "1e-9"], "--timeout must be at least 5 s, got 1e-09"),
    (["--timeout", "0.5"], "--timeout must be at least 5 s"),
    (["--lr", "-1"], "--lr must be a positive number, got -1"),
    (["--steps", "-2"], "--steps must be >= 1, got -2"),
    (["--top-p", "-0.5"], "--top-p must be in (0, 1]"),
]


@pytest.mark.parametrize("args,message", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_values_refused_at_once(tmp_path, args, message):
    r, dt = refused("demo", *args, cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep demo", message)
    assert tree(tmp_path) == []  # not even out/


def test_demo_model_too_large_for_this_host_says_what_it_needs(tmp_path):
    """--model 7b on CPU: before, 72 s of work then "the trainer did not answer within 60 s"."""
    from unisleep.backup import host_available_bytes
    from unisleep.demo.cli import MODEL_BYTES_PER_PARAM
    from unisleep.demo.presets import preset

    pytest.importorskip("transformers")
    need = MODEL_BYTES_PER_PARAM * preset("7b").params()
    if host_available_bytes() >= need:
        pytest.skip(f"this host has room for --model 7b ({need >> 30} GiB)")
    r, dt = refused("demo", "--model", "7b", cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep demo", "--model 7b (7.62 B parameters) on host memory needs about 113.5 GiB",
                   "MemAvailable", "fits here")
    assert tree(tmp_path) == []


# ------------------------------------------------------------------------- demo: the output folder
def test_demo_out_an_existing_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    r, dt = refused("demo", "--out", str(f), cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep demo", f"--out {f}: it exists and is not a folder")
    assert f.read_text() == "mine" and tree(tmp_path) == ["afile"]


def test_demo_out_under_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    r, dt = refused("demo", "--out", str(f / "sub"), cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep demo", f"{f} is a file, so no folder can be made under it")
    assert tree(tmp_path) == ["afile"]


def test_demo_out_where_nothing_can_be_made(tmp_path):
    r, dt = refused("demo", "--out", "/proc/nope", cwd=str(tmp_path))
    assert_refused(r, dt, "unisleep demo", "--out /proc/nope: cannot write in /proc")
    assert not os.path.exists("/proc/nope") and tree(tmp_path) == []


@pytest.mark.parametrize("sub", ["", "inside", "new/deeper"])
def test_demo_out_on_a_read_only_mount(tmp_path, sub):
    """Before: the whole job ran, then OSError on demo.json."""
    with read_only_dir() as ro:
        out = os.path.join(ro, sub) if sub else ro
        r, dt = refused("demo", "--out", out, cwd=str(tmp_path))
        assert_refused(r, dt, "unisleep demo", f"--out {out}: cannot write in", "Read-only file system")
        assert tree(ro) == ["inside"]


def test_demo_writes_under_out_by_default_and_says_where(tmp_path):
    r, _ = unisleep("demo", "--steps", "2", "--batch", "8", "--no-plot", "-q", cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "out" / "demo" / "demo.json").is_file()
    assert tree(tmp_path) == ["out", "out/demo", "out/demo/demo.json"]
    assert f"wrote {os.path.join('out', 'demo', 'demo.json')}" in r.stdout


def test_ctrl_c_ends_the_demo_with_one_line(tmp_path):
    """Before: the trainer process printed its own KeyboardInterrupt traceback beside the demo's."""
    import signal
    import subprocess
    import sys
    import time

    from refusals import as_from_a_terminal, env

    p = subprocess.Popen([sys.executable, "-u", "-m", "unisleep", "demo", "--steps", "500", "--batch", "8", "--no-plot"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=env(),
                         start_new_session=True, preexec_fn=as_from_a_terminal)
    try:
        for line in p.stdout:
            if line.startswith("step 2/"):
                break
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err
    assert err.strip() == "unisleep demo: interrupted (Ctrl-C)", err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _in_group(p.pid):
        time.sleep(0.1)
    assert not _in_group(p.pid)  # the trainer is gone too


def _in_group(pgid: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                out.append(int(pid))
        except OSError:
            pass
    return out
