"""``unisleep bench --compat-tms``: unisleep's torch_memory_saver facade beside the real
torch_memory_saver 0.0.10, in the same run, on the same workload written once against the tms API.

Workload: ``--weights`` GiB allocated by ``torch.empty`` inside ``region(tag="weights",
enable_cpu_backup=True)`` (backed up) + ``--kv`` GiB inside ``region(tag="kv_cache")``
(discarded); ``retain_cpu_backup = True`` for both.  Figures: the first ``pause()`` (cold:
nothing prepared, the host backup is taken inside it, as tms does; the time from the end of the
weights region to it is reported beside it), ``--cycles`` steady ``pause()``/``resume()`` pairs with the weights changed every cycle
(so the copy really runs) and verified byte-exact after each resume, then ``pause()`` of unchanged
weights.  Each implementation runs in its own process; the real torch_memory_saver runs with
``hook_mode = "torch"`` (its ``"preload"`` mode needs ``LD_PRELOAD``) and is skipped, said so, when
it is not installed.  Needs an accelerator: the facade's regions route torch's own allocations
only there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from ..cli import CommandParser, parse_args, plain
from ..errors import UnisleepError
from .common import add_output_options, emit_result, output_path, print_table, progress, run_worker, write_json

GiB = 1 << 30
IMPLS = ("unisleep-facade", "torch_memory_saver")
GOALS = {"first_pause_s": 0.6, "steady_pause_s": 0.17, "steady_resume_s": 0.17, "unchanged_pause_s": 0.02}
LABELS = {
    "first_pause_s": "first pause (cold)",
    "first_resume_s": "first resume",
    "steady_pause_s": "steady pause (weights changed)",
    "steady_resume_s": "steady resume",
    "unchanged_pause_s": "pause, unchanged weights",
}


def run_workload(impl: str, weights_gib: float, kv_gib: float, cycles: int) -> dict:
    import torch

    from unisleep.platform import detect_platform

    plat = detect_platform()
    if not plat.is_accelerator:
        raise SystemExit("unisleep bench --compat-tms needs an accelerator (the host backend has no pool)")
    devtype = plat.torch_device_type
    if impl == "unisleep-facade":
        from unisleep.compat.torch_memory_saver import torch_memory_saver as tms
    else:
        from torch_memory_saver import torch_memory_saver as tms

        tms.hook_mode = "torch"  # "preload" needs LD_PRELOAD
    devmod = torch.get_device_module(devtype)
    dev = torch.device(devtype, devmod.current_device())

    def sync():
        devmod.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    W, K = int(weights_gib * GiB), int(kv_gib * GiB)
    out: dict = {"impl": impl}
    tms.retain_cpu_backup = True
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(W, dtype=torch.uint8, device=dev)
    t_exit = time.perf_counter()
    with tms.region(tag="kv_cache"):
        kv = torch.empty(K, dtype=torch.uint8, device=dev)
    w.view(torch.int32).random_()
    kv.fill_(1)
    ref = w.clone()
    ptrs = (w.data_ptr(), kv.data_ptr())
    free0 = devmod.mem_get_info()[0]
    sync()
    out["region_exit_to_first_pause_s"] = time.perf_counter() - t_exit
    out["first_pause_s"] = timed(lambda: tms.pause())
    out["freed_bytes"] = devmod.mem_get_info()[0] - free0
    out["freed_settled_bytes"] = _free_once_idle(devmod) - free0  # once the driver is done releasing
    out["paused_bytes"] = W + K
    out["first_resume_s"] = timed(lambda: tms.resume())
    ok = bool(torch.equal(w, ref)) and (w.data_ptr(), kv.data_ptr()) == ptrs
    pauses, resumes = [], []
    for i in range(cycles):
        w[:4096].add_(1)  # a real change: nothing may skip the copy
        ref[:4096].add_(1)
        pauses.append(timed(lambda: tms.pause()))
        resumes.append(timed(lambda: tms.resume()))
        ok = ok and bool(torch.equal(w, ref))
        progress(f"{impl} cycle {i + 1}/{cycles}: pause {pauses[-1]:.3f}s resume {resumes[-1]:.3f}s")
    out["steady_pause_s"], out["steady_resume_s"] = statistics.median(pauses), statistics.median(resumes)
    out["pause_all_s"], out["resume_all_s"] = pauses, resumes
    unchanged = []
    for _ in range(max(2, cycles // 2)):
        unchanged.append(timed(lambda: tms.pause()))
        tms.resume()
        ok = ok and bool(torch.equal(w, ref))
    out["unchanged_pause_s"] = statistics.median(unchanged)
    out["unchanged_all_s"] = unchanged
    kv_zero = not bool(kv.view(torch.int64).any())
    out["kv_zero_after_resume"] = kv_zero  # unisleep's contract; torch_memory_saver leaves it undefined
    out["verified"] = ok
    if impl == "unisleep-facade":
        out["resident_bytes_by_tag"] = {t: tms.resident_bytes(t) for t in ("weights", "kv_cache")}
        out["last_copy_reports"] = [lc.last_report.as_dict() for lc in tms.lifecycles() if lc.last_report]
    return out


def _free_once_idle(devmod, limit_s: float = 2.0) -> int:
    """Free device memory once it stops changing (three equal reads 20 ms apart, at most
    ``limit_s``): the driver keeps returning released memory for a while after the call."""
    last, same, t0 = devmod.mem_get_info()[0], 0, time.monotonic()
    while same < 3 and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)
        now = devmod.mem_get_info()[0]
        same, last = (same + 1 if now == last else 0), now
    return last


def _available(impl: str) -> bool:
    return impl == "unisleep-facade" or importlib.util.find_spec("torch_memory_saver") is not None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = CommandParser(prog="unisleep bench --compat-tms", description=plain(__doc__))
    ap.add_argument("--weights", type=float, default=8.0, help="GiB in the backed-up 'weights' region (default 8)")
    ap.add_argument("--kv", type=float, default=16.0, help="GiB in the discarded 'kv_cache' region (default 16)")
    ap.add_argument("--cycles", type=int, default=4, help="steady pause/resume cycles (default 4)")
    add_output_options(ap, "compat-tms")
    ap.add_argument("--check", action="store_true", help="exit 1 when the facade misses a goal")
    ap.add_argument("--worker", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    args = parse_args(ap, list(argv or []))
    if args.worker:
        emit_result(run_workload(args.worker, args.weights, args.kv, args.cycles))
        os._exit(0)  # neither library's exit path is what is measured
    for name, gib in (("--weights", args.weights), ("--kv", args.kv)):
        if not 0 < gib < float("inf"):
            ap.error(f"{name} must be a positive number of GiB, got {gib:g}")
    if args.cycles < 1:
        ap.error(f"--cycles must be >= 1, got {args.cycles}")
    try:
        json_path = output_path(args, "compat-tms")
    except UnisleepError as e:
        ap.exit(2, f"unisleep bench: {e}\n")

    results: dict = {}
    for impl in IMPLS:
        if not _available(impl):
            progress(f"{impl} is not installed: its column is empty (pip install torch-memory-saver==0.0.10)")
            results[impl] = {"impl": impl, "error": "not installed"}
            continue
        cmd = [sys.executable, "-m", "unisleep", "bench", "--compat-tms", "--weights", str(args.weights),
               "--kv", str(args.kv), "--cycles", str(args.cycles), "--worker", impl]
        results[impl] = run_worker(cmd, impl)

    rows = []
    fac = results.get("unisleep-facade", {})
    for key, label in LABELS.items():
        goal = GOALS.get(key)
        ours = fac.get(key)
        met = "-" if goal is None else ("yes" if ours is not None and ours <= goal else "no")
        rows.append([label, goal] + [results[i].get(key, results[i].get("error")) for i in IMPLS] + [met])
    print_table(
        f"torch_memory_saver API: {args.weights:g} GiB backed-up 'weights' + {args.kv:g} GiB discarded 'kv_cache' "
        "(seconds, medians)",
        ["figure", "goal"] + list(IMPLS) + ["goal met"], rows,
    )
    for impl in IMPLS:
        r = results[impl]
        if "region_exit_to_first_pause_s" in r:
            print(f"{impl}: {r['region_exit_to_first_pause_s']:.3f} s from the end of the weights region to the first pause")
        if "freed_bytes" in r:
            print(f"{impl}: freed by the first pause {r['freed_bytes'] / GiB:.3f} of {r['paused_bytes'] / GiB:.2f} GiB at once, "
                  f"{r['freed_settled_bytes'] / GiB:.3f} GiB once the driver settled; "
                  f"verified {r['verified']}; kv_cache zero after resume {r['kv_zero_after_resume']}")
    write_json(json_path, "compat-tms", {"goals": GOALS, **results}, ["--compat-tms"] + list(argv or []))
    if not fac.get("verified"):
        return 1
    if args.check and any(fac.get(k) is None or fac[k] > g for k, g in GOALS.items()):
        return 1
    return 0
