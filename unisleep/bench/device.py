"""``unisleep bench --backend NAME``: the RL handoff workload on an accelerator, beside its peers.

Workload: ``--weights`` GiB tagged "weights" (backed up) + ``--kv`` GiB tagged "kv_cache"
(discarded); first sleep (cold, and with the backup arena prepared ahead), then ``--cycles``
steady sleep/wake cycles (weights changed each cycle so the copy really runs, and verified
byte-exact), the unchanged-weights sleep and the wake right after it, and level 2 (discard all,
wake "weights" then "kv_cache").  The unchanged and level-2 cycles start 0.1 s after the last
wake, as a rollout would, and nothing sits between a sleep and the wake that follows it.  Then
the same wakes "after the trainer's turn": 1 s between the sleep and the wake, as in an RL step
(rows without a goal: the goals are for the wake right after the sleep).  ``--sweep`` adds total
sizes × allocation counts through ``pool(tag)``.  Each implementation runs in its own process;
other libraries (:mod:`.peers`: torch_memory_saver) run the same workload when installed, and the
copy-bound limits are measured in the same run.  Then the two host-backup policies side by side
(``host_backups="keep"`` and ``"release"``, each in its own process: first sleep, wake, steady
cycles, the unchanged sleep, and the host memory the store holds after each wake; goal for
"release": at most 5 % of the backed-up bytes) and copies from NUMA-near and -far host memory
(:mod:`.host_policies`); ``--host-policies`` runs only those.  Figures and their commands:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from ..cli import CommandParser, parse_args, plain
from ..errors import UnisleepError
from . import host_policies, peers
from .common import (GENERATION_PAUSE_S, TRAINER_TURN_S, add_output_options, emit_result, output_path, print_table, progress, run_worker,
                     write_json)

GiB = 1 << 30


def _timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run_unisleep(platform: str, device: int, weights_gib: float, kv_gib: float, cycles: int, sweep: bool,
                 turn_s: float = TRAINER_TURN_S) -> dict:
    import torch

    from unisleep import MemoryLifecycle

    W, K = int(weights_gib * GiB), int(kv_gib * GiB)
    out: dict = {"impl": "unisleep"}

    def make(lc):
        w = lc.empty((W,), torch.uint8, tag="weights")
        kv = lc.empty((K,), torch.uint8, tag="kv_cache")
        w.view(torch.int32).random_()
        kv.fill_(1)
        return w, kv

    # cold first sleep: nothing registered yet
    lc = MemoryLifecycle(platform, device=device)
    sync = lc.driver.synchronize
    w, kv = make(lc)
    ref = w.clone()
    ptrs = (w.data_ptr(), kv.data_ptr())
    free0 = lc.driver.memory_info()[0]
    out["first_sleep_s"] = _timed(lambda: lc.sleep(1), sync)
    out["freed_bytes"] = lc.driver.memory_info()[0] - free0
    out["pooled_bytes"] = W + K
    out["first_wake_s"] = _timed(lambda: lc.wake_up(), sync)
    ok = bool(torch.equal(w, ref)) and (w.data_ptr(), kv.data_ptr()) == ptrs
    sleeps, wakes = [], []
    for i in range(cycles):
        w[:4096].add_(1)  # a real change: the digest differs, the copy must run
        ref[:4096].add_(1)
        sleeps.append(_timed(lambda: lc.sleep(1), sync))
        wakes.append(_timed(lambda: lc.wake_up(), sync))
        ok = ok and bool(torch.equal(w, ref)) and not bool(kv.view(torch.int64).any())
        progress(f"unisleep cycle {i + 1}/{cycles}: sleep {sleeps[-1]:.3f}s wake {wakes[-1]:.3f}s")
    out["steady_sleep_s"], out["steady_wake_s"] = statistics.median(sleeps), statistics.median(wakes)
    ww, wk = [], []
    for _ in range(2):  # where the wake's time goes: the weights (map + copy) vs the KV cache (map + zero)
        w[:4096].add_(1)
        ref[:4096].add_(1)
        lc.sleep(1)
        ww.append(_timed(lambda: lc.wake_up(["weights"]), sync))
        wk.append(_timed(lambda: lc.wake_up(["kv_cache"]), sync))
    out["wake_weights_only_s"], out["wake_kv_only_s"] = min(ww), min(wk)
    out["sleep_all_s"], out["wake_all_s"] = sleeps, wakes
    unchanged, unchanged_wakes = [], []
    for _ in range(max(2, cycles // 2)):
        time.sleep(GENERATION_PAUSE_S)  # the rollout after the last wake (none between sleep and wake)
        unchanged.append(_timed(lambda: lc.sleep(1), sync))
        out["unchanged_copied_bytes"] = lc.last_report.bytes_copied
        unchanged_wakes.append(_timed(lambda: lc.wake_up(), sync))  # right after: the worst case
        ok = ok and bool(torch.equal(w, ref))
    out["unchanged_sleep_s"] = statistics.median(unchanged)
    out["unchanged_wake_s"] = statistics.median(unchanged_wakes)
    out["unchanged_wakes_all_s"] = unchanged_wakes
    turn = []
    for _ in range(2):  # the wake of an RL step: the trainer ran between the sleep and it
        w[:4096].add_(1)
        ref[:4096].add_(1)
        time.sleep(GENERATION_PAUSE_S)
        lc.sleep(1)
        time.sleep(turn_s)
        turn.append(_timed(lambda: lc.wake_up(), sync))
        ok = ok and bool(torch.equal(w, ref)) and not bool(kv.view(torch.int64).any())
    out["turn_wake_s"] = statistics.median(turn)
    progress(f"unisleep wake after the trainer's turn ({turn_s:g} s): {turn}")
    l2s, l2w, l2k = [], [], []
    for _ in range(3):
        time.sleep(GENERATION_PAUSE_S)
        l2s.append(_timed(lambda: lc.sleep(2), sync))
        l2w.append(_timed(lambda: lc.wake_up(["weights"]), sync))
        l2k.append(_timed(lambda: lc.wake_up(["kv_cache"]), sync))
        ok = ok and not bool(w.view(torch.int64).any()) and not bool(kv.view(torch.int64).any())
    out["l2_sleep_s"], out["l2_wake_weights_s"], out["l2_wake_kv_s"] = map(statistics.median, (l2s, l2w, l2k))
    tw, tk = [], []
    for _ in range(2):
        w.fill_(5)
        kv.fill_(5)
        time.sleep(GENERATION_PAUSE_S)
        lc.sleep(2)
        time.sleep(turn_s)
        tw.append(_timed(lambda: lc.wake_up(["weights"]), sync))
        tk.append(_timed(lambda: lc.wake_up(["kv_cache"]), sync))
        ok = ok and not bool(w.view(torch.int64).any()) and not bool(kv.view(torch.int64).any())
    out["turn_l2_wake_weights_s"], out["turn_l2_wake_kv_s"] = statistics.median(tw), statistics.median(tk)
    out["verified"] = ok
    del w, kv, ref
    lc.close()

    # first sleep with the arena prepared ahead (e.g. while the model loads)
    lc = MemoryLifecycle(platform, device=device)
    w, kv = make(lc)
    t0 = time.perf_counter()
    lc.prepare_backup(background=False)  # in real use: background=True while the model loads
    out["prepare_s"] = time.perf_counter() - t0
    out["first_sleep_prepared_s"] = _timed(lambda: lc.sleep(1), sync)
    lc.wake_up()
    del w, kv
    accelerator = lc.torch_device.type != "cpu"
    lc.close()
    if accelerator:  # the host's limits are unisleep bench's own table (unisleep.bench.host)
        out["limits"] = peers.measure_limits(platform, device, W)

    if sweep:
        rows = []
        lc = MemoryLifecycle(platform, device=device)
        dev = lc.torch_device
        for total_gib in (1, 4, 16, 64):
            for count in (1, 64, 1024):
                each = total_gib * GiB // count
                with lc.pool(f"sweep{total_gib}x{count}"):
                    ts = [torch.empty(each, dtype=torch.uint8, device=dev) for _ in range(count)]
                tag = f"sweep{total_gib}x{count}"
                for t in ts[:: max(1, count // 8)]:
                    t.fill_(3)
                ss, ww = [], []
                for _ in range(2):
                    for t in ts:  # every allocation changed: no copy may be skipped
                        t[:16].add_(1)
                    ss.append(_timed(lambda: lc.sleep(1, offload_tags=[tag]), sync))
                    ww.append(_timed(lambda: lc.wake_up([tag]), sync))
                rows.append({"total_gib": total_gib, "allocations": count, "sleep_s": min(ss), "wake_s": min(ww),
                             "gbps_sleep": total_gib * GiB / min(ss) / 1e9})
                progress(f"sweep {total_gib} GiB x {count}: sleep {min(ss):.3f}s wake {min(ww):.3f}s")
                del ts
                lc.discard([tag])
        out["sweep"] = rows
        lc.close()
    return out


def _worker(impl: str, args) -> dict:
    if impl == "unisleep":
        return run_unisleep(args.backend, args.device, args.weights, args.kv, args.cycles, args.sweep)
    if impl.startswith("host-policy-"):
        return host_policies.run_policy(args.backend, args.device, args.weights, args.kv, args.cycles,
                                        impl[len("host-policy-"):])
    if impl == "numa":
        return host_policies.measure_numa(args.backend, args.device, int(args.numa_gib * GiB))
    return peers.run_peer(impl, args.backend, args.device, args.weights, args.kv, args.cycles)


def _policies(args, base_cmd: list) -> dict:
    """The host-backup policies and the NUMA copies, each in its own process; prints their tables."""
    results = {p: run_worker(base_cmd + ["--worker", f"host-policy-{p}"], f"host_backups={p}")
               for p in host_policies.POLICIES}
    rows, met = host_policies.policy_rows(results)
    print_table(
        f"host backups after a wake, on {args.backend}: {args.weights:g} GiB weights + {args.kv:g} GiB kv_cache "
        "(seconds, medians; host memory = pinned + pageable + on disk, read from the store after each wake)",
        ["figure", "keep", "release"], rows)
    goal = host_policies.GOAL_RELEASED_FRACTION
    print(f"goal: host_backups='release' holds <= {goal:.0%} of the backed-up bytes after a wake: "
          + ("-" if met is None else "met" if met else "NOT MET")
          + f"; verified: keep {results['keep'].get('verified')}, release {results['release'].get('verified')}")
    numa_res = run_worker(base_cmd + ["--worker", "numa"], "numa")
    if numa_res.get("rows"):
        print_table(f"copies from host memory on each NUMA node ({args.numa_gib:g} GiB, GB/s, best of 3); "
                    f"GPU's node: {numa_res.get('device_node')}",
                    ["node", "", "device->host", "host->device", "pages on the node"],
                    host_policies.numa_rows(numa_res))
    if numa_res.get("why"):
        print(f"NUMA: {numa_res['why']}")
    return {"policies": results, "policy_goal_met": met, "numa": numa_res}


GOALS = {  # H200 goals from the issue (seconds)
    "first_sleep_s": 0.6, "first_sleep_prepared_s": 0.2, "steady_sleep_s": 0.17, "steady_wake_s": 0.17,
    "unchanged_sleep_s": 0.02, "unchanged_wake_s": 0.17, "l2_sleep_s": 0.01, "l2_wake_weights_s": 0.005, "l2_wake_kv_s": 0.005,
}
LABELS = {
    "first_sleep_s": "first sleep (cold)", "first_sleep_prepared_s": "first sleep (arena prepared)",
    "steady_sleep_s": "steady level-1 sleep", "steady_wake_s": "steady wake",
    "unchanged_sleep_s": "level-1 sleep, unchanged weights",
    "unchanged_wake_s": "wake right after an unchanged sleep", "l2_sleep_s": "level-2 sleep (discard all)",
    "l2_wake_weights_s": "level-2 wake 'weights' (zeroed)", "l2_wake_kv_s": "level-2 wake 'kv_cache' (zeroed)",
    "turn_wake_s": "wake after the trainer's turn", "turn_l2_wake_weights_s": "level-2 wake 'weights', after the turn",
    "turn_l2_wake_kv_s": "level-2 wake 'kv_cache', after the turn",
}


def figure_rows(results: dict) -> list:
    """The table's rows: figure, goal, each implementation's value, whether unisleep met the goal
    ("-" for the rows without one)."""
    rows = []
    for key, label in LABELS.items():
        goal = GOALS.get(key)
        row = [label, goal] + [r.get(key) for r in results.values()]
        ours = results.get("unisleep", {}).get(key)
        row.append(None if goal is None else "yes" if ours is not None and ours <= goal else "no")
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = CommandParser(prog="unisleep bench", description=plain(__doc__))
    ap.add_argument("--backend", required=True, help="the accelerator platform to measure, one of unisleep's backends "
                    "(a device of it must be here: unisleep doctor shows what is found; --backend host is the host "
                    "benchmark)")
    ap.add_argument("--device", type=int, default=0, help="the device index (default 0)")
    ap.add_argument("--weights", type=float, default=8.0, help="GiB tagged weights (default 8)")
    ap.add_argument("--kv", type=float, default=16.0, help="GiB tagged kv_cache (default 16)")
    ap.add_argument("--cycles", type=int, default=4,
                    help="steady sleep/wake cycles, each with changed weights; the table shows medians (default 4)")
    ap.add_argument("--sweep", action="store_true", help="also 1/4/16/64 GiB x 1/64/1024 allocations")
    ap.add_argument("--no-peers", action="store_true",
                    help="measure unisleep only, not the other libraries installed here (torch_memory_saver)")
    ap.add_argument("--host-policies", action="store_true",
                    help="run only the host-backup policies side by side and the NUMA copies")
    ap.add_argument("--numa-gib", type=float, default=2.0, help="GiB per NUMA copy (default 2)")
    add_output_options(ap, "<backend>")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parse_args(ap, list(argv or []))
    if args.worker:
        emit_result(_worker(args.worker, args))
        if args.worker != "unisleep":
            os._exit(0)  # a peer's own exit path is not what is measured
        return 0

    for name, gib in (("--weights", args.weights), ("--kv", args.kv), ("--numa-gib", args.numa_gib)):
        if not gib > 0 or gib == float("inf"):
            ap.error(f"{name} must be a positive number of GiB, got {gib:g}")
    if args.cycles < 1:
        ap.error(f"--cycles must be >= 1, got {args.cycles}")
    try:
        path = output_path(args, args.backend + ("-host-policies" if args.host_policies else ""))
    except UnisleepError as e:
        ap.exit(2, f"unisleep bench: {e}\n")
    base = [sys.executable, "-m", "unisleep", "bench", "--backend", args.backend, "--device", str(args.device),
            "--weights", str(args.weights), "--kv", str(args.kv), "--cycles", str(args.cycles),
            "--numa-gib", str(args.numa_gib)]
    if args.host_policies:
        res = _policies(args, base)
        write_json(path, f"device-{args.backend}-host-policies", res, argv)
        ok = all(r.get("verified") for r in res["policies"].values()) and res["policy_goal_met"] is not False
        return 0 if ok else 1
    impls = ["unisleep"] + ([] if args.no_peers else peers.available_peers())
    results = {}
    for impl in impls:
        cmd = base + ["--worker", impl]
        if args.sweep and impl == "unisleep":
            cmd.append("--sweep")
        results[impl] = run_worker(cmd, impl)

    names = list(results)
    print_table(
        f"sleep/wake on {args.backend}: {args.weights:g} GiB weights + {args.kv:g} GiB kv_cache (seconds, medians; "
        f"'after the turn': {TRAINER_TURN_S:g} s between the sleep and the wake)",
        ["figure", "goal"] + names + ["goal met"], figure_rows(results),
    )
    u = results.get("unisleep", {})
    lim = u.get("limits")
    if lim:
        gb = args.weights * GiB / 1e9
        rows = [["device->host copy (sleep)", lim.get("d2h_gbps"), gb / u["steady_sleep_s"],
                 gb / u["steady_sleep_s"] / lim["d2h_gbps"]],
                ["host->device copy (wake 'weights')", lim.get("h2d_gbps"), gb / u["wake_weights_only_s"],
                 gb / u["wake_weights_only_s"] / lim["h2d_gbps"]]]
        print_table("copy-bound limits measured in the same run (GB/s)", ["path", "limit", "unisleep", "fraction"], rows)
        if lim.get("notes"):
            print(lim["notes"])
        print(f"wake split: 'weights' (map + copy) {u['wake_weights_only_s']:.4f} s, "
              f"'kv_cache' (map + zero) {u['wake_kv_only_s']:.4f} s")
    if "freed_bytes" in u:
        print(f"freed by level-1 sleep (device free memory): {u['freed_bytes'] / GiB:.2f} GiB of "
              f"{u['pooled_bytes'] / GiB:.2f} GiB pooled ({100 * u['freed_bytes'] / u['pooled_bytes']:.1f} %); "
              f"bytes copied by the unchanged sleep: {u.get('unchanged_copied_bytes')}; verified: {u.get('verified')}")
    if u.get("sweep"):
        print_table("sweep (level-1 sleep/wake through pool(tag))", ["GiB", "allocations", "sleep s", "wake s", "GB/s"],
                    [[r["total_gib"], r["allocations"], r["sleep_s"], r["wake_s"], r["gbps_sleep"]] for r in u["sweep"]])
    pol = _policies(args, base)
    results["host_policies"] = pol
    write_json(path, f"device-{args.backend}", results, argv)
    ok = u.get("verified") and all(r.get("verified") for r in pol["policies"].values())
    return 0 if ok else 1
