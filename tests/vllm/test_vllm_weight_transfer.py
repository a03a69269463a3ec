"""vLLM's init/start/update/finish protocol through unisleep's weight-transfer engine (gloo on
CPU), over HTTP against the session server and in process."""

from __future__ import annotations

import os

import pytest

from unisleep.errors import InvalidTransitionError, TransferError

from _vllm_common import PROMPTS, greedy, transfer_api_missing  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # a vLLM engine or server per session
              pytest.mark.skipif(transfer_api_missing() is not None,
                                 reason=str(transfer_api_missing()))]



@pytest.fixture(scope="module")
def state_b():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=1)


@pytest.fixture(scope="module")
def state_a():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=0)


@pytest.fixture(params=["auto", "collective"])
def pusher(http_engine, request):
    """auto = IPC through a shared fd when colocated on host; collective = gloo."""
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    p = VLLMWeightPusher(http_engine, timeout_s=60, path=request.param).init()
    yield p
    p.close()


def test_push_over_http_changes_and_restores(http_engine, pusher, tiny_models, baseline_a,
                                             state_a, state_b):
    http_engine.reload_weights(tiny_models[1])
    want_b = greedy(http_engine)
    http_engine.reload_weights(tiny_models[0])
    assert want_b != baseline_a

    http_engine.pause()
    rep = pusher.push(state_b.items(), version="B-1", chunks=2)
    http_engine.resume()
    assert rep.tensors == len(state_b) and rep.chunks == 2
    assert http_engine.weight_version() == "B-1"
    assert greedy(http_engine) == want_b

    pusher.push(state_a.items(), version="A-2")
    assert greedy(http_engine) == baseline_a and http_engine.weight_version() == "A-2"


def test_lazy_push_reads_the_generator_as_it_sends(http_engine, pusher, tiny_models, baseline_a, state_a, state_b):
    """``push(..., specs=)``: the tensors come from a generator read while the update streams (one
    ``/update_weights`` call), so the caller never holds the model whole; a generator that strays
    from its specs is refused and the next complete update serves exactly."""
    http_engine.reload_weights(tiny_models[1])
    want_b = greedy(http_engine)
    http_engine.reload_weights(tiny_models[0])
    specs = [(n, tuple(t.shape), t.dtype) for n, t in state_b.items()]
    handed: list = []

    def lazy(state):
        for n, t in state.items():
            handed.append(n)
            yield n, t

    rep = pusher.push(lazy(state_b), version="B-lazy", specs=specs)
    assert handed == list(state_b) and rep.tensors == len(state_b) and rep.chunks == 1
    assert rep.nbytes == sum(t.numel() * t.element_size() for t in state_b.values())
    assert greedy(http_engine) == want_b and http_engine.weight_version() == "B-lazy"

    def strays():
        for i, (n, t) in enumerate(state_a.items()):
            yield (n + ".renamed" if i == 3 else n), t

    with pytest.raises(TransferError):
        pusher.push(strays(), version="A-strays", specs=[(n, tuple(t.shape), t.dtype) for n, t in state_a.items()])
    assert http_engine.weight_version() != "A-strays"
    pusher.push(state_a.items(), version="A-after-strays")
    assert greedy(http_engine) == baseline_a


def test_incomplete_update_refused_and_a_complete_one_repairs(http_engine, pusher, baseline_a,
                                                              state_a, state_b):
    """Streaming (the default): the buckets went into the model as they came, so an incomplete
    update is refused at its end with the weights torn (the message says so); the engine stays
    usable and the next complete update serves exactly."""
    partial = [(n, t) for n, t in state_b.items() if "layers.1." not in n]
    with pytest.raises(TransferError, match="incomplete update.*torn"):
        pusher.push(partial, version="B-partial")
    assert http_engine.weight_version() != "B-partial"
    pusher.push(state_a.items(), version="A-after-refusal")
    assert greedy(http_engine) == baseline_a


def test_host_staging_refuses_an_incomplete_update_untouched(http_engine, baseline_a, state_b):
    """``staging="host"`` (opt-in): nothing is applied before the whole update has arrived, so an
    incomplete one leaves the served weights exactly as they were."""
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    with VLLMWeightPusher(http_engine, timeout_s=60, staging="host") as p:
        partial = [(n, t) for n, t in state_b.items() if "layers.1." not in n]
        with pytest.raises(TransferError, match="incomplete update"):
            p.push(partial, version="B-partial-staged")
        assert greedy(http_engine) == baseline_a                 # nothing was applied
        assert http_engine.weight_version() != "B-partial-staged"


def test_wrong_shape_refused(http_engine, pusher, baseline_a, state_b):
    bad = dict(state_b)
    name = next(n for n in bad if n.endswith("embed_tokens.weight"))
    bad[name] = bad[name][:-1].clone()
    with pytest.raises(TransferError, match="wrong shape"):
        pusher.push(bad.items(), version="bad-shape")
    assert greedy(http_engine) == baseline_a


def test_transfer_refused_while_asleep(http_engine, pusher, baseline_a, state_b):
    http_engine.pause()
    http_engine.sleep(1)
    with pytest.raises(InvalidTransitionError, match="wake the weights first"):
        pusher.push(state_b.items(), version="B-asleep")
    http_engine.wake_up()
    http_engine.resume()
    assert greedy(http_engine) == baseline_a
    assert http_engine.weight_version() != "B-asleep"


def test_push_in_process(vllm_inprocess, state_a, state_b):
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    eng = vllm_inprocess
    base = greedy(eng)
    with VLLMWeightPusher(eng, timeout_s=60) as p:
        eng.sleep(1)
        with pytest.raises(InvalidTransitionError):
            p.push(state_b.items(), version="B")
        assert eng.wake_up(["weights"]) is False
        assert eng.sleeping_tags() == {"kv_cache"}
        p.push(state_b.items(), version="B")                # weights awake: allowed
        assert eng.wake_up(["kv_cache"]) is True
        assert eng.weight_version() == "B"
        out_b = greedy(eng)
        assert out_b != base
        p.push(state_a.items(), version="A")
        assert greedy(eng) == base


def test_the_engine_gets_a_secret_file_never_the_secret(http_engine, state_a, baseline_a):
    """The group is authenticated: the engine is handed the path of a 0600 file, the update still
    lands, and the file goes when the pusher closes."""
    import os
    import stat

    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    p = VLLMWeightPusher(http_engine, timeout_s=60).init()
    try:
        info = p.init_info()
        path = info["secret_file"]
        assert path and os.path.isfile(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        secret = open(path).read().strip()
        assert len(secret) == 64 and secret not in repr(info) and secret not in repr(p.group)
        p.push(state_a.items(), version="A-secret")
        assert greedy(http_engine) == baseline_a and http_engine.weight_version() == "A-secret"
    finally:
        p.close()
    assert not os.path.exists(path)


def test_memory_figures_need_no_insecure_serialization():
    """vLLM workers get a method by name for their allocator figures (nothing pickled over ZMQ)."""
    from unisleep.vllm_worker.methods import WORKER_RESIDENT_BYTES, register_worker_methods

    assert register_worker_methods() == "registered"
    from vllm.v1.worker.worker_base import WorkerBase

    assert callable(getattr(WorkerBase, WORKER_RESIDENT_BYTES))
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
