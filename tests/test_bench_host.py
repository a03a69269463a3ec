"""The host benchmark runs end to end (small size) and writes its table and JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from unisleep.bench import cli as bench_cli
from unisleep.bench.host import parse_size


@pytest.mark.parametrize("text,n", [("512M", 512 << 20), ("1G", 1 << 30), ("1GiB", 1 << 30), ("64MB", 64 << 20),
                                    ("4096", 4096), ("1.5g", 3 << 29), ("8k", 8192)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "abc", "0", "1X", "-5M"])
def test_parse_size_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(bad)


@pytest.mark.slow  # a run starts helper processes (ldconfig through ctypes.util, uname through platform)
def test_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    spill = tmp_path / "spill"
    rc = bench_cli.main(["--size", "8M", "--cycles", "2", "--spill-dir", str(spill), "--json", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "level-1 sleep" in cap.out and "ours/limit" in cap.out
    assert "[bench]" in cap.err  # progress goes to stderr
    doc = json.loads(out.read_text())
    assert doc["kind"] == "host" and doc["results"]["size_bytes"] == 8 << 20
    rows = {r["operation"]: r for r in doc["results"]["rows"]}
    assert len(rows) == 5
    for name, samples in doc["results"]["samples_s"].items():
        assert len(samples) == 2 and all(s > 0 for s in samples), name
    assert list(spill.iterdir()) == []  # nothing left in the spill dir
    hm = doc["results"]["host_memory"]  # the backup store after the level-1 sleep and after the wake
    assert hm["after_sleep"]["disk"] >= 8 << 20 and hm["after_sleep"]["held"] == 8 << 20
    assert hm["after_wake"] == {"pinned": 0, "pageable": 0, "disk": 0, "held": 0}
    assert "backup store after the level-1 sleep: pinned 0 B, pageable 0 B, on disk" in cap.out


@pytest.mark.slow
def test_bench_default_json_under_out(tmp_path, capsys):
    rc = bench_cli.main(["--backend", "host", "--size", "4M", "--cycles", "1", "--out", str(tmp_path),
                         "--spill-dir", str(tmp_path / "s")])
    assert rc == 0
    assert (tmp_path / "bench-host.json").exists()


@pytest.mark.slow
def test_the_accelerator_workload_runs_on_the_host_backend(tmp_path, monkeypatch):
    """``unisleep bench --backend NAME``'s workload (small sizes, real host memory): every figure is
    measured, the wakes after the trainer's turn included, and the bytes are verified."""
    from unisleep.bench import device

    monkeypatch.setenv("UNISLEEP_SPILL_DIR", str(tmp_path / "spill"))
    out = device.run_unisleep("host", 0, 4 / 1024, 8 / 1024, 1, False, turn_s=0.05)
    assert out["verified"] is True
    for key in device.LABELS:
        assert isinstance(out[key], float) and out[key] > 0, key
    rows = {r[0]: r for r in device.figure_rows({"unisleep": out, "peer": {"steady_wake_s": 1.0}})}
    assert rows["steady wake"][1:] == [0.17, out["steady_wake_s"], 1.0, "yes" if out["steady_wake_s"] <= 0.17 else "no"]
    turn = rows["wake after the trainer's turn"]
    assert turn[1] is None and turn[2] == out["turn_wake_s"] and turn[3] is None and turn[4] is None  # no goal


def test_the_accelerator_workload_help_states_its_pauses():
    from unisleep.bench import common, device

    doc = " ".join(device.__doc__.split())
    assert f"start {common.GENERATION_PAUSE_S:g} s after the last wake" in doc
    assert f"{common.TRAINER_TURN_S:g} s between the sleep and the wake" in doc


@pytest.mark.slow
def test_the_host_policies_run_side_by_side_on_the_host_backend(tmp_path, monkeypatch, capsys):
    """``unisleep bench --backend NAME``'s two host policies (each in its own process), on the
    host backend with small sizes: every row is measured, the bytes verified, and the release
    goal (at most 5 % of the backed-up bytes after a wake) is checked and printed; the NUMA row
    says the host backend has no placement."""
    from unisleep.bench import host_policies

    monkeypatch.setenv("UNISLEEP_SPILL_DIR", str(tmp_path / "spill"))
    out = tmp_path / "hp.json"
    rc = bench_cli.main(["--backend", "host", "--host-policies", "--weights", str(4 / 1024), "--kv", str(8 / 1024),
                         "--cycles", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "host backups after a wake, on host" in text and "keep" in text and "release" in text
    assert "goal: host_backups='release' holds <= 5% of the backed-up bytes after a wake: met" in text
    assert "NUMA: the host backend's backup store has no NUMA placement" in text
    doc = json.loads(out.read_text())["results"]
    for policy in host_policies.POLICIES:
        r = doc["policies"][policy]
        assert r["verified"] is True and r["policy"] == policy, r
        for key in ("first_sleep_s", "first_wake_s", "steady_sleep_s", "steady_wake_s", "unchanged_sleep_s"):
            assert isinstance(r[key], float) and r[key] > 0, (policy, key)
        assert r["host_after_sleep_bytes"] >= 4 << 20  # the spill file
        assert r["host_after_wake_fraction"] == 0.0  # the host backend keeps no backup after a wake
    rows, met = host_policies.policy_rows(doc["policies"])
    assert met is True and [r[0] for r in rows][-1] == "host memory after wake / backed up"


def test_the_release_goal_is_judged_on_the_released_policy_only():
    from unisleep.bench import host_policies

    rows, met = host_policies.policy_rows({"keep": {"host_after_wake_fraction": 1.0},
                                           "release": {"host_after_wake_fraction": 0.06}})
    assert met is False and rows[-1][1:] == [1.0, 0.06]
    assert host_policies.policy_rows({"keep": {}, "release": {"host_after_wake_fraction": 0.05}})[1] is True
