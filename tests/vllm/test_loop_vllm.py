"""The guarded RL step (:class:`unisleep.loop.Handoff`) against a real vLLM server, and
``unisleep demo --engine vllm`` end to end.

The Handoff tests reuse the session server of ``conftest.py`` (model A, bf16, the unisleep
transfer engine) through :class:`Spy`, the real HTTP adapter with a log of the verbs called on it.
The demo test starts its own server (float32, its own model directory); it is the first test of
this module, which sorts before every module that uses the session server (only
``test_api_key.py``, which also starts and stops its own, comes before it), so it runs before the
session server exists and the two never run at once.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from unisleep.engines.vllm_http import VLLMHTTPEngine
from unisleep.errors import InvalidTransitionError, TransferError
from unisleep.loop import Handoff

from _vllm_common import greedy, transfer_api_missing  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # a vLLM engine or server per session
              pytest.mark.skipif(transfer_api_missing() is not None,
                                 reason=str(transfer_api_missing()))]

SLEEP_L2 = {"awake": 0, "weights_offloaded": 0, "discard_all": 1}


# ---------------------------------------------------------------------- the demo (own server; first)
def test_demo_engine_vllm_end_to_end(tmp_path, capsys):
    from unisleep import demo

    out = tmp_path / "out"
    t0 = time.monotonic()
    rc = demo.main(["--engine", "vllm", "--steps", "3", "--batch", "16", "--out", str(out), "-q", "--no-plot"])
    wall = time.monotonic() - t0
    text = capsys.readouterr().out
    with open(out / "demo.json") as f:
        res = json.load(f)
    assert rc == 0 and res["ok"], text
    assert res["engine"] == "vllm" and res["failure"] is None
    checks = {c["name"]: c["ok"] for c in res["checks"]}
    assert checks == {"weights arrived": True, "weights changed": True, "version recorded": True,
                      "engine slept": True, "memory freed": None, "gap steady": True}, text
    mem = next(c for c in res["checks"] if c["name"] == "memory freed")
    assert "not observable on CPU" in mem["detail"] and "[SKIP] memory freed" in text
    steps = res["steps"]
    assert [s["version"] for s in steps] == ["1", "2", "3"]
    for s in steps:
        assert s["is_sleeping"] and s["sleep_gauge"] == SLEEP_L2
        assert sorted(s["reported_asleep"]) == ["kv_cache", "weights"]
        assert s["probe_gap"] <= demo.VLLM_PROBE_TOL < 10 * demo.VLLM_PROBE_TOL < s["stale_gap"]
        assert s["gap"] <= demo.VLLM_PROBE_TOL
        assert s["resident_before"] is None  # no memory figures over HTTP (CPU: sleep frees nothing)
    assert res["probe_gap_v0"] <= demo.VLLM_PROBE_TOL
    assert "greedy≠v0" in text and "demo: OK" in text  # the table was printed
    # the server it started was stopped, by PID
    pid = res["server"]["server_pid"]
    assert res["server"]["server_stopped"] is True
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert wall < 120, f"the demo took {wall:.0f} s"


# ---------------------------------------------------------------------- Handoff on the session server
class Spy(VLLMHTTPEngine):
    """The real HTTP adapter, recording the verbs in the order they are called."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []

    def pause(self, mode="abort"):
        self.calls.append(f"pause({mode})")
        return super().pause(mode)

    def resume(self):
        self.calls.append("resume")
        return super().resume()

    def sleep(self, level=1, mode="abort"):
        self.calls.append(f"sleep({level})")
        return super().sleep(level, mode)

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")
        return super().wake_up(tags)

    def start_weight_update(self):
        self.calls.append("start")
        return super().start_weight_update()

    def update_weights(self, update_info, **kw):
        self.calls.append("update")
        return super().update_weights(update_info, **kw)

    def finish_weight_update(self, version=None):
        self.calls.append(f"finish({version})")
        return super().finish_weight_update(version)

    def abort_weight_update(self):
        got = super().abort_weight_update()
        self.calls.append(f"abort->{got}")
        return got

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return super().reset_prefix_cache()


@pytest.fixture(scope="module")
def state_a():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=0)


@pytest.fixture(scope="module")
def state_b():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=1)


@pytest.fixture
def spy(http_engine):  # http_engine restores the server (awake, resumed, model A) afterwards
    eng = Spy(http_engine.base_url)
    yield eng
    eng.close()


@pytest.fixture
def pusher(spy):
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    p = VLLMWeightPusher(spy, timeout_s=60, path="collective").init()
    yield p
    p.close()


