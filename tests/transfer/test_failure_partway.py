"""An update that fails part-way, for real, in processes of their own: the sender SIGKILLed after
the engine wrote some of its buckets, or the engine's next bucket buffer refused for lack of
memory (an address-space limit in the engine's process) — on both ways bytes move on one
machine: shared memory (the engine maps the sender's bucket memory) and the collective path (a
socket into the engine's own bucket buffers).  With a retained level-1 backup the
engine rolls back byte-exact and generates as before; without one (after a level-2 sleep) it is
torn and TorchGenerator.generate refuses with TornWeightsError naming the versions, until a
complete update — from a fresh sender when the old one died — clears it.

The engine and the senders are partway_worker.py.  A kill lands at a random bucket, so each kill
case runs RUNS times, each in fresh processes, and prints what it saw."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.slow  # every test here starts processes

#: docs/transfer.md: a dead peer is named within 4 s of its last heartbeat (at once when it is a
#: process of this machine); the receive of the killed update must end within that and a margin
LIVENESS_S = 4.0
MARGIN_S = 3.0
RUNS = 20
#: the sender's path: shared memory (the default on one machine), the bytes over a socket
PATHS = ["ipc", "collective"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """One worker process and the JSON lines it printed."""

    def __init__(self, *args):
        env = dict(os.environ, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "partway_worker.py"), *map(str, args)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list = []
        self.err: list = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            try:
                self.lines.append((time.monotonic(), json.loads(line)))
            except ValueError:
                pass

    def wait_for(self, pred, timeout_s: float = 120, after: int = 0):
        """The first line (from the ``after``-th on) for which ``pred`` holds, and its number."""
        t0, ended = time.monotonic(), False
        while True:
            for i, (t, x) in enumerate(list(self.lines)[after:], after):
                if pred(x):
                    return i, x
            if self.p.poll() is not None and not ended:  # the reader may still hold its last lines
                ended = True
                time.sleep(0.3)
                continue
            if time.monotonic() - t0 > timeout_s or ended:
                raise AssertionError(f"no such line from {self.p.args[2:4]} after {time.monotonic() - t0:.0f} s; "
                                     f"lines: {[x for _, x in self.lines if 'applied' not in x]}; "
                                     f"stderr: {''.join(self.err)[-3000:]}")
            time.sleep(0.005)

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


def _check_failed(two: dict, retain: bool, what: str) -> None:
    assert not two["ok"] and two["applied"] >= 1, two
    if retain:
        assert two["outcome"] == "rolled_back" and "rolled back" in two["msg"], two
        assert two["exact1"] and not two["torn"], two          # byte-exact version 1
        assert two["same_tokens"], two                          # and it generates as before
    else:
        assert two["outcome"] == "torn" and "torn" in two["msg"], two
        assert two["torn"] and not two["exact1"], two           # a mix of versions 1 and 2...
        g = two["generate"]
        assert g.get("refused") == "TornWeightsError", g        # ...that generation refuses
        assert g["version"] == 2 and g["previous"] == 1 and g["names"] >= 1, g
        assert "version 2" in g["msg"] and "Send a complete update" in g["msg"], g
    assert what in two["msg"], two


def _check_cleared(three: dict) -> None:
    assert three["ok"] and three["version"] == 3, three
    assert three["exact3"] and not three["torn"], three
    assert "tokens" in three["generate"], three


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("retain", [True, False], ids=["level1-backup", "level2-torn"])
def test_sender_killed_part_way(tmp_path, retain, path):
    """The sender of update 2 is SIGKILLed once the engine has written k of its buckets (k drawn
    per run); the engine notices within the liveness time, rolls back or is torn; a fresh sender's
    complete update 3 clears it."""
    rng = random.Random(1234 + retain)
    seen = {"outcome": [], "applied_at_kill": [], "applied_when_noticed": [], "noticed_s": []}
    for run in range(RUNS):
        p1, p2 = _port(), _port()
        spill = tmp_path / f"spill{run}"
        spill.mkdir()
        eng = Child("engine", int(retain), "kill", p1, p2, spill)
        tx1 = Child("sender", "kill", path, p1, "1,2", "slow")
        tx2 = Child("sender", "kill", path, p2, "3")
        try:
            ready, _ = eng.wait_for(lambda x: x.get("ready") == "engine")
            k = rng.randint(1, 8)
            eng.wait_for(lambda x: x.get("applied", 0) >= k, 30, after=ready)  # k buckets of update 2
            os.kill(tx1.p.pid, signal.SIGKILL)
            killed = time.monotonic()
            at_kill = max(x.get("applied", 0) for _, x in eng.lines[ready:])
            i, two = eng.wait_for(lambda x: x.get("update") == 2, LIVENESS_S + MARGIN_S + 30, after=ready)
            t = eng.lines[i][0]
            assert t - killed < LIVENESS_S + MARGIN_S, f"run {run}: the engine noticed after {t - killed:.1f} s"
            assert not any(x.get("sent") == 2 for _, x in tx1.lines), f"run {run}: update 2 ended before the kill"
            _check_failed(two, retain, "the sender died")
            _, three = eng.wait_for(lambda x: x.get("update") == 3)
            _check_cleared(three)
            assert eng.p.wait(60) == 0, "".join(eng.err)[-3000:]
            seen["outcome"].append(two["outcome"])
            seen["applied_at_kill"].append(at_kill)
            seen["applied_when_noticed"].append(two["applied"])
            seen["noticed_s"].append(round(t - killed, 2))
        finally:
            for c in (eng, tx1, tx2):
                c.close()
    print(f"\nsender killed part-way ({path}), {'retained level-1 backup' if retain else 'after a level-2 sleep'}: "
          f"{len(seen['outcome'])} runs, outcomes {dict((o, seen['outcome'].count(o)) for o in set(seen['outcome']))}, "
          f"buckets written at the kill {seen['applied_at_kill']}, when the engine noticed "
          f"{seen['applied_when_noticed']}, noticed after (s) {seen['noticed_s']}")
    assert len(seen["outcome"]) == RUNS


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("retain", [True, False], ids=["level1-backup", "level2-torn"])
def test_engine_out_of_memory_part_way(tmp_path, retain, path):
    """Update 2 arrives while the engine's process may take only 24 MiB more address space: the
    small buckets come first and are written, then the memory of the first 64 MiB bucket is
    refused (ENOMEM: mapping the sender's bucket, or allocating the receive buffer).  The limit
    is lifted after the receive; update 3 from the same sender clears it."""
    p = _port()
    eng = Child("engine", int(retain), "oom", p, tmp_path)
    tx = Child("sender", "oom", path, p, "1,2,3")
    try:
        _, two = eng.wait_for(lambda x: x.get("update") == 2)
        _check_failed(two, retain, "Cannot allocate memory")
        # this side's own memory, said so (not blamed on the sender)
        assert two["type"] == "UpdateMemoryError" and "this side ran out of memory" in two["msg"], two
        _, sent = tx.wait_for(lambda x: x.get("sent") == 2)
        assert not sent["ok"] and "receiver rank 1 stopped" in sent["msg"], sent
        _, three = eng.wait_for(lambda x: x.get("update") == 3)
        _check_cleared(three)
        assert eng.p.wait(60) == 0, "".join(eng.err)[-3000:]
        print(f"\nengine out of memory part-way ({path}, {'retained backup' if retain else 'level-2 sleep'}): "
              f"{two['outcome']} after {two['applied']} bucket(s) written; the failure: {two['cause'].strip().splitlines()[-1][:200]}")
    finally:
        eng.close()
        tx.close()
