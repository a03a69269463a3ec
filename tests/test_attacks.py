"""Another user on the host (uid 65534 through ``setpriv``) tries to receive, block or wedge a
weight update (docs/security.md, "Attacks and what holds"):

1. theft: it connects to every TCP port the group's processes listen on and sends the sequence
   numbers gloo expects, racing the real peer for the data channel;
2. heartbeat poisoning: it writes ``b"x"`` over a member's heartbeat key in the store;
3. IPC backlog: it holds idle connections to the colocated IPC socket;
4. store exhaustion: an 8 MiB value fetched 256 times per request, 64 appends of 8 MiB to the
   update header, thousands of idle connections;
5. version rollback and 6. bad arguments: across a group whose receiver runs as uid 65534;
7. squatting the per-user run directory.

Each time the attacker gets nothing, the update lands byte-exact (or fails at once with a named
error), and the group names what it refused.  Like tests/test_security.py these need root and
``setpriv``; without them they skip, saying which is missing.  All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_security import (  # noqa: E402
    NOBODY, ROOT, _abstract_names, _as_nobody, _Bg, _exact, _nobody_env, _pair, _port, _skip_without_nobody, _wait,
    _weights, listening_sockets,
)

from unisleep.errors import InvalidArgumentError, TransferError  # noqa: E402
from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender  # noqa: E402

#: a member that stops answering is named within this many seconds (docs/security.md, Liveness)
LIVENESS_S = 5.0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def nobody_dir():
    """A directory uid 65534 may write (pytest's tmp_path is private to root)."""
    d = tempfile.mkdtemp(prefix="unisleep-attack-")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _windows(w: dict, n: int = 6, size: int = 64) -> list[bytes]:
    """A few 64-byte pieces of the weights' raw bytes: finding one in what the attacker read means
    it got plaintext weights."""
    raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in w.values()]).numpy().tobytes()
    step = max(1, (len(raw) - size) // n)
    return [raw[i: i + size] for i in range(0, len(raw) - size, step)][:n]


# ---------------------------------------------------------------------------- 7. squatting
SQUAT = r"""
import json, os, sys
base, victim = sys.argv[1], int(sys.argv[2])
p = os.path.join(base, f"unisleep-{victim}")
os.mkdir(p, 0o777)
os.chmod(p, 0o777)
print(json.dumps({"uid": os.getuid(), "squatted": p}), flush=True)
"""

VICTIM = r"""
import json, os, sys
from unisleep.errors import UnisleepError
from unisleep.transfer.secret import private_dir
try:
    print(json.dumps({"ok": True, "dir": private_dir(), "uid": os.getuid()}))
except UnisleepError as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "msg": str(e), "uid": os.getuid()}))
"""


def _as(uid: int, args: list) -> list:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, *args]


@pytest.mark.slow
def test_squatted_run_directory(nobody_dir):
    _skip_without_nobody()
    from pathlib import Path

    tmp_path = Path(nobody_dir)
    os.chmod(tmp_path, 0o755)
    base = tmp_path / "tmp"
    base.mkdir()
    os.chmod(base, 0o1777)  # like /tmp: anyone may create, nobody may swap another's entry
    victim = 65533
    for uid in (victim, 0):
        sq = subprocess.run(_as_nobody(["-c", SQUAT, str(base), str(uid)]), env=_nobody_env(), capture_output=True,
                            text=True, timeout=60)
        assert sq.returncode == 0, sq.stderr[-2000:]
    env = {k: v for k, v in _nobody_env().items() if k != "XDG_RUNTIME_DIR"} | {"TMPDIR": str(base)}
    # another user (not root) without XDG_RUNTIME_DIR: a clear error naming the squatter and the fix
    r = subprocess.run(_as(victim, ["-c", VICTIM]), env=env, capture_output=True, text=True, timeout=60)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["uid"] == victim and not got["ok"], got
    assert f"uid {NOBODY}" in got["msg"] and "XDG_RUNTIME_DIR" in got["msg"] and "rm -r" in got["msg"], got
    # the same user with a private XDG_RUNTIME_DIR: used, the squat does not matter
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    os.chown(xdg, victim, victim)
    r = subprocess.run(_as(victim, ["-c", VICTIM]), env=env | {"XDG_RUNTIME_DIR": str(xdg)}, capture_output=True,
                       text=True, timeout=60)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["dir"] == str(xdg / "unisleep"), got
    # an XDG_RUNTIME_DIR that is not private to the user is not used
    open_xdg = tmp_path / "xdg-open"
    open_xdg.mkdir()
    os.chmod(open_xdg, 0o777)
    r = subprocess.run(_as(victim, ["-c", VICTIM]), env=env | {"XDG_RUNTIME_DIR": str(open_xdg)}, capture_output=True,
                       text=True, timeout=60)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert not (got["ok"] and got["dir"].startswith(str(open_xdg))), got
    # root: its squatted <tmp>/unisleep-0 is not used either; a loopback group works
    r = subprocess.run([sys.executable, "-c", VICTIM], env=env, capture_output=True, text=True, timeout=60)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] and not got["dir"].startswith(str(base)), got
