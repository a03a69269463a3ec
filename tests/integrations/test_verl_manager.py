"""unisleep's checkpoint engine inside verl's own weight-sync flow, on a local Ray cluster (CPU):
verl 0.9.1's ``CheckpointEngineManager.update_weights`` drives verl's actor worker
(``ActorRolloutRefWorker.update_weights`` / ``execute_checkpoint_engine``) and two rollout
replicas of verl's ``CheckpointEngineWorker`` with verl's vLLM ``ServerAdapter``, which hands
the tensors to verl's ``BucketedWeightReceiver`` over its ZeroMQ socket and shared memory — with
``checkpoint_engine.backend=unisleep``.  Three syncs: good, one whose trainer fails part-way,
good again.

What verl cannot run on a CPU, and what stands in (tests/integrations/_verl_ray.py says more):
verl's FSDP training engine (a generator of a small model's tensors: ``get_per_tensor_param``),
verl's vLLM server ``vLLMHttpServer`` (a Ray actor that runs verl's receiver and keeps a digest
of what arrived; vLLM's CPU build cannot serve within this test's time on two cores), and the
accelerator platform verl expects (a CPU platform registered through verl's ``PlatformRegistry``).
verl 0.9.1 is installed in .venv-vllm024 by ``make test``, which runs this file there
(tests/vllm/test_vllm_other_versions.py)."""

from __future__ import annotations

import os
import sys
import time

import pytest

verl = pytest.importorskip(
    "verl", reason="verl is not installed here: make test installs verl 0.9.1 in .venv-vllm024 and "
                   "runs this file there (tests/vllm/test_vllm_other_versions.py)")
ray = pytest.importorskip("ray")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ["VERL_PLATFORM"] = "cpu"      # the CPU platform _verl_ray registers with verl
import _verl_ray as R  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
TIMEOUT_S = 20.0   # the engine's liveness window (engine_kwargs.unisleep.timeout_s)


@pytest.fixture(scope="module")
def cluster():
    R.worker_setup()
    env = {"PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
           "VERL_PLATFORM": "cpu", "UNISLEEP_PLATFORM": "host", "VERL_LOGGING_LEVEL": "INFO"}
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": env, "worker_process_setup_hook": "_verl_ray.worker_setup"})
    try:
        yield
    finally:
        ray.shutdown()


def _configs():
    from omegaconf import OmegaConf
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    ce = {"backend": "unisleep", "custom_backend_module": R.BACKEND_MODULE,
          "update_weights_bucket_megabytes": 1,   # 1 MiB buckets: a sync is several chunks
          "engine_kwargs": {"unisleep": {"timeout_s": TIMEOUT_S}}}
    rollout = RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=1,
                            checkpoint_engine=CheckpointEngineConfig(**ce))
    actor = OmegaConf.create({"rollout": {"name": "vllm", "free_cache_engine": True, "checkpoint_engine": ce}})
    return rollout, actor, CheckpointEngineConfig(**ce)


def test_verls_manager_syncs_through_unisleep_and_survives_a_failed_sync(cluster):
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from unisleep.errors import TransferError

    rollout_cfg, actor_cfg, ce_cfg = _configs()
    actor_wg = RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix="trainer"),
                              ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(R.trainer_worker_cls()),
                                                                     config=actor_cfg),
                              use_gpu=False, device_name="cpu")
    Replica = R.replica_cls()
    replicas = []
    for i in range(2):
        rep = Replica(replica_rank=i, config=rollout_cfg, model_config=None, gpus_per_node=1)
        import asyncio

        asyncio.run(rep.init_colocated(RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix=f"rollout{i}")))
        replicas.append(rep)
    servers = [rep.servers[0] for rep in replicas]
    manager = CheckpointEngineManager(config=ce_cfg, actor_wg=actor_wg, replicas=replicas)
    full = ["abort_all_requests", "release_kv_cache", "update_weights_from_ipc", "clear_kv_cache"]

    # sync 1: the whole model reaches both rollouts' inference-worker side, verified, in verl's order
    actor_wg.train_step(1)
    metrics = manager.update_weights(global_steps=1)
    assert metrics["unisleep/chunks"] >= 2 and metrics["unisleep/transfer_gbps"] > 0, metrics
    want = R.digest(R.make_state(1).items())
    for s in servers:
        st = ray.get(s.state.remote())
        assert st["weights"] == want
        assert st["calls"] == full + ["set_global_steps:1", "resume_kv_cache", "resume_generation"], st["calls"]
    assert R.rollout_errors(replicas[0]) == ["None"]
    # the rendezvous is actor rank 0's Ray node, found at prepare(); the secret came through Ray
    rdv = ray.get(actor_wg.workers[0].__ray_call__.remote(lambda w: w.checkpoint_engine.rendezvous))
    assert rdv.startswith(f"tcp://{ray.util.get_node_ip_address()}:"), rdv

    # sync 2: the trainer fails part-way.  verl's manager raises the trainer's named error within
    # the liveness window; each rollout's engine keeps its own; the inference worker's receive
    # (verl's BucketedWeightReceiver) has returned — nothing is left waiting.  verl's manager
    # skips finalize / resume_kv_cache / resume_generation after the error (its flow, not ours).
    actor_wg.train_step(2, fail_at=5)   # after the first chunk (four tensors) went out
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="the trainer failed producing tensor 5"):
        manager.update_weights(global_steps=2)
    assert time.monotonic() - t0 < TIMEOUT_S + 30
    for s in servers:
        # verl's rollout worker finishes after the manager raised (ray.get returns at the first error)
        st = R.wait_for(s, lambda st: st["receiving"] == 0 and "set_global_steps:2" in st["calls"], TIMEOUT_S + 30)
        assert st["receiving"] == 0, "verl's receiver on the inference side is still waiting"
        st = ray.get(s.state.remote())
        # the stream ended early, so verl's adapter finished its round: the server's step is 2
        assert st["calls"] == full + ["set_global_steps:2"], st["calls"]
        # verl's level-2 flow dropped step 1's weights before the sync (release_kv_cache); what
        # the inference worker holds now is the first chunk of step 2 — torn, until the next sync
        assert st["weights"] == dict(list(R.digest(R.make_state(2).items()).items())[:4]), st["weights"]
    for rep in replicas:
        errs = R.rollout_errors(rep)
        assert all(e.startswith("TornWeightsError") and "tensor 5" in e for e in errs), errs

    # sync 3: goes through, with the same group
    actor_wg.train_step(3)
    manager.update_weights(global_steps=3)
    want = R.digest(R.make_state(3).items())
    for s in servers:
        st = ray.get(s.state.remote())
        assert st["weights"] == want
        assert st["calls"] == full + ["set_global_steps:3", "resume_kv_cache", "resume_generation"], st["calls"]
    assert R.rollout_errors(replicas[1]) == ["None"]
