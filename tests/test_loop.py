"""The guarded order on the real TorchGenerator (memfd memory through MemoryLifecycle)."""

from __future__ import annotations

import warnings

import pytest
import torch

from unisleep.engines.torch_generator import TinyLM, TinyLMConfig, TorchGenerator, sequence_logprobs
from unisleep.errors import EngineError, InvalidArgumentError, InvalidTransitionError, TransferError
from unisleep.loop import Handoff, SpeculationWarning

PROMPTS = [[1, 2, 3, 4]] * 8


class Recording(TorchGenerator):
    """The real engine, with a log of the verbs called on it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []

    def _rec(self, name, fn, *a):
        self.calls.append(name)
        return fn(*a)

    def pause(self, mode="abort"):
        return self._rec("pause", super().pause, mode)

    def resume(self):
        return self._rec("resume", super().resume)

    def sleep(self, level=1):
        return self._rec(f"sleep({level})", super().sleep, level)

    def wake_up(self, tags=None):
        return self._rec(f"wake_up({','.join(tags) if tags else 'all'})", super().wake_up, tags)

    def start_weight_update(self):
        return self._rec("start", super().start_weight_update)

    def update_weights(self, info):
        return self._rec("update", super().update_weights, info)

    def finish_weight_update(self, version=None):
        return self._rec("finish", super().finish_weight_update, version)

    def reset_prefix_cache(self):
        return self._rec("reset_prefix_cache", super().reset_prefix_cache)


@pytest.fixture
def engine(lifecycle):
    e = Recording(lifecycle=lifecycle, max_batch=8)
    yield e
    e.close()


def _trained(seed=0, steps=3):
    """A trainer's model after a few real optimizer steps (weights differ from the engine's)."""
    model = TinyLM(TinyLMConfig(seed=seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    p = torch.tensor(PROMPTS)
    c = torch.full((len(PROMPTS), 4), 7)
    for _ in range(steps):
        loss = -sequence_logprobs(model, p, c).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _send(model):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return lambda eng: eng.update_weights(sd.items())


def test_release_frees_resident_bytes_and_reacquire_delivers_new_weights(engine, lifecycle):
    h = Handoff(engine)
    before = lifecycle.resident_bytes()
    rep = h.release(level=2)
    assert lifecycle.resident_bytes() == 0  # read from the backend, not bookkeeping
    assert rep.resident_before == before and rep.resident_asleep == 0 and rep.bytes_released == before
    assert rep.reported_asleep == ["kv_cache", "weights"]

    trainer = _trained()
    rep = h.reacquire(_send(trainer), version=1)
    assert rep.completed and rep.version == "1" and engine.weight_version() == "1"
    assert rep.resident_after == before and not engine.is_sleeping() and not engine.is_paused()
    assert rep.handoff_s > 0 and rep.transfer_s > 0 and {"sleep", "wake_weights", "send", "wake_kv"} <= set(rep.timings)

    gens = engine.generate(PROMPTS, max_tokens=4, temperature=1.0, seed=0)
    with torch.no_grad():
        ref = sequence_logprobs(trainer, torch.tensor(PROMPTS), torch.tensor([g.token_ids for g in gens]))
    got = torch.tensor([g.logprobs for g in gens])
    assert (got - ref).abs().max() < 1e-4  # the engine now samples the trainer's policy
    # and the trained policy really moved towards token 7 (outputs changed as the trainer's did)
    assert sum(t == 7 for g in gens for t in g.token_ids) > 8


def test_guarded_order(engine):
    h = Handoff(engine)
    h.step(lambda: None, _send(_trained(steps=1)), version="v1", level=2)
    assert engine.calls == [
        "pause", "sleep(2)", "wake_up(weights)", "start", "update", "finish",
        "wake_up(kv_cache)", "reset_prefix_cache", "resume",
    ]
    assert [r.version for r in h.history] == ["v1"]


def test_refuses_to_send_weights_into_a_sleeping_engine(engine, lifecycle):
    h = Handoff(engine)
    h.release(level=2)
    sent = []
    with pytest.raises(InvalidTransitionError, match="nothing was sent"):
        h.transfer(lambda eng: sent.append(1), version=2)
    assert sent == [] and "start" not in engine.calls  # raised before anything moved
    assert lifecycle.resident_bytes() == 0 and engine.sleeping_tags() == {"weights", "kv_cache"}
    h.reacquire(_send(_trained(steps=1)), version=2)  # the proper order still works afterwards
    assert engine.weight_version() == "2"


class DoesNotSleep(TorchGenerator):
    def sleep(self, level=1):  # accepts the call, releases nothing
        pass


class KeepsWeights(TorchGenerator):
    def sleep(self, level=1):  # releases only the KV cache, reports it truthfully
        self.lifecycle.discard(["kv_cache"])


class WakeDoesNothing(TorchGenerator):
    def wake_up(self, tags=None):
        pass


def test_an_engine_that_does_not_sleep_is_caught(lifecycle):
    eng = DoesNotSleep(lifecycle=lifecycle)
    with pytest.raises(EngineError, match="reports it is awake"):
        Handoff(eng).release(level=2)


def test_an_engine_that_releases_only_part_is_caught(lifecycle):
    eng = KeepsWeights(lifecycle=lifecycle)
    with pytest.raises(EngineError, match="only partly released"):
        Handoff(eng).release(level=2)


def test_a_wake_that_did_not_happen_is_caught_before_sending(lifecycle):
    eng = WakeDoesNothing(lifecycle=lifecycle)
    h = Handoff(eng)
    h.release(level=2)
    sent = []
    # the handoff asked for a wake; the engine still REPORTS its weights asleep -> no transfer
    with pytest.raises(EngineError, match="still reports its weights asleep"):
        h.reacquire(lambda e: sent.append(1), version=1)
    assert sent == [] and lifecycle.resident_bytes() == 0


def test_incomplete_update_raises_transfer_error_and_stays_paused(engine):
    h = Handoff(engine)
    h.release(level=2)
    sd = list(_trained(steps=1).state_dict().items())
    with pytest.raises(TransferError, match="incomplete") as ei:
        h.reacquire(lambda eng: eng.update_weights(sd[:2]), version=3)
    assert "re-send the full set" in str(ei.value)
    assert engine.weight_version() == "0" and engine.is_paused()
    assert engine.sleeping_tags() == {"kv_cache"}  # never woke the KV cache for a broken model
    with pytest.raises(InvalidTransitionError):
        engine.generate(PROMPTS, max_tokens=1)
    h.reacquire(lambda eng: eng.update_weights(sd), version=3)  # a full retry completes the step
    assert engine.weight_version() == "3" and not engine.is_sleeping()


def test_sender_failure_is_a_transfer_error(engine):
    h = Handoff(engine)
    h.release(level=2)

    def boom(eng):
        raise ConnectionError("trainer went away")

    with pytest.raises(TransferError, match="trainer went away"):
        h.reacquire(boom, version=4)
    h.reacquire(_send(_trained(steps=1)), version=4)  # the aborted update does not block a retry


def test_level_rules(engine, lifecycle):
    h = Handoff(engine)
    ref = engine.generate(PROMPTS, max_tokens=4)
    h.release(level=1)
    with pytest.raises(InvalidTransitionError, match="already reports sleeping"):
        h.release(level=1)
    h.reacquire(None)  # level 1 kept the weights: no transfer needed
    assert [g.token_ids for g in engine.generate(PROMPTS, max_tokens=4)] == [g.token_ids for g in ref]
    h.release(level=2)
    with pytest.raises(InvalidArgumentError, match="needs send_weights"):
        h.reacquire(None)
    with pytest.raises(InvalidArgumentError):
        h.release(level=3)


class Speculative(TorchGenerator):
    """Reports a draft model and an acceptance counter (set by the test)."""

    acceptance = 0.9
    reloads = 0

    def has_draft_model(self):
        return True

    def reload_draft(self):
        self.reloads += 1

    def spec_acceptance(self):
        return self.acceptance


@pytest.mark.slow
def test_draft_reload_and_acceptance_collapse_warning(lifecycle):
    eng = Speculative(lifecycle=lifecycle)
    h = Handoff(eng, min_acceptance=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.step(lambda: None, _send(_trained(steps=1)), version=1)
    assert eng.reloads == 1 and h.history[-1].spec_acceptance == 0.9
    eng.acceptance = 0.02
    with pytest.warns(SpeculationWarning, match="draft was probably not reloaded"):
        rep = h.step(lambda: None, _send(_trained(steps=1)), version=2)
    assert eng.reloads == 2 and rep.warnings and rep.spec_acceptance == 0.02


def test_draft_is_not_reloaded_after_a_level1_release(lifecycle):
    """Level 1 keeps the draft (it sleeps with the weights): only a level-2 release reloads it;
    the acceptance is read either way."""
    eng = Speculative(lifecycle=lifecycle)
    h = Handoff(eng, min_acceptance=0.3)
    h.step(lambda: None, _send(_trained(steps=1)), version=1, level=1)
    assert eng.reloads == 0 and h.history[-1].spec_acceptance == 0.9
    h.step(lambda: None, _send(_trained(steps=1)), version=2, level=2)
    assert eng.reloads == 1


class NoTagReport(TorchGenerator):
    def sleeping_tags(self):  # like vLLM's /is_sleeping: one boolean
        return None


def test_engine_without_per_tag_state_is_woken_fully_before_sending(lifecycle):
    eng = NoTagReport(lifecycle=lifecycle)
    h = Handoff(eng)
    h.release(level=2)
    seen = []
    h.reacquire(lambda e: (seen.append(e.lifecycle.state()), e.update_weights(_trained(steps=1).state_dict().items())),
                version=1)
    assert seen == [{"weights": "awake", "kv_cache": "awake"}]


def test_base_engine_defaults_keep_old_engines_working():
    """resident_bytes() and abort_weight_update() are optional: the defaults say "cannot tell"."""
    from unisleep.engines.base import Engine

    class Minimal(Engine):  # implements only the abstract verbs, as engines written before did
        def generate(self, prompts, **kw): return []
        def pause(self, mode="abort"): pass
        def resume(self): pass
        def sleep(self, level=1): pass
        def wake_up(self, tags=None): pass
        def is_sleeping(self): return False
        def weight_version(self): return "0"
        def set_weight_version(self, version): pass

    m = Minimal()
    assert m.resident_bytes() is None and m.abort_weight_update() is False
    assert Handoff(m).resident_bytes() is None


class CannotTellMemory(Recording):
    """An engine that reports no memory figures (as vLLM over HTTP)."""

    def resident_bytes(self, tag=None):
        return None


def test_engine_that_cannot_tell_its_memory_skips_the_memory_check(lifecycle):
    eng = CannotTellMemory(lifecycle=lifecycle, max_batch=8)
    try:
        h = Handoff(eng)
        rep = h.release(level=2)
        assert rep.resident_before is None and rep.resident_asleep is None and rep.bytes_released is None
        h.reacquire(_send(_trained(steps=1)), version=1)
        assert eng.weight_version() == "1" and not eng.is_sleeping()
    finally:
        eng.close()


class VLLMKind(Recording):
    """kind 'vllm-…' with an abort that confirms the session is closed (as the unisleep transfer
    engine answers through the vLLM adapters)."""

    kind = "vllm-fake"

    def abort_weight_update(self):
        self.calls.append("abort")
        super().abort_weight_update()
        return True


def test_failed_send_aborts_and_the_advice_follows_the_engines_answer(lifecycle):
    eng = VLLMKind(lifecycle=lifecycle, max_batch=8)
    try:
        h = Handoff(eng)
        h.release(level=2)

        def boom(e):
            raise ConnectionError("trainer went away")

        with pytest.raises(TransferError) as ei:
            h.reacquire(boom, version=2)
        assert eng.calls[-1] == "abort"
        assert "no update session left open" in str(ei.value) and "must be restarted" in str(ei.value)
        h.reacquire(_send(_trained(steps=1)), version=2)
        assert eng.weight_version() == "2"
    finally:
        eng.close()


class SleepingOnlyByPause(TorchGenerator):
    """Like vLLM's /is_sleeping: true while merely paused; its sleep releases nothing."""

    def sleep(self, level=1):
        pass

    def is_sleeping(self):
        return self.is_paused() or super().is_sleeping()


def test_an_engine_sleeping_only_by_pause_is_caught(lifecycle):
    eng = SleepingOnlyByPause(lifecycle=lifecycle)
    try:
        with pytest.raises(EngineError, match="reports no memory asleep .* nothing was released"):
            Handoff(eng).release(level=2)
    finally:
        eng.close()
