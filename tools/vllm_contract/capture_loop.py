#!/usr/bin/env python3
"""Graph capture at engine start, as vLLM's GPU worker does it, repeated in fresh processes.

    python tools/vllm_contract/fetch.py      # once, on a CPU machine with a registry
    PYTHONPATH=. python3 tools/vllm_contract/capture_loop.py --runs 50 --parallel 4 \\
        --configs unisleep,unisleep-race,cumem --json out.json
    PYTHONPATH=. python3 tools/vllm_contract/capture_loop.py --vllm-pkg 0.27.1 ...   # vllm_pkg-0.27.1/

Each run is a new Python process that does what vLLM's worker does at start under sleep
mode, through vLLM's real code (extracted by ``fetch.py``; ``--vllm-pkg`` as in ``harness.py``):
the backend is the config's route on that version (``harness.Contract.route``: the factory's
``unisleep`` backend on 0.33, vLLM's ``cumem`` backend over unisleep's allocator on 0.25-0.32,
the GPU worker's own allocator calls on 0.24), ``get_mem_allocator_instance()`` answers (the
unisleep plugin makes it unisleep's allocator for ``unisleep*``), the weights (``--weights-gib`` of bytes plus a 1 GiB
bf16 MLP) are allocated under ``use_memory_pool(tag="weights")`` — with unisleep that starts the
backup arena's preparation in the background, which the KV cache's pool waits for — the KV cache
under ``"kv_cache"``; the MLP is
warmed up on a side stream, then captured through ``compilation/cudagraph_pool.capture_pool``
(the allocator's ``cudagraph_pool()``; a vLLM without it captures in torch's own pool, as that
vLLM does) with ``torch.cuda.graph`` in its default global mode.
The run then replays the graph against eager, sleeps and wakes once, replays again and exits
without cleaning up.

Configs: ``unisleep``; ``unisleep-race``: the same, plus a background arena preparation of
``--race-gib`` started right before the capture, so it runs throughout it; ``cumem``: vLLM's own
CuMemAllocator.  A run passes when it exits 0, its checks pass, and its stderr holds no C++ trace
(``terminate called``, ``frame #``, ``INTERNAL ASSERT``, ``pure virtual``).  Prints a table of
counts per config and writes JSON with the first failures' stderr.  ``--budget-s`` stops
starting runs after that many seconds (the counts say how many ran).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GiB = 1 << 30
SIGNS = ("terminate called", "frame #", "INTERNAL ASSERT", "pure virtual", "CUBLAS_STATUS",
         "StreamCaptureInvalidated", "Traceback", "Exception ignored")


def child(args) -> int:
    sys.path.insert(0, HERE)
    import contextlib

    import harness  # the fetched vLLM pieces on the path, libnvrtc loaded

    harness._setup(args.vllm_pkg)
    from types import SimpleNamespace

    import torch
    from vllm.device_allocator import get_mem_allocator_instance

    from unisleep.vllm_worker import plugin as vllm_plugin

    name = "cumem" if args.child == "cumem" else "unisleep"
    vllm_plugin.register()
    vllm_plugin.select_allocator(name == "unisleep")
    contract = harness.Contract()
    backend, route = contract.route(name)
    if contract.graph_pool:
        from vllm.compilation.cudagraph_pool import capture_pool
    else:  # this vLLM captures in torch's own pool
        capture_pool = lambda pool, cfg: contextlib.nullcontext(pool)  # noqa: E731
    alloc = get_mem_allocator_instance()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1)
    hidden, layers = 8192, 8  # 8 x 8192 x 8192 bf16 = 1 GiB
    W, nw = int(args.weights_gib * GiB), 16
    with alloc.use_memory_pool(tag="weights"):
        weights = [torch.randint(0, 256, (W // nw,), dtype=torch.uint8, device=dev, generator=gen) for _ in range(nw)]
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False, device=dev, dtype=torch.bfloat16)
                                      for _ in range(layers)])
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = torch.zeros((int(args.kv_gib * GiB),), dtype=torch.uint8, device=dev)
    x = torch.randn((args.batch, hidden), device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # warm-up before capture, as torch asks
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    if args.child == "unisleep-race":  # a background preparation running throughout the capture
        alloc.lifecycle.prepare_backup(int(args.race_gib * GiB), background=True)
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.no_grad(), capture_pool(None, SimpleNamespace(use_cumem_cudagraph_pool=True)) as pool:
        with torch.cuda.graph(g, pool=pool):
            y = model(x)
    capture_s = time.perf_counter() - t0
    with torch.no_grad():
        g.replay()
        ok1 = torch.equal(y, model(x))
        ref = [w[:4096].clone() for w in weights]
        backend.suspend(1)
        backend.resume(["weights"])
        backend.resume(["kv_cache"])
        g.replay()
        ok2 = torch.equal(y, model(x)) and all(torch.equal(w[:4096], r) for w, r in zip(weights, ref))
    torch.cuda.synchronize()
    print(json.dumps({"replay_ok": ok1, "after_wake_ok": ok2, "capture_s": capture_s, "kv": int(kv.numel()),
                      "route": route, "backend": type(backend).__name__, "allocator": type(alloc).__name__}))
    return 0 if ok1 and ok2 else 3  # exit without cleaning up: the teardown order is under test


def one(config: str, i: int, args) -> dict:
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = os.path.abspath(args.tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--weights-gib", str(args.weights_gib),
           "--kv-gib", str(args.kv_gib), "--race-gib", str(args.race_gib), "--batch", str(args.batch),
           "--vllm-pkg", args.vllm_pkg]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    signs = [s for s in SIGNS if s in err]
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except ValueError:
                pass
    ok = rc == 0 and not signs and res.get("replay_ok") and res.get("after_wake_ok")
    return {"config": config, "run": i, "rc": rc, "ok": bool(ok), "signs": signs, "seconds": time.perf_counter() - t0,
            "capture_s": res.get("capture_s"), "route": res.get("route"), "backend": res.get("backend"),
            "allocator": res.get("allocator"), "stderr_tail": "" if ok else err[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="fresh processes per config")
    ap.add_argument("--parallel", type=int, default=4, help="processes at a time (one GPU)")
    ap.add_argument("--configs", default="unisleep,unisleep-race,cumem")
    ap.add_argument("--weights-gib", type=float, default=8.0)
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--race-gib", type=float, default=8.0, help="unisleep-race: arena prepared during the capture")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--tree", help="run the children on the unisleep of this source tree (PYTHONPATH)")
    ap.add_argument("--vllm-pkg", help="the extracted vLLM: a folder, or a version for vllm_pkg-VERSION/ "
                                       "(default: $VLLM_CONTRACT_PKG, else vllm_pkg/)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run after this many seconds (0: no limit); the counts say how many ran")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import harness

    args.vllm_pkg = harness.put_on_path(args.vllm_pkg)  # checked here, the same tree for every child
    if args.child:
        return child(args)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in ("unisleep", "unisleep-race", "cumem")]
    if unknown:
        ap.error(f"unknown configs {unknown}: unisleep, unisleep-race, cumem")
    jobs = [(c, i) for i in range(args.runs) for c in configs]
    results = []
    t0 = time.perf_counter()

    def job(j):
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            return None
        return one(j[0], j[1], args)

    with ThreadPoolExecutor(args.parallel) as ex:
        for r in ex.map(job, jobs):
            if r is None:
                continue
            results.append(r)
            done = len(results)
            if done % 10 == 0 or not r["ok"]:
                print(f"[{done}/{len(jobs)} {time.perf_counter() - t0:.0f}s] {r['config']} run {r['run']}: "
                      f"{'ok' if r['ok'] else 'FAILED rc=' + str(r['rc']) + ' ' + ','.join(r['signs'])}", flush=True)
    import torch

    summary = {}
    for c in configs:
        rs = [r for r in results if r["config"] == c]
        summary[c] = {"runs": len(rs), "failed": sum(not r["ok"] for r in rs),
                      "aborted": sum(r["rc"] == -6 or r["rc"] == 134 for r in rs),
                      "routes": sorted({f"{r['route']} -> {r['backend']} over {r['allocator']}" for r in rs if r["route"]})}
    if len(results) < len(jobs):
        print(f"budget of {args.budget_s:.0f} s spent: {len(results)} of {len(jobs)} runs ran")
    print(f"\n| config | runs | failed | aborted (SIGABRT) |\n|---|---|---|---|")
    for c, s in summary.items():
        print(f"| {c} | {s['runs']} | {s['failed']} | {s['aborted']} |")
    for c, s in summary.items():
        print(f"{c}: {'; '.join(s['routes']) or 'no run reported its route'}")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
           "vllm": harness.version(), "vllm_tree": os.path.basename(harness.PKG), "manifest": harness.manifest(),
           "runs_asked": len(jobs), "budget_s": args.budget_s or None,
           "command": "python3 tools/vllm_contract/capture_loop.py " + " ".join(
               os.path.basename(a) if a == args.json else a for a in sys.argv[1:]),
           "tree": "the tree given by --tree" if args.tree else "this tree",
           "summary": summary, "failures": [r for r in results if not r["ok"]][:5],
           "seconds": time.perf_counter() - t0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(s["failed"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
