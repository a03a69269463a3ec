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
