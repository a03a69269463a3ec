"""What reading paused weights with ``get_cpu_backup(x, zero_copy=True)`` costs through unisleep's
torch_memory_saver facade — what slime's weight sync does for every parameter while its trainer
is paused — with ``retain_cpu_backup`` off (each read lives for one pause: ordinary host memory)
and on (the read outlives resumes: page-locked memory of its own, paid once), beside the same
reads into ordinary tensors through the lifecycle.  Needs an accelerator with pools (CUDA).

    python tools/tms_examples/zero_copy_reads.py --tensors 256 --mib 32 --cycles 3 --json out/zero-copy.json

Each setting runs in a fresh process; the table gives per cycle: the pause, the zero-copy reads of
every tensor, and the resume (which gives non-retained reads back).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

_CHILD = """
    import json, sys, time
    import torch
    from unisleep.compat.torch_memory_saver import TorchMemorySaver
    n, size, cycles, retain = int(sys.argv[1]), int(sys.argv[2]) << 20, int(sys.argv[3]), sys.argv[4] == "1"
    tms = TorchMemorySaver()
    tms.retain_cpu_backup = retain
    with tms.region(tag="weights", enable_cpu_backup=True):
        ts = [torch.full((size,), i % 251, dtype=torch.uint8, device="cuda") for i in range(n)]
    rows = []
    for _ in range(cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); tms.pause("weights"); t1 = time.perf_counter()
        backups = [tms.get_cpu_backup(t, zero_copy=True) for t in ts]; t2 = time.perf_counter()
        ok = all(int(b[0]) == i % 251 for i, b in enumerate(backups))
        del backups
        tms.resume("weights"); t3 = time.perf_counter()
        rows.append({"pause_s": t1 - t0, "reads_s": t2 - t1, "resume_s": t3 - t2, "bytes_ok": ok})
    print(json.dumps(rows))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--mib", type=int, default=32, help="size of each tensor")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    out = {"tensors": args.tensors, "mib": args.mib, "settings": {}}
    print(f"{args.tensors} tensors of {args.mib} MiB, one tag with CPU backup")
    print("| retain_cpu_backup | cycle | pause (s) | zero-copy reads (s) | resume (s) | bytes |")
    print("|---|---|---|---|---|---|")
    for retain in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(args.tensors), str(args.mib),
                               str(args.cycles), retain], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        out["settings"]["on" if retain == "1" else "off"] = rows
        for i, r in enumerate(rows):
            print(f"| {'on' if retain == '1' else 'off'} | {i} | {r['pause_s']:.3f} | {r['reads_s']:.3f} | "
                  f"{r['resume_s']:.3f} | {'exact' if r['bytes_ok'] else 'WRONG'} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["bytes_ok"] for rows in out["settings"].values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
