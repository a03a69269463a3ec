"""The embedded TorchGenerator on real host memory (memfd through MemoryLifecycle)."""

from __future__ import annotations

import math

import pytest
import torch

from unisleep.engines.base import Engine
from unisleep.engines.torch_generator import (
    TinyLM,
    TinyLMConfig,
    TorchGenerator,
    sequence_logprobs,
    top_p_filter,
)
from unisleep.errors import InvalidArgumentError, InvalidTransitionError, TransferError

PROMPTS = [[1, 2, 3, 4]] * 6 + [[5, 6]] * 3


@pytest.fixture
def engine(lifecycle):
    e = TorchGenerator(lifecycle=lifecycle, max_batch=8)
    yield e
    e.close()


def _trainer_score(model, gens):
    out = []
    for g in gens:
        lp = sequence_logprobs(model, torch.tensor([g.prompt_ids]), torch.tensor([g.token_ids]))
        out.append(lp[0].tolist())
    return out


def test_is_an_engine_on_lifecycle_memory(engine, lifecycle):
    assert isinstance(engine, Engine) and engine.kind == "torch"
    assert set(lifecycle.state()) == {"weights", "kv_cache"}
    names = set(lifecycle.names("weights"))
    assert names == set(engine.parameter_names())
    assert lifecycle.resident_bytes("weights") > 0 and lifecycle.resident_bytes("kv_cache") > 0
    assert not engine.is_sleeping() and engine.sleeping_tags() == set()


def test_raw_logprobs_match_the_trainers_full_forward(engine):
    trainer = TinyLM(TinyLMConfig())  # same seed -> same weights
    with torch.no_grad():
        for temperature in (0.0, 1.0):
            gens = engine.generate(PROMPTS, max_tokens=8, temperature=temperature, seed=3)
            assert [len(g.token_ids) for g in gens] == [8] * len(PROMPTS)
            ref = _trainer_score(trainer, gens)
            gap = max(abs(a - b) for g, r in zip(gens, ref) for a, b in zip(g.logprobs, r))
            assert gap < 1e-4  # cached incremental decode vs one full forward: kernel noise only
    # greedy: every token is the argmax of the trainer's distribution
    g = engine.generate([[1, 2, 3]], max_tokens=5)[0]
    with torch.no_grad():
        logits = trainer(torch.tensor([g.prompt_ids + g.token_ids]))[0, 2:-1]
    assert logits.argmax(-1).tolist() == g.token_ids


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROMPTS, max_tokens=6, temperature=1.0, seed=7)
    b = engine.generate(PROMPTS, max_tokens=6, temperature=1.0, seed=7)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_processed_logprobs_are_shifted_by_minus_log_kept_mass(lifecycle):
    eng = TorchGenerator(lifecycle=lifecycle, logprobs_mode="processed_logprobs")
    trainer = TinyLM(TinyLMConfig())
    gens = eng.generate(PROMPTS, max_tokens=6, temperature=1.0, top_p=0.9, seed=1)
    with torch.no_grad():
        for g in gens:
            lp, kept = sequence_logprobs(trainer, torch.tensor([g.prompt_ids]), torch.tensor([g.token_ids]),
                                         top_p=0.9, with_kept_mass=True)
            for e, t, k in zip(g.logprobs, lp[0].tolist(), kept[0].tolist()):
                assert 0.9 <= k <= 1.0
                assert e - t == pytest.approx(-math.log(k), abs=1e-4)


def test_top_p_filter_keeps_smallest_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked, kept = top_p_filter(logits, 0.75)
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    assert kept.item() == pytest.approx(0.8)


def test_sleep_frees_memory_and_refuses_to_touch_it(engine, lifecycle):
    before = engine.resident_bytes()
    engine.sleep(2)
    assert engine.resident_bytes() == 0 < before  # read from the backend (memfd blocks)
    assert engine.is_sleeping() and engine.sleeping_tags() == {"weights", "kv_cache"}
    with pytest.raises(InvalidTransitionError, match="SIGSEGV"):
        engine.generate([[1, 2]], max_tokens=2)
    with pytest.raises(InvalidTransitionError, match="asleep"):
        engine.start_weight_update()
    with pytest.raises(InvalidTransitionError):
        engine.score([[1, 2]], [[3]])
    engine.wake_up(["weights"])
    assert engine.sleeping_tags() == {"kv_cache"}
    with pytest.raises(InvalidTransitionError, match="kv_cache"):
        engine.generate([[1, 2]], max_tokens=2)  # weights awake, KV cache still asleep
    engine.wake_up()
    assert engine.resident_bytes() == before
    engine.generate([[1, 2]], max_tokens=2)


def test_level1_keeps_weights_and_generation_is_unchanged(engine):
    ref = engine.generate(PROMPTS, max_tokens=6)
    engine.sleep(1)
    assert engine.sleeping_tags() == {"weights", "kv_cache"}
    engine.wake_up()
    assert [g.token_ids for g in engine.generate(PROMPTS, max_tokens=6)] == [g.token_ids for g in ref]


