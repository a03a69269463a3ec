"""A process of the group that runs out of file descriptors mid-update (``EMFILE``): a named
:class:`DescriptorLimitError` on that side, and the other side hears the same reason at once
instead of a raw ``OSError`` or a timeout.  The side that runs out is a child process (its
descriptor limit is lowered to what it holds, after a first update); the other side runs here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from unisleep.errors import DescriptorLimitError, TransferError
from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, os, resource, sys, time, torch
from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

def weights(v, n):
    return {f"t{i}": torch.full((64 << 10,), float(v)) for i in range(n)}  # 256 KiB each

def exhaust():
    # no descriptor left: the limit just above the highest one in use, and every hole filled
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    return held

role, port = sys.argv[1], int(sys.argv[2])
g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0 if role == "sender" else 1, 2, platform="host", timeout_s=30)
out = {}
if role == "sender":
    tx = WeightSender(g, bucket_bytes=300 << 10, path="ipc")
    tx.send(weights(1, 1), 1)                     # one bucket: one shared buffer
    held = exhaust()
    t0 = time.monotonic()
    try:
        tx.send(weights(2, 2), 2)                 # two buckets: the second needs new shared memory
        out = {"ok": True}
    except Exception as e:
        out = {"ok": False, "type": type(e).__name__, "msg": str(e)}
else:
    tgt = weights(0, 2)
    rx = WeightReceiver(g, apply=lambda pairs: None)
    rx.receive()
    held = exhaust()
    t0 = time.monotonic()
    try:
        rx.receive()
        out = {"ok": True}
    except Exception as e:
        out = {"ok": False, "type": type(e).__name__, "msg": str(e)}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
time.sleep(2)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(v, n):
    return {f"t{i}": torch.full((64 << 10,), float(v)) for i in range(n)}


def _child(role: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", WORKER, role, str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=120)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, err[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_sender_out_of_descriptors_is_named_on_both_sides():
    port = _port()
    p = _child("sender", port)
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 1, 2, platform="host", timeout_s=30)
    try:
        rx = WeightReceiver(g, apply=lambda pairs: None)
        rx.receive()
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            rx.receive()
        dt = time.monotonic() - t0
        got = _result(p)
        assert not got["ok"] and got["type"] == "DescriptorLimitError", got
        assert "ran out of file descriptors" in got["msg"] and "ulimit -n" in got["msg"], got
        assert "DescriptorLimitError" in str(e.value) and "ran out of file descriptors" in str(e.value), e.value
        assert dt < 5, f"the receiver heard after {dt:.1f} s"
    finally:
        g.close()
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_receiver_out_of_descriptors_is_named_on_both_sides():
    port = _port()
    p = _child("receiver", port)
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0, 2, platform="host", timeout_s=30)
    try:
        tx = WeightSender(g, bucket_bytes=300 << 10, path="ipc")
        tx.send(_weights(1, 1), 1)
        time.sleep(1.0)  # the receiver lowers its limit
        t0 = time.monotonic()
        with pytest.raises(DescriptorLimitError) as e:
            tx.send(_weights(2, 2), 2)
        dt = time.monotonic() - t0
        got = _result(p)
        assert not got["ok"] and got["type"] == "DescriptorLimitError", got
        assert "ran out of file descriptors" in got["msg"], got
        assert "receiver rank 1" in str(e.value) and "ran out of file descriptors" in str(e.value), e.value
        assert dt < 5 and got["seconds"] < 5, (dt, got)
    finally:
        g.close()
        if p.poll() is None:
            p.kill()