def test_handoff_step_changes_weights_to_b_and_back_to_a(spy, pusher, tiny_models, baseline_a, state_a,
                                                          state_b):
    spy.reload_weights(tiny_models[1])
    want_b = greedy(spy)
    spy.reload_weights(tiny_models[0])
    assert want_b != baseline_a and greedy(spy) == baseline_a

    h = Handoff(spy, pause_mode="wait")
    seen = []

    def train():  # while the trainer runs, the engine reports sleeping (and not merely paused)
        seen.append((spy.is_sleeping(), spy.sleep_state()))

    spy.calls.clear()
    rep = h.step(train, lambda e: pusher.send(state_b.items(), "B-1", chunks=2), version="B-1", level=2)
    assert seen == [(True, SLEEP_L2)]
    assert spy.calls == ["pause(wait)", "sleep(2)", "wake_up(weights)", "start", "update", "update",
                         "finish(B-1)", "wake_up(kv_cache)", "reset_prefix_cache", "resume"]
    assert rep.completed and rep.version == "B-1" and rep.reported_asleep == ["kv_cache", "weights"]
    assert rep.resident_before is None  # vLLM over HTTP reports no memory figures
    assert spy.weight_version() == "B-1" and not spy.is_sleeping() and not spy.is_paused()
    assert greedy(spy) == want_b  # the engine computes with model B's weights

    rep = h.step(lambda: None, lambda e: pusher.send(state_a.items(), "A-2"), version="A-2", level=1)
    assert rep.completed and spy.weight_version() == "A-2"
    assert greedy(spy) == baseline_a  # and exactly A's again


def test_handoff_refuses_to_send_into_a_sleeping_engine(spy, pusher, baseline_a, state_b):
    h = Handoff(spy)
    h.release(level=2)
    v0 = spy.weight_version()
    sent = []

    def send(e):
        sent.append(1)
        return pusher.send(state_b.items(), "B-asleep")

    spy.calls.clear()
    with pytest.raises(InvalidTransitionError, match="refusing to send weights"):
        h.transfer(send, "B-asleep")
    assert sent == [] and spy.calls == []  # raised before start_weight_update: no byte moved
    assert spy.is_sleeping() and spy.sleep_state() == SLEEP_L2 and spy.weight_version() == v0

    # a sleep some other client caused: this adapter cannot tell which tags sleep -> refused too
    h.wake_weights()
    h.wake_kv_cache()
    h.resume()
    other = VLLMHTTPEngine(spy.base_url)
    other.sleep(1)
    spy.forget_state()
    with pytest.raises(InvalidTransitionError, match="refusing to send weights"):
        h.transfer(send, "B-asleep")
    assert sent == [] and spy.weight_version() == v0
    other.wake_up()
    other.close()
    assert greedy(spy) == baseline_a

    # nothing was left open in the engine: the next guarded step goes through
    h.release(level=2)
    h.reacquire(send, version="B-2")
    assert sent == [1] and spy.weight_version() == "B-2" and greedy(spy) != baseline_a


@pytest.mark.parametrize("staging", ["none", "host"])
def test_incomplete_update_refused_and_the_session_closed(spy, baseline_a, state_a, state_b, staging):
    """The guarded step aborts an incomplete update (never finished, no session left open, the KV
    cache still asleep).  Streaming (the default) had loaded its buckets as they came: the error
    says the weights are torn and the next full update repairs them; with staging="host" (the
    opt-in) the old weights are untouched."""
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    pusher = VLLMWeightPusher(spy, timeout_s=60, path="collective", staging=staging).init()
    try:
        h = Handoff(spy)
        h.release(level=2)
        partial = [(n, t) for n, t in state_b.items() if "layers.1." not in n]
        spy.calls.clear()
        with pytest.raises(TransferError, match="incomplete update") as ei:
            h.reacquire(lambda e: pusher.send(partial, "B-partial"), version="B-partial")
        assert "no update session left open" in str(ei.value)
        assert ("torn" in str(ei.value)) == (staging == "none")
        assert spy.calls == ["wake_up(weights)", "start", "update", "abort->True"]  # never finished
        assert spy.weight_version() != "B-partial"
        assert spy.is_sleeping() and spy.sleeping_tags() == {"kv_cache"}  # paused, KV cache still asleep
        h.wake_kv_cache()
        h.reset_prefix_cache()
        h.resume()
        if staging == "host":
            assert greedy(spy) == baseline_a  # the old weights, untouched

        h.release(level=2)  # and the next full update is accepted (and repairs torn weights)
        h.reacquire(lambda e: pusher.send(state_a.items(), f"A-after-{staging}"), version=f"A-after-{staging}")
        assert spy.weight_version() == f"A-after-{staging}" and greedy(spy) == baseline_a
    finally:
        pusher.close()


def test_a_send_that_dies_after_start_is_aborted_and_does_not_block_the_next(spy, pusher, baseline_a,
                                                                             state_b):
    """start_weight_update went through, then the trainer side failed before any chunk: without the
    abort vLLM would keep the session open and refuse every later start ("already active")."""
    h = Handoff(spy)
    h.release(level=2)

    def dies(e):
        raise ConnectionError("trainer went away")

    spy.calls.clear()
    with pytest.raises(TransferError, match="trainer went away"):
        h.reacquire(dies, version="never")
    assert spy.calls == ["wake_up(weights)", "start", "abort->True"]
    assert spy.weight_version() != "never"
    h.reacquire(lambda e: pusher.send(state_b.items(), "B-3"), version="B-3")
    assert spy.weight_version() == "B-3" and not spy.is_sleeping()
    assert greedy(spy) != baseline_a
