"""A rank started alone says what it waits for and for how long, instead of printing nothing
until its timeout (docs/transfer.md's example, one side started): each side in a child process,
with the notice brought forward from 5 s to 0.5 s and a 4 s timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # child processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALONE = """
import sys, time
import unisleep.transfer.waiting as waiting
waiting.NOTICE_AFTER_S = 0.5
from unisleep.transfer import TransferGroup
t0 = time.monotonic()
try:
    TransferGroup.create(f"tcp://127.0.0.1:{sys.argv[1]}", rank=int(sys.argv[2]), world_size=2, timeout_s=4)
except Exception as e:
    print(f"gave up after {time.monotonic() - t0:.1f} s: {type(e).__name__}", flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank,waits_for", [
    (0, "rank 0 is waiting for rank 1 of 2 to join (a process calling TransferGroup.create with rank=1)"),
    (1, "rank 1 is waiting for rank 0 (the sender) to start the group"),
])
def test_a_rank_alone_says_what_it_waits_for(rank, waits_for):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("UNISLEEP_TRANSFER_SECRET", None)
    env.pop("UNISLEEP_TRANSFER_SECRET_FILE", None)
    p = subprocess.Popen([sys.executable, "-c", ALONE, str(_port()), str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        t0 = time.monotonic()
        first = p.stderr.readline()  # the notice, before the timeout
        said_after = time.monotonic() - t0
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert waits_for in first and "gives up after 4 s" in first, first + err
    assert "gave up after" in out and said_after < 4, (said_after, out)
    assert err.count("is waiting for") == 0, err  # said once
