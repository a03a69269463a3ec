"""Helpers for the trustworthy-bytes fault tests: each risky part runs in a child process (so a
crash is a failure, not a lost test run), on real filesystems the tests mount themselves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

CHILD_PRELUDE = """
import gc, json, os, sys, time, zlib
import torch
from unisleep import MemoryLifecycle
from unisleep import errors as E
MiB, GiB = 1 << 20, 1 << 30

def fill(t, seed):
    b = t.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return t

def crc(t):
    return zlib.crc32(t.view(-1).view(torch.uint8).numpy())

def bins(d):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".bin"))

def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


class Child:
    """A Python child process running ``code`` (after :data:`CHILD_PRELUDE`)."""

    def __init__(self, code: str, tmp_path, name: str = "child", env: dict | None = None):
        self.path = os.path.join(str(tmp_path), f"{name}.py")
        with open(self.path, "w") as f:
            f.write(CHILD_PRELUDE + "\n" + textwrap.dedent(code))
        self.proc = subprocess.Popen(
            [sys.executable, self.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )

    def wait(self, timeout: float = 300) -> "Child":
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, self.err = self.proc.communicate()
            pytest.fail(f"child {self.path} timed out\nstdout:\n{self.out}\nstderr:\n{self.err}")
        self.rc = self.proc.returncode
        return self

    def ok(self, timeout: float = 300) -> dict:
        """Wait; the child must exit 0 (a crash or an assertion fails the test); its RESULT."""
        self.wait(timeout)
        assert self.rc == 0, f"child exited {self.rc}\nstdout:\n{self.out}\nstderr:\n{self.err[-6000:]}"
        return self.result()

    def result(self) -> dict:
        lines = [l for l in self.out.splitlines() if l.startswith("RESULT ")]
        assert lines, f"child printed no RESULT\nstdout:\n{self.out}\nstderr:\n{self.err[-6000:]}"
        return json.loads(lines[-1][len("RESULT "):])


def run_child(code: str, tmp_path, name: str = "child", timeout: float = 300, env=None) -> dict:
    return Child(code, tmp_path, name, env).ok(timeout)


def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "mounting a test filesystem needs root (CI runs as root)"
    if shutil.which("mount") is None:
        return "the mount command is missing (Debian package: mount)"
    return None


@contextlib.contextmanager
def small_filesystem(size_mb: int, tmp_path):
    """Mount a fresh filesystem of ``size_mb`` MB: a loop-mounted ext4 when loop devices and
    mkfs.ext4 are there, else a tmpfs of that size.  Skips (with the reason) when this machine
    does not permit mounting."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    mnt = tempfile.mkdtemp(prefix="unisleep-fs-", dir=str(tmp_path))
    image = os.path.join(str(tmp_path), "fs.img")
    kind, errors = None, []
    if shutil.which("mkfs.ext4") and os.path.exists("/dev/loop-control"):
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)
        r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run(["mount", "-o", "loop", image, mnt], capture_output=True, text=True)
            if r.returncode == 0:
                kind = "ext4"
        if kind is None:
            errors.append(f"ext4 on a loop device: {r.stderr.strip()}")
    if kind is None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", mnt], capture_output=True, text=True)
        if r.returncode == 0:
            kind = "tmpfs"
        else:
            errors.append(f"tmpfs: {r.stderr.strip()}")
    if kind is None:
        pytest.skip("cannot mount a test filesystem here (" + "; ".join(errors) + ")")
    try:
        yield mnt, kind
    finally:
        subprocess.run(["mount", "-o", "remount,rw", mnt], capture_output=True)
        for _ in range(50):
            if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            os.unlink(image)


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
