"""A budgeted release (``Handoff.release(free_at_least=)``) on the real TorchGenerator (memfd
memory through MemoryLifecycle): the engine frees what the trainer asks, KV cache first, keeps
the rest resident, and the guarded order holds."""

from __future__ import annotations

import pytest
import torch

from unisleep.engines.torch_generator import sequence_logprobs
from unisleep.errors import SleepBudgetError, UnsupportedError
from unisleep.loop import Handoff

from test_loop import PROMPTS, Recording, _send, _trained


@pytest.fixture
def engine(lifecycle):
    e = Recording(lifecycle=lifecycle, max_batch=8)
    yield e
    e.close()


def test_kv_cache_first_weights_stay_resident(engine, lifecycle):
    h = Handoff(engine)
    kv = lifecycle.resident_bytes("kv_cache")
    w = lifecycle.resident_bytes("weights")
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    rep = h.release(level=1, free_at_least=kv // 2)
    assert rep.free_at_least == kv // 2 and rep.bytes_released == kv
    assert [m["tag"] for m in rep.budget["moved"]] == ["kv_cache"]
    assert lifecycle.state() == {"weights": "awake", "kv_cache": "discarded"}
    assert lifecycle.resident_bytes("weights") == w
    assert rep.reported_asleep == ["kv_cache"]
    trainer = _trained()
    rep = h.reacquire(_send(trainer), version=1)  # the weights never slept: sent at once
    assert rep.completed and engine.weight_version() == "1" and not engine.is_sleeping()
    assert "wake_weights" not in rep.timings
    assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
    gens = engine.generate(PROMPTS, max_tokens=4, temperature=1.0, seed=0)
    with torch.no_grad():
        ref = sequence_logprobs(trainer, torch.tensor(PROMPTS), torch.tensor([g.token_ids for g in gens]))
    assert (torch.tensor([g.logprobs for g in gens]) - ref).abs().max() < 1e-4


def test_the_trainer_asks_and_more_than_the_kv_cache_takes_the_weights(engine, lifecycle):
    h = Handoff(engine)
    kv = lifecycle.resident_bytes("kv_cache")
    asked = []

    def trainer_needs():
        asked.append(True)
        return kv + 1

    rep = h.release(level=2, free_at_least=trainer_needs)
    assert asked and rep.bytes_released >= kv + 1
    assert [m["tag"] for m in rep.budget["moved"]] == ["kv_cache", "weights"]
    assert engine.calls == ["pause"]  # the budgeted sleep is sleep_to_free, not sleep(level)
    rep = h.reacquire(_send(_trained(steps=1)), version="v1")
    assert rep.completed and not engine.is_sleeping() and engine.weight_version() == "v1"


def test_refusals_before_the_engine_is_paused(engine, lifecycle):
    h = Handoff(engine)
    with pytest.raises(SleepBudgetError):
        h.release(level=1, free_at_least=lifecycle.resident_bytes() + 1)
    with pytest.raises(ValueError):
        h.release(level=1, free_at_least=-1)
    assert engine.calls == [] and not engine.is_paused() and not engine.is_sleeping()

    class NoBudget(Recording):  # an engine whose sleep frees all of a level (as vLLM's)
        def can_sleep_to_free(self):
            return False

    engine.__class__ = NoBudget
    with pytest.raises(UnsupportedError):
        Handoff(engine).release(level=1, free_at_least=1)
    assert engine.calls == [] and not engine.is_paused()


@pytest.mark.slow  # a real `unisleep demo` process (its trainer in another process)
def test_the_demo_option(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "UNISLEEP_PLATFORM"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    bad = subprocess.run([sys.executable, "-m", "unisleep", "demo", "--free-at-least", "1", "--engine", "vllm",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--free-at-least runs on the embedded engine" in bad.stderr
    assert not (tmp_path / "bad").exists()
    p = subprocess.run([sys.executable, "-m", "unisleep", "demo", "--steps", "2", "--level", "1", "--free-at-least",
                        "0.5", "--no-plot", "-q", "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "demo.json").read_text())
    steps = doc["steps"]
    assert all(s["free_at_least"] == 1 << 19 and s["released"] >= 1 << 19 for s in steps)
    assert steps[0]["budget"]["moved"][0]["tag"] == "kv_cache" and steps[0]["budget"]["stayed"]
