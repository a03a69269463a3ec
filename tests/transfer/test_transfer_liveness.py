"""After a receive timeout, an abort or a receiver killed with SIGKILL, the next update works (or
both sides say at once that the group must be recreated) within 5 s.  The sender runs here; the
receiver is a child process (liveness_worker.py) that the test may kill."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from unisleep.errors import TransferError
from unisleep.transfer import TransferGroup, WeightSender

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from liveness_worker import weights  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes

LIMIT_S = 5.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """The child process and its JSON lines."""

    def __init__(self, port: int, timeouts: str):
        env = dict(os.environ, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "liveness_worker.py"), str(port), timeouts],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for line in self.p.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def outcome(self, n: int, timeout_s: float = 60) -> dict:
        """The n-th receive outcome (0-based), waiting for it."""
        t0 = time.monotonic()
        while True:
            got = [x for x in self.lines if "ready" not in x]
            if len(got) > n:
                return got[n]
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"receiver gave no outcome #{n}; stderr: {self.p.stderr.read()[-2000:] if self.p.poll() is not None else ''}")
            time.sleep(0.02)

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


@pytest.fixture
def session():
    made = []

    def start(timeouts: str):
        port = _port()
        rx = Receiver(port, timeouts)
        g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0, 2, platform="host", timeout_s=60)
        made.append((g, rx))
        return g, rx

    yield start
    for g, rx in made:
        rx.close()
        g.close()


def _timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return None, e, time.monotonic() - t0


#: how the sender moves the bytes: the collective path (a Unix socket on one machine), the same over
#: gloo as between machines (encrypted), shared memory
WAYS = {"collective": {"path": "collective"}, "gloo": {"path": "collective", "via": "gloo"}, "ipc": {"path": "ipc"}}


@pytest.mark.parametrize("path", list(WAYS))
def test_receive_timeout_then_next_update_works(session, path):
    g, rx = session("1,-")
    first = rx.outcome(0)
    assert not first["ok"] and first["type"] == "TransferError" and "timed out" in first["msg"], first
    tx = WeightSender(g, bucket_bytes=256 << 10, **WAYS[path])
    rep, err, dt = _timed(lambda: tx.send(weights(1), 1))
    assert err is None, err
    assert dt < LIMIT_S, f"the update after a receive timeout took {dt:.1f} s"
    nxt = rx.outcome(1)
    assert nxt["ok"] and nxt["version"] == 1 and nxt["exact"], nxt


@pytest.mark.parametrize("path", list(WAYS))
@pytest.mark.parametrize("fail_at", [0, 5])
def test_abort_then_next_update_works(session, path, fail_at):
    """The generator fails in the first bucket (on the colocated path it is packed while the
    receivers answer, before "go": the update is called off) or in a later one (aborted)."""
    g, rx = session("-,-")
    tx = WeightSender(g, bucket_bytes=256 << 10, **WAYS[path])
    w = weights(1)
    specs = [(k, tuple(v.shape), v.dtype) for k, v in w.items()]

    def failing():
        for i, (k, v) in enumerate(w.items()):
            if i == fail_at:
                raise RuntimeError("the trainer's generator failed")
            yield k, v

    _, err, _ = _timed(lambda: tx.send(failing(), 1, specs=specs))
    assert isinstance(err, TransferError) and "generator failed" in str(err), err
    first = rx.outcome(0)
    said = "called off" if (path, fail_at) == ("ipc", 0) else "aborted"
    assert not first["ok"] and said in first["msg"] and "generator failed" in first["msg"], first
    assert first["version"] is None, first
    rep, err, dt = _timed(lambda: tx.send(weights(2), 2))
    assert err is None, err
    assert dt < LIMIT_S, f"the update after an abort took {dt:.1f} s"
    nxt = rx.outcome(1)
    assert nxt["ok"] and nxt["version"] == 2 and nxt["exact"], nxt


@pytest.mark.parametrize("path", list(WAYS))
@pytest.mark.parametrize("when", ["idle", "mid-update", "frozen-mid-update"])
def test_sigkilled_receiver_is_named_at_once(session, path, when):
    """Killed (SIGKILL) while idle or mid-update, or frozen (SIGSTOP: alive, silent) mid-update:
    the sender names the receiver within 5 s, and its next send says at once to recreate the group."""
    g, rx = session("-,-")
    tx = WeightSender(g, bucket_bytes=256 << 10, **WAYS[path])
    send = threading.Thread(target=lambda: None)
    if when != "idle":
        # a slow generator: the receiver is killed while buckets are moving
        w = weights(1)
        specs = [(k, tuple(v.shape), v.dtype) for k, v in w.items()]

        moving = threading.Event()  # set once buckets move (after go, on every path)

        def slow():
            for i, (k, v) in enumerate(w.items()):
                time.sleep(0.3)
                if i == 2:
                    moving.set()
                yield k, v

        res: dict = {}

        def run():
            res["rep"], res["err"], res["dt"] = _timed(lambda: tx.send(slow(), 1, specs=specs))

        send = threading.Thread(target=run, daemon=True)
        send.start()
        assert moving.wait(30), res
        time.sleep(0.4)
        os.kill(rx.p.pid, signal.SIGSTOP if when.startswith("frozen") else signal.SIGKILL)
        killed = time.monotonic()
        send.join(60)
        assert isinstance(res["err"], TransferError), res
        assert time.monotonic() - killed < LIMIT_S + 1, f"the sender noticed after {time.monotonic() - killed:.1f} s"
        assert "rank 1" in str(res["err"]) or "receiver" in str(res["err"]), res["err"]
    else:
        while not [x for x in rx.lines if "ready" in x]:
            time.sleep(0.01)
        os.kill(rx.p.pid, signal.SIGKILL)
        rx.p.wait(10)
    # the next update: at once, a named "recreate the group"
    _, err, dt = _timed(lambda: tx.send(weights(2), 2))
    assert isinstance(err, TransferError), err
    assert "rank 1" in str(err) and "recreate the group" in str(err), err
    assert dt < LIMIT_S, f"the dead receiver was named after {dt:.1f} s"


def test_a_peer_frozen_while_nobody_looked_is_named_by_its_last_beat(session):
    """The sender did not look at the receiver's heartbeat for 2 s after the receiver froze (a
    trainer's generator, a send the kernel's buffers took): the silence counts from the
    receiver's last beat, not from the sender's next look."""
    from unisleep.transfer.group import DEAD_AFTER_S, HEARTBEAT_S

    g, rx = session("-,-")
    while not [x for x in rx.lines if "ready" in x]:
        time.sleep(0.01)
    time.sleep(1.0)
    os.kill(rx.p.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(DEAD_AFTER_S / 2)  # its last beat was at most a heartbeat (and some delay) before the stop
    assert g.peer_dead(1) is None, "named before its heartbeat was silent for long"
    while (why := g.peer_dead(1)) is None and time.monotonic() - stopped < 30:
        time.sleep(0.05)
    took = time.monotonic() - stopped
    assert why and "rank 1" in why and "no sign of life" in why, why
    assert took < DEAD_AFTER_S + HEARTBEAT_S + 0.5, f"named {took:.1f} s after it froze"
    os.kill(rx.p.pid, signal.SIGCONT)
