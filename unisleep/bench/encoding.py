"""``unisleep bench --backend host --encoding``: the "planes" backup encoding beside plain backups.

Three workloads of ``--mib`` MiB each, tag "weights", every one slept and woken at level 1 with
plain backups and with ``backup_encoding="planes"``, side by side in the same run:

=================  ==========================================================================
``bf16-llm``       bf16 drawn like trained LLM weights: normal, std 0.02, one in 10,000 an
                   outlier 50 times larger
``fp32-adamw``     the AdamW moments (``exp_avg``, ``exp_avg_sq``, fp32) of a small MLP built
                   here and trained ``--steps`` real optimizer steps on random data
``random``         random bytes (the per-frame fallback: stored plain)
=================  ==========================================================================

Reported per workload and encoding (medians of ``--cycles``): the ratio of stored to raw
bytes, sleep and wake seconds, and the bytes the backup holds (on the host backend: spill files
— the figure that is pinned host memory on an accelerator).  Every wake is checked byte for
byte against an XXH3-64 digest taken before the sleep (no second copy of the data is kept:
memory is the workload's ``--mib`` plus one frame's scratch).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional, Sequence

from ..cli import check_out_file, parse_args, plain
from ..errors import UnisleepError
from .common import default_json, print_table, progress, write_json

MiB = 1 << 20
WORKLOADS = ("bf16-llm", "fp32-adamw", "random")
ENCODINGS = (None, "planes")


def _digest(t) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    h.update(memoryview(t.numpy()))
    return h.intdigest()


def fill(name: str, t, steps: int, seed: int = 0) -> dict:
    """Fill the uint8 tensor ``t`` with workload ``name``; returns what was made (for the JSON)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if name == "bf16-llm":
        w = t.view(torch.bfloat16)
        step = 1 << 22
        for lo in range(0, w.numel(), step):  # one slice at a time: no second copy of the model
            x = torch.randn(min(step, w.numel() - lo), generator=g) * 0.02
            idx = torch.randint(0, x.numel(), (max(1, x.numel() // 10000),), generator=g)
            x[idx] *= 50
            w[lo:lo + x.numel()] = x.to(torch.bfloat16)
        return {"dtype": "bfloat16", "std": 0.02, "outliers": "1e-4 of the weights, x50"}
    if name == "random":
        t.random_(0, 256, generator=g)
        return {"dtype": "uint8", "distribution": "uniform bytes"}
    # fp32 AdamW moments of a real small model: as many parameters as fill half of t each moment
    f = t.view(torch.float32)
    n = f.numel() // 2
    width = 512
    layers = max(1, n // (width * width + width))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(16, width, generator=g)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    pos = 0
    for key in ("exp_avg", "exp_avg_sq"):
        for p in model.parameters():
            m = opt.state[p][key].reshape(-1)
            k = min(m.numel(), f.numel() - pos)
            f[pos:pos + k] = m[:k]
            pos += k
    if pos < f.numel():  # the last partial layer: more moments of the same kind, shifted
        done = pos
        while pos < f.numel():
            k = min(done, f.numel() - pos)
            f[pos:pos + k] = f[:k]
            pos += k
    del model, opt
    return {"dtype": "float32", "model": f"{layers} x Linear({width}, {width}) + GELU", "optimizer": "AdamW lr 1e-3",
            "steps": steps, "moments": "exp_avg then exp_avg_sq"}


def run_one(workload: str, encoding: Optional[str], nbytes: int, cycles: int, steps: int,
            spill_dir: Optional[str]) -> dict:
    import torch

    from ..lifecycle import MemoryLifecycle

    lc = MemoryLifecycle("host", spill_dir=spill_dir, backup_encoding=encoding)
    try:
        t = lc.empty((nbytes,), torch.uint8, tag="weights")
        made = fill(workload, t, steps)
        sleeps, wakes, held, disk, exact = [], [], [], [], True
        for c in range(cycles):
            t.view(-1)[c * 4096] ^= 1  # a changed byte: every sleep really copies
            want = _digest(t)
            t0 = time.perf_counter()
            lc.sleep(1)
            sleeps.append(time.perf_counter() - t0)
            held.append(lc.backup_bytes())
            disk.append(lc.backup_resident_bytes()["disk"])
            t0 = time.perf_counter()
            lc.wake_up()
            wakes.append(time.perf_counter() - t0)
            exact = exact and _digest(t) == want
        enc = statistics.median(held)
        return {"workload": workload, "encoding": encoding or "plain", "bytes": nbytes, "made": made,
                "ratio": enc / nbytes, "sleep_s": statistics.median(sleeps), "wake_s": statistics.median(wakes),
                "sleep_all_s": sleeps, "wake_all_s": wakes, "held_bytes": int(enc), "disk_bytes": int(statistics.median(disk)),
                "exact": exact}
    finally:
        lc.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="unisleep bench", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="host", help="the platform (host: the device kernels of the encoding are "
                    "not built yet)")
    ap.add_argument("--encoding", action="store_true", help="this benchmark")
    ap.add_argument("--mib", type=int, default=256, help="MiB of each workload (default 256)")
    ap.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles of each; medians (default 3)")
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps of the fp32 workload's model (default 3)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--spill-dir", default=None, help="where the spill files go (default: the host backend's)")
    ap.add_argument("--json", default=None, help="write results here (default out/bench-encoding-host.json)")
    args = parse_args(ap, list(argv or []))
    if args.backend != "host":
        ap.exit(2, f"unisleep bench: --encoding --backend {args.backend}: the encoding's device kernels are not built "
                   "yet; the host backend has the encoding (unisleep bench --backend host --encoding)\n")
    if args.mib < 1:
        ap.error(f"--mib must be >= 1, got {args.mib}")
    if args.cycles < 1:
        ap.error(f"--cycles must be >= 1, got {args.cycles}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    loads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in loads if w not in WORKLOADS]
    if bad or not loads:
        ap.error(f"--workloads: unknown {', '.join(bad) or '(none given)'}; choose among {', '.join(WORKLOADS)}")
    path = args.json or default_json("encoding-host")
    try:
        check_out_file(path, "--json")
    except UnisleepError as e:
        ap.exit(2, f"unisleep bench: {e}\n")
    results = []
    for w in loads:
        for enc in ENCODINGS:
            progress(f"{w}: {enc or 'plain'} ...")
            results.append(run_one(w, enc, args.mib * MiB, args.cycles, args.steps, args.spill_dir))
    rows = []
    for r in results:
        rows.append([r["workload"], r["encoding"], f"{r['ratio']:.3f}", f"{r['sleep_s']:.3f}", f"{r['wake_s']:.3f}",
                     f"{r['bytes'] / r['sleep_s'] / 1e9:.2f}", f"{r['bytes'] / r['wake_s'] / 1e9:.2f}",
                     f"{r['held_bytes'] / MiB:.1f}", "yes" if r["exact"] else "NO"])
    print_table(f"backup encoding on host: {args.mib} MiB per workload, level-1 sleep/wake, medians of {args.cycles}",
                ["workload", "encoding", "stored/raw", "sleep s", "wake s", "sleep GB/s", "wake GB/s",
                 "backup MiB", "exact"], rows)
    write_json(path, "encoding-host", {"mib": args.mib, "cycles": args.cycles, "runs": results}, argv)
    return 0 if all(r["exact"] for r in results) else 1
