"""``unisleep bench --devices``: one process per device sleeping and waking at the same instant.

On this CPU machine the host backend stands in for the accelerators: its device is host memory
(memfd), so N processes share it, each with its own lifecycle, spill files and reference copy.
What runs is the real command: real processes, real memfd memory, real spill files, the real
barrier and the real host memcpy.  What does not run here: the accelerator's page-locked copies
and their NUMA nodes (the lead's one-GPU run covers N = 1; more GPUs need a multi-GPU machine).
The fault tests kill (SIGKILL) or freeze (SIGSTOP) one real child in the middle of a run.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from unisleep.backend import DeviceInfo
from unisleep.bench import cli as bench_cli
from unisleep.bench import devices
from unisleep.errors import InvalidArgumentError
from unisleep.platform import detect_platform

SMALL = ["--weights", "0.004", "--host-gib", "0.01"]


# ---------------------------------------------------------------------------------- arguments
def _accel(n):
    return SimpleNamespace(name="accel", is_accelerator=True, devices=tuple(DeviceInfo(i, "x") for i in range(n)))


def test_devices_spec_on_an_accelerator():
    plat = _accel(4)
    assert devices.parse_devices("all", plat) == [(f"device {i}", i) for i in range(4)]
    assert devices.parse_devices("2", plat) == [("device 0", 0), ("device 1", 1)]
    assert devices.parse_devices("1,3", plat) == [("device 1", 1), ("device 3", 3)]
    for bad, said in (("5", "has 4 device"), ("0", "has 4 device"), ("1,7", "no device [7]"),
                      ("1,1", "names a device twice"), ("x", "not all, a count")):
        with pytest.raises(InvalidArgumentError, match=re.escape(said)):
            devices.parse_devices(bad, plat)


def test_devices_spec_on_the_host_backend_shares_its_one_device():
    plat = detect_platform("host")
    assert devices.parse_devices("all", plat) == [("process 0 (host memory)", 0)]
    assert devices.parse_devices("3", plat) == [(f"process {k} (host memory)", 0) for k in range(3)]
    assert devices.parse_devices("0,0", plat) == [(f"process {k} (host memory)", 0) for k in range(2)]
    with pytest.raises(InvalidArgumentError, match=r"no device \[1\]"):
        devices.parse_devices("0,1", plat)


def test_counts():
    assert devices.default_counts(1) == [1]
    assert devices.default_counts(8) == [1, 2, 4, 8]
    assert devices.default_counts(6) == [1, 2, 4, 6]
    assert devices.parse_counts("4,1,4", 8) == [1, 4]
    with pytest.raises(InvalidArgumentError, match="from 1 to 2"):
        devices.parse_counts("3", 2)


def test_bad_values_are_refused_before_anything_starts(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert bench_cli.main(["--backend", "host", "--devices", "0,1", "--json", str(out)]) == 2
    assert "no device [1]" in capsys.readouterr().err
    assert bench_cli.main(["--backend", "host", "--devices", "2", "--weights", "100000", "--json", str(out)]) == 2
    assert "host memory is needed" in capsys.readouterr().err
    assert bench_cli.main(["--backend", "nosuch", "--devices", "all", "--json", str(out)]) == 2
    assert "no such backend" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------------------- figures
def _answer(t0, t1, nbytes=10**9, verified=True):
    return {"t0": t0, "t1": t1, "seconds": t1 - t0, "bytes": nbytes, "verified": verified}


def test_the_aggregate_is_all_bytes_over_first_start_to_last_end():
    agg = devices.aggregate({"0": _answer(10.0, 10.5), "1": _answer(10.001, 11.0)})
    assert agg["bytes"] == 2 * 10**9 and agg["seconds"] == pytest.approx(1.0)
    assert agg["gbps"] == pytest.approx(2.0) and agg["start_spread_s"] == pytest.approx(0.001)


def test_the_limit_is_the_lesser_of_the_copies_alone_and_the_host():
    res = {
        "processes": [{"label": f"device {k}", "setup_verified": True, "limits": {"d2h_gbps": 50.0, "h2d_gbps": 50.0}}
                      for k in range(2)],
        "host_bandwidth": {"all": {"traffic_gbps": 80.0}},
        "alone": {str(k): [{"sleep": _answer(0, 0.02), "wake": _answer(0, 0.02)}] for k in range(2)},
        "together": [{"n": 2, "members": [0, 1], "cycles": [{
            "sleep": {"0": _answer(0, 0.025), "1": _answer(0, 0.025)},  # 80 GB/s aggregate
            "wake": {"0": _answer(0, 0.04), "1": _answer(0, 0.04, verified=False)}}]}],  # 50 GB/s
    }
    fig = devices.figures(res)
    row = fig["by_count"][0]
    assert row["sleep_limit_gbps"] == 80.0 and row["sleep_limit_is"] == "the host's memory"  # 2 x 50 > 80
    assert row["sleep_fraction"] == pytest.approx(1.0) and row["wake_fraction"] == pytest.approx(50 / 80)
    assert row["met"] is False and fig["missed"] == [2]
    assert row["verified"] is False and fig["verified"] is False  # one wrong byte on one device is a failure


# ---------------------------------------------------------------------------------- real runs
def _run(tmp_path, capsys, n):
    out = tmp_path / "d.json"
    rc = bench_cli.main(["--backend", "host", "--devices", str(n), *SMALL, "--cycles", "2",
                         "--spill-dir", str(tmp_path / "spill"), "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "devices-host"
    return doc["results"], cap


@pytest.mark.slow
def test_one_process_runs_for_real(tmp_path, capsys):
    res, cap = _run(tmp_path, capsys, 1)
    fig = res["figures"]
    assert fig["verified"] is True
    assert [r["n"] for r in fig["by_count"]] == [1]
    d = fig["devices"][0]
    assert d["d2h_gbps"] > 0 and d["h2d_gbps"] > 0 and d["sleep_gbps"] > 0 and d["wake_gbps"] > 0
    assert res["host_bandwidth"]["nodes"] and res["host_bandwidth"]["all"]["traffic_gbps"] > 0
    assert res["processes"][0]["where"]["store"].startswith("spill files in")
    for c in res["together"][0]["cycles"]:  # every sleep copied the whole tag (the weights changed)
        # (the allocation rounded up to the backend's granularity)
        assert res["weights_bytes"] <= c["sleep"]["0"]["bytes"] < res["weights_bytes"] + (2 << 20)
        assert c["wake"]["0"]["verified"] is True
    assert "bytes exact on every process after every wake: yes" in cap.out
    assert "host memory bandwidth, same run" in cap.out and "devices sleeping and waking" in cap.out
    assert not (tmp_path / "spill").exists() or not list((tmp_path / "spill").iterdir())


@pytest.mark.slow
def test_two_processes_sleep_and_wake_at_the_same_instant(tmp_path, capsys):
    res, cap = _run(tmp_path, capsys, 2)
    fig = res["figures"]
    assert fig["verified"] is True and [r["n"] for r in fig["by_count"]] == [1, 2]
    pids = {p["pid"] for p in res["processes"]}
    assert len(pids) == 2 and os.getpid() not in pids  # two processes of their own
    both = res["together"][1]
    for c in both["cycles"]:
        for what in ("sleep", "wake"):
            ans = c[what]
            assert set(ans) == {"0", "1"}
            # one barrier: the two starts lie within 50 ms on this shared 2-core machine
            assert abs(ans["0"]["t0"] - ans["1"]["t0"]) < 0.05, ans
        assert all(v["verified"] for v in c["wake"].values())
    assert fig["by_count"][1]["sleep_gbps"] > 0 and fig["by_count"][1]["sleep_limit_gbps"] > 0
    assert re.search(r"2 at once \(aggregate\)", cap.out)


# ---------------------------------------------------------------------------------- faults
class _Run:
    """The command in a process of its own; its stderr read line by line on a thread."""

    def __init__(self, tmp_path, timeout_s: float, cycles: int = 60):
        self.json = tmp_path / "f.json"
        cmd = [sys.executable, "-m", "unisleep", "bench", "--backend", "host", "--devices", "2", *SMALL,
               "--cycles", str(cycles), "--counts", "2", "--timeout", str(timeout_s),
               "--spill-dir", str(tmp_path / "spill"), "--json", str(self.json)]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stderr:
            self.err.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            m = re.search(pattern, line)
            if m:
                return m
        self.p.kill()
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{''.join(self.err)[-3000:]}")

    def pids(self) -> tuple[int, int]:
        p0 = int(self.wait_for(r"process 0 \(host memory\): pid (\d+)").group(1))
        p1 = int(self.wait_for(r"process 1 \(host memory\): pid (\d+)").group(1))
        return p0, p1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by its new parent
    except OSError:
        return True


@pytest.mark.slow
def test_a_child_killed_mid_run_is_named_and_the_other_stopped(tmp_path):
    run = _Run(tmp_path, timeout_s=60)
    p0, p1 = run.pids()
    run.wait_for(r"together n=2 cycle 1/")
    os.kill(p1, signal.SIGKILL)
    t0 = time.monotonic()
    rc = run.p.wait(timeout=60)
    took = time.monotonic() - t0
    err = "".join(run.err)
    assert rc == 1, err[-3000:]
    # named at once (the pipe closes), not after --timeout; the other stopped within the stated grace
    assert took < devices.STOP_GRACE_S + 10, took
    assert re.search(rf"DeviceProcessError: process 1 \(host memory\) \(pid {p1}\) was killed by SIGKILL during "
                     r"(sleep|wake) of process 0 \(host memory\), process 1 \(host memory\); every other process was "
                     r"stopped", err), err[-3000:]
    assert _gone(p0) and _gone(p1)
    doc = json.loads(run.json.read_text())
    assert doc["results"]["error"].startswith("DeviceProcessError: process 1")
    assert doc["results"]["alone"]  # what was measured before the failure is kept


@pytest.mark.slow
def test_a_child_that_hangs_is_named_after_the_timeout(tmp_path):
    run = _Run(tmp_path, timeout_s=4)
    p0, p1 = run.pids()
    run.wait_for(r"together n=2 cycle 1/")
    os.kill(p1, signal.SIGSTOP)  # a real hang: the process is alive and answers nothing
    t0 = time.monotonic()
    try:
        rc = run.p.wait(timeout=60)
    finally:
        try:
            os.kill(p1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    took = time.monotonic() - t0
    err = "".join(run.err)
    assert rc == 1, err[-3000:]
    assert 3 < took < 4 + 2 * devices.STOP_GRACE_S + 10, took
    assert re.search(rf"DeviceProcessError: process 1 \(host memory\) \(pid {p1}\) did not answer within 4 s "
                     r"during (sleep|wake) of", err), err[-3000:]
    assert _gone(p0) and _gone(p1)


@pytest.mark.slow
def test_children_end_when_the_coordinator_is_killed(tmp_path):
    run = _Run(tmp_path, timeout_s=60)
    p0, p1 = run.pids()
    run.wait_for(r"together n=2 cycle 1/")
    os.kill(run.p.pid, signal.SIGKILL)
    run.p.wait(timeout=30)
    end = time.monotonic() + 30  # each child reads end-of-file on its steps' pipe and exits
    while time.monotonic() < end and not (_gone(p0) and _gone(p1)):
        time.sleep(0.2)
    assert _gone(p0) and _gone(p1)
