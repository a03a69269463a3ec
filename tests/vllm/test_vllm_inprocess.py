"""The in-process adapter (vllm.LLM, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

from __future__ import annotations

import pytest

from unisleep.errors import EngineError, InvalidTransitionError

from _vllm_common import PROMPTS, greedy  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine or server per session



def test_inprocess_verbs(vllm_inprocess, tiny_models):
    eng = vllm_inprocess
    a, b = tiny_models
    base = greedy(eng)
    gens = eng.generate(PROMPTS, max_tokens=12)
    assert all(len(g.logprobs) == len(g.token_ids) for g in gens)
    assert greedy(eng) == base

    eng.pause()                                  # offline pause = sleep(level=0)
    assert eng.is_paused() and eng.is_sleeping()
    assert eng.sleeping_tags() == set()
    eng.resume()                                 # = wake_up(["scheduling"])
    assert not eng.is_paused() and not eng.is_sleeping()

    eng.sleep(2)
    assert eng.sleeping_tags() == {"weights", "kv_cache"}   # read from the executor
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        eng.reload_weights(b)
    assert eng.wake_up(["weights"]) is False
    eng.reload_weights(b)                         # the order after a level-2 sleep
    assert eng.wake_up(["kv_cache"]) is True
    assert greedy(eng) != base
    eng.reload_weights(a)
    assert greedy(eng) == base

    assert eng.reset_prefix_cache() is True
    eng.set_weight_version("v7")
    assert eng.weight_version() == "v7"
    assert eng.collective_rpc("check_health") == [None]
    with pytest.raises(EngineError, match="no_such_method"):
        eng.collective_rpc("no_such_method")


def test_inprocess_generation_refuses_while_a_guard_is_torn(vllm_inprocess, tmp_path):
    """A lifecycle marked torn (what a receiver guarded by it does when an update fails part-way
    with nothing to roll back to), given to the adapter: generate refuses before vLLM runs."""
    from unisleep import MemoryLifecycle
    from unisleep.errors import TornWeightsError

    eng = vllm_inprocess
    base = greedy(eng)
    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    eng.guard_serving(lc)
    try:
        lc.mark_torn(version=5, previous=4, names=["lm_head.weight"], why="the sender died")
        with pytest.raises(TornWeightsError) as ei:
            eng.generate(PROMPTS, max_tokens=4)
        assert ei.value.version == 5 and ei.value.previous == 4 and "Send a complete update" in str(ei.value)
        lc.clear_torn()
        assert greedy(eng) == base
    finally:
        eng.unguard_serving(lc)
        lc.close()
    assert eng.serving_guards() == []
