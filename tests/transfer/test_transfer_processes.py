"""Two real processes (sender = trainer, receiver = engine) over gloo on 127.0.0.1 and over the
host memfd IPC path, walking one scenario (transfer_worker.py); each test checks one step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("transfer")
    port = _free_port()
    env = dict(os.environ, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    worker = os.path.join(HERE, "transfer_worker.py")
    t0 = time.monotonic()
    procs = {
        role: subprocess.Popen([sys.executable, worker, role, str(port), str(d / f"{role}.json")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for role in ("sender", "receiver")
    }
    logs = {}
    for role, p in procs.items():
        try:
            logs[role] = p.communicate(timeout=180)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            p.kill()
            logs[role] = p.communicate()[0].decode(errors="replace")
    out = {}
    for role in procs:
        path = d / f"{role}.json"
        assert path.exists(), f"{role} wrote no result; its output:\n{logs[role][-3000:]}"
        out[role] = json.loads(path.read_text())
        assert "crash" not in out[role], out[role]["crash"]
    out["sender_rc"] = procs["sender"].returncode
    out["seconds"] = time.monotonic() - t0
    return out


def _ok(step):
    assert step["ok"], step.get("tb") or step


def test_groups_leave_the_default_process_group_alone(run):
    assert run["sender"]["default_pg_initialized"] is False
    assert run["receiver"]["default_pg_initialized"] is False


def test_100mb_over_gloo_bit_exact_with_version(run):
    s, r = run["sender"]["v1_collective"], run["receiver"]["v1_collective"]
    _ok(s), _ok(r)
    assert r["holds_expected"] is True
    assert r["version_after"] == 1
    rep = r["report"]
    assert rep["path"] == "collective" and rep["version"] == 1 and rep["previous_version"] is None
    assert rep["bytes"] > 95 * 2**20
    assert rep["buckets"] >= 6  # 16 MiB buckets: the model really went in pieces
    assert s["report"]["version"] == 1


def test_second_update_reuses_metadata(run):
    r = run["receiver"]["v2_collective_reuse"]
    _ok(r)
    assert r["holds_expected"] and r["version_after"] == 2
    assert r["report"]["metadata_reused"] is True and r["report"]["previous_version"] == 1


def test_host_memfd_ipc_bit_exact(run):
    s, r = run["sender"]["v3_ipc"], run["receiver"]["v3_ipc"]
    _ok(s), _ok(r)
    assert r["report"]["path"] == "ipc"
    assert r["holds_expected"] and r["version_after"] == 3


@pytest.mark.parametrize("step,bad,kind", [
    ("v4_corrupt_collective", "layers.8.weight", "corrupt"),
    ("v6_corrupt_ipc", "layers.0.weight", "corrupt"),
    ("v5_missing_collective", "layers.4.weight", "incomplete"),
])
def test_manifest_catches_corrupt_and_missing_buckets(run, step, bad, kind):
    s, r = run["sender"][step], run["receiver"][step]
    assert not r["ok"] and r["type"] == "TransferError"
    assert kind in r["msg"] and bad in r["msg"], r["msg"]
    assert "still serving version 3" in r["msg"]
    # the previous version is still there, bit for bit
    assert r["version_after"] == 3 and r["holds_expected"] is True
    # and the trainer hears about it
    assert not s["ok"] and s["type"] == "TransferError" and bad in s["msg"]


def test_corrupt_bucket_names_only_the_corrupt_tensor(run):
    msg = run["receiver"]["v4_corrupt_collective"]["msg"]
    assert "incomplete" not in msg  # the rest of that bucket did arrive


def test_sleeping_memory_refuses_before_anything_moves(run):
    s, r = run["sender"]["v7_asleep"], run["receiver"]["v7_asleep"]
    assert r["is_invalid_transition"], r
    assert "wake the weights first" in r["msg"]
    assert s["type"] == "InvalidTransitionError" and "nothing was sent" in s["msg"]
    assert r["version_after"] == 3 and r["holds_expected"] is True
    assert r["seconds"] < 1.0  # refused at once, not after a transfer


def test_update_after_wake_succeeds(run):
    r = run["receiver"]["v8_after_wake"]
    _ok(r)
    assert r["holds_expected"] and r["version_after"] == 8


def test_sender_killed_mid_update_leaves_old_version(run):
    r = run["receiver"]["v9_sender_killed"]
    assert run["sender_rc"] == -9  # it really died
    assert not r["ok"] and r["type"] == "TransferError"
    assert "sender died" in r["msg"] and "still serving version 8" in r["msg"], r["msg"]
    assert r["version_after"] == 8 and r["holds_expected"] is True
    assert r["seconds"] < 25  # noticed, not hung until some far timeout


def test_after_the_sender_died_the_receiver_says_recreate_the_group_at_once(run):
    r = run["receiver"]["v10_after_sender_death"]
    assert not r["ok"] and r["type"] == "TransferError"
    assert "recreate the group" in r["msg"], r["msg"]
    assert r["version_after"] == 8 and r["holds_expected"] is True
    assert r["seconds"] < 5, r["seconds"]