def test_weight_update_in_place_changes_outputs(engine):
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    other = TinyLM(TinyLMConfig(seed=5))
    engine.load_weights(other.state_dict(), version="5")
    assert engine.weight_version() == "5"
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs  # no address moved
    gens = engine.generate(PROMPTS, max_tokens=6, temperature=1.0, seed=2)
    with torch.no_grad():
        ref = _trainer_score(other, gens)
    assert max(abs(a - b) for g, r in zip(gens, ref) for a, b in zip(g.logprobs, r)) < 1e-4


def test_incomplete_or_bad_updates_raise_transfer_error(engine):
    sd = TinyLM(TinyLMConfig(seed=9)).state_dict()
    engine.start_weight_update()
    engine.update_weights(list(sd.items())[:3])
    with pytest.raises(TransferError, match="incomplete"):
        engine.finish_weight_update("9")
    assert engine.weight_version() == "0"
    with pytest.raises(TransferError, match="unknown parameter"):
        engine.load_weights({"nope": torch.zeros(1)}, "x")
    name, t = next(iter(sd.items()))
    with pytest.raises(TransferError, match="shape"):
        engine.load_weights({name: torch.zeros(t.numel() + 1)}, "x")
    engine.load_weights(sd, "9")  # a later full update works
    assert engine.weight_version() == "9"


def test_pause_resume_and_bad_arguments(engine):
    engine.pause("wait")
    assert engine.is_paused()
    with pytest.raises(InvalidTransitionError, match="paused"):
        engine.generate([[1]], max_tokens=1)
    engine.resume()
    assert not engine.is_paused()
    with pytest.raises(InvalidArgumentError):
        engine.pause("later")
    with pytest.raises(InvalidArgumentError):
        engine.generate([[1] * 30], max_tokens=8)  # beyond max_len
    with pytest.raises(InvalidArgumentError):
        engine.generate([[999]], max_tokens=1)


def test_torn_weights_refuse_generation_scoring_and_resume_until_a_complete_update(engine, lifecycle):
    """An update that failed part-way with nothing to roll back to marks the engine's lifecycle
    torn (what WeightReceiver(guard=lifecycle) does): generate, score and the guarded loop's
    resume refuse with TornWeightsError naming the versions; a partial update does not clear
    it, a complete one does."""
    from unisleep.errors import TornWeightsError
    from unisleep.loop import Handoff

    ref = engine.generate(PROMPTS, max_tokens=6)
    lifecycle.mark_torn(version="2", previous="0", names=["head.weight"], why="the sender died",
                        needs=engine.parameter_names())
    for call in (lambda: engine.generate(PROMPTS, max_tokens=6),
                 lambda: engine.score([g.prompt_ids for g in ref[:1]], [g.token_ids for g in ref[:1]])):
        with pytest.raises(TornWeightsError) as ei:
            call()
        e = ei.value
        assert (e.version, e.previous, e.names) == ("2", "0", ["head.weight"])
        assert "version '2'" in str(e) and "Send a complete update" in str(e) and "the sender died" in str(e)
    engine.pause("wait")
    with pytest.raises(TornWeightsError):
        Handoff(engine).resume()
    assert engine.is_paused()  # refused before the engine was resumed
    engine.resume()
    sd = TinyLM(TinyLMConfig(seed=9)).state_dict()
    engine.start_weight_update()
    engine.update_weights(list(sd.items())[:3])
    with pytest.raises(TransferError, match="incomplete"):
        engine.finish_weight_update("3")
    with pytest.raises(TornWeightsError):
        engine.generate(PROMPTS, max_tokens=6)
    engine.load_weights(sd, "3")
    assert lifecycle.torn is None and engine.weight_version() == "3"
    assert len(engine.generate(PROMPTS, max_tokens=6)) == len(PROMPTS)


def test_a_guard_given_to_the_engine_is_asked_before_generating(engine, spill_dir):
    """guard_serving: a receiver or lifecycle that writes the engine's weights elsewhere (here a
    second lifecycle) is asked too; anything without check_serving() is refused."""
    from unisleep import MemoryLifecycle
    from unisleep.errors import TornWeightsError

    other = MemoryLifecycle("host", spill_dir=spill_dir)
    try:
        engine.guard_serving(other)
        engine.guard_serving(other)
        assert engine.serving_guards() == [other]
        engine.generate(PROMPTS, max_tokens=2)
        other.mark_torn(version=7, previous=6, names=["x"], why="a bucket failed its digest")
        with pytest.raises(TornWeightsError, match="version 7"):
            engine.generate(PROMPTS, max_tokens=2)
        other.clear_torn()
        engine.generate(PROMPTS, max_tokens=2)
        with pytest.raises(InvalidArgumentError, match="check_serving"):
            engine.guard_serving(object())
    finally:
        other.close()
