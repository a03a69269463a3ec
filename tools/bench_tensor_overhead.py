"""What a weight update costs per tensor, and what a small update costs in all, on the host paths.

Each path (``host-socket``: host memory over a Unix socket; ``host-ipc``: host memory shared
through a memfd) runs a sender process and a receiver process, spawned fresh, keyed digests on.
Three updates, each a warm-up then ``--repeat`` timed ones (the median is reported):

* ``many``: ``--tensors`` tensors of ``--tensor-kib`` KiB (default 2,000 of 4 KiB);
* ``one``: one tensor of the same total bytes (the byte time of ``many``);
* ``tiny-llama``: 21 float32 tensors, 6.5 MiB (the shapes of the tiny Llama of
  :mod:`unisleep.engines.tiny_model`): the fixed cost of a whole small update.

The per-tensor cost beyond the bytes is ``(many - one) / (tensors - 1)``.  The receiver applies
every tensor by copying it into memory of its own (what ``load_weights`` does).  The sender
passes a dict (a state_dict); ``--generator`` streams a generator with ``specs`` instead.

``--profile DIR`` runs the timed ``many`` updates of each process under cProfile, writes
``DIR/<path>-rank<r>.prof`` and prints the top entries by own time.

    python tools/bench_tensor_overhead.py --json out/tensor-overhead.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback

KiB, MiB = 2**10, 2**20
PATHS = {"host-socket": {"path": "collective", "via": "socket"}, "host-ipc": {"path": "ipc"}}
#: the tiny Llama's tensors (names, shapes), float32: 21 tensors, 6.5 MiB
TINY_LLAMA = ([("model.embed_tokens.weight", (1024, 256))]
              + [(f"model.layers.{i}.{n}", s) for i in range(2) for n, s in (
                  ("self_attn.q_proj.weight", (256, 256)), ("self_attn.k_proj.weight", (128, 256)),
                  ("self_attn.v_proj.weight", (128, 256)), ("self_attn.o_proj.weight", (256, 256)),
                  ("mlp.gate_proj.weight", (512, 256)), ("mlp.up_proj.weight", (512, 256)),
                  ("mlp.down_proj.weight", (256, 512)), ("input_layernorm.weight", (256,)),
                  ("post_attention_layernorm.weight", (256,)))]
              + [("model.norm.weight", (256,)), ("lm_head.weight", (1024, 256))])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workloads(n: int, kib: int) -> dict:
    """name -> [(tensor name, shape)] (float32)."""
    per = kib * KiB // 4
    return {"many": [(f"layer.{i}.weight", (per,)) for i in range(n)],
            "one": [("all.weight", (per * n,))],
            "tiny-llama": TINY_LLAMA}


def _side(rank: int, port: int, job: dict) -> dict:
    import cProfile
    import inspect

    import torch

    from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

    torch.set_num_threads(1)
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=120)
    loads = _workloads(job["tensors"], job["tensor_kib"])
    prof = cProfile.Profile() if job["profile"] else None
    out: dict = {"rank": rank, "times": {}}
    try:
        if rank == 0:
            tx = WeightSender(g, bucket_bytes=job["bucket_mib"] * MiB, verify=True, **PATHS[job["path"]])
            version = 0
            for name, shapes in loads.items():
                state = {n: torch.randn(s) for n, s in shapes}
                specs = [(n, s, "float32") for n, s in shapes]
                times = []
                for rep in range(job["repeat"] + 1):
                    version += 1
                    src = ((n, t) for n, t in state.items()) if job["generator"] else state
                    on = prof is not None and rep and name == "many"
                    if on:
                        prof.enable()
                    t0 = time.perf_counter()
                    tx.send(src, version, specs=specs if job["generator"] else None)
                    dt = time.perf_counter() - t0
                    if on:
                        prof.disable()
                    if rep:
                        times.append(dt)
                out["times"][name] = times
            tx.close()
        else:
            dst: dict = {}

            def apply(pairs):  # what load_weights does: copy each tensor into the engine's own
                for n, t in pairs:
                    d = dst.get(n)
                    if d is None or d.shape != t.shape:
                        d = dst[n] = torch.empty_like(t)
                    d.copy_(t)

            kw = {"staged": False} if "staged" in inspect.signature(WeightReceiver).parameters else {}
            rx = WeightReceiver(g, apply=apply, **kw)
            for name in loads:
                times = []
                for rep in range(job["repeat"] + 1):
                    on = prof is not None and rep and name == "many"
                    if on:
                        prof.enable()
                    r = rx.receive(timeout_s=120)
                    if on:
                        prof.disable()
                    if rep:
                        times.append(r.seconds)
                out["times"][name] = times
                dst.clear()
    finally:
        g.close()
    if prof is not None:
        path = os.path.join(job["profile"], f"{job['path']}-rank{rank}.prof")
        prof.dump_stats(path)
        out["profile"] = path
    return out


def _worker(rank: int, port: int, job: dict, q) -> None:
    try:
        q.put(_side(rank, port, job))
    except BaseException:
        q.put({"rank": rank, "error": traceback.format_exc()})


def run_path(job: dict, timeout_s: float = 600) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    ps = [ctx.Process(target=_worker, args=(r, port, job, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    got: dict = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < 2:
            res = q.get(timeout=max(1.0, deadline - time.monotonic()))
            got[res["rank"]] = res
            if "error" in res:
                raise RuntimeError(f"rank {res['rank']} failed:\n{res['error']}")
    finally:
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="host-socket,host-ipc")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--tensor-kib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--generator", action="store_true", help="send a generator with specs instead of a dict")
    ap.add_argument("--profile", metavar="DIR", help="cProfile the timed 'many' updates of each process into DIR")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    a = ap.parse_args(argv)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    rows, doc = [], {"tensors": a.tensors, "tensor_kib": a.tensor_kib, "repeat": a.repeat, "bucket_mib": a.bucket_mib,
                     "generator": a.generator, "load_before": os.getloadavg(), "paths": {}}
    for path in paths:
        job = {"path": path, "tensors": a.tensors, "tensor_kib": a.tensor_kib, "repeat": a.repeat,
               "bucket_mib": a.bucket_mib, "generator": a.generator, "profile": a.profile}
        got = run_path(job)
        med = {side: {k: statistics.median(v) for k, v in got[r]["times"].items()} for side, r in (("sender", 0), ("receiver", 1))}
        s = med["sender"]
        per_us = (s["many"] - s["one"]) / max(1, a.tensors - 1) * 1e6
        doc["paths"][path] = {"sender_s": got[0]["times"], "receiver_s": got[1]["times"], "median_s": med,
                              "per_tensor_us": per_us}
        rows.append((path, s["many"] * 1e3, s["one"] * 1e3, per_us, s["tiny-llama"] * 1e3))
        for r in (0, 1):
            if "profile" in got[r]:
                import pstats

                print(f"\n--- {path} rank {r} ({'sender' if r == 0 else 'receiver'}), by own time")
                pstats.Stats(got[r]["profile"]).sort_stats("tottime").print_stats(22)
    doc["load_after"] = os.getloadavg()
    print(f"\n{a.tensors} tensors of {a.tensor_kib} KiB against one of {a.tensors * a.tensor_kib // KiB} MiB; "
          f"median of {a.repeat} sends after a warm-up; load average {doc['load_before'][0]:.2f} -> "
          f"{doc['load_after'][0]:.2f}")
    print(f"{'path':<12} {'many ms':>9} {'one ms':>9} {'per tensor us':>14} {'tiny-llama ms':>14}")
    for path, many, one, per, tiny in rows:
        print(f"{path:<12} {many:>9.1f} {one:>9.1f} {per:>14.1f} {tiny:>14.1f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
