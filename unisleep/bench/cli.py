"""``unisleep bench``: dispatch to one benchmark.

=====================  ===================================================================
(no flag)              host sleep/wake throughput beside its limits (``unisleep.bench.host``)
``--backend NAME``     sleep/wake on a backend (an accelerator: the large workload, with peers)
``--transfer``         weight transfer by path (``unisleep.bench.transfer``)
``--chunk-sweep``      map/unmap cost by chunk size (``unisleep.bench.chunk_sweep``)
``--compat-tms``       tms facade beside tms 0.0.10 (``unisleep.bench.compat_tms``)
``--progressive``      progressive wake / background sleep beside the plain ones (``unisleep.bench.progressive``)
=====================  ===================================================================

Every mode prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

MODES = (
    ("(no mode flag)", "host sleep/wake throughput beside its limits, measured in the same run"),
    ("--backend NAME", "sleep/wake on a backend's devices (the large workload, beside other libraries)"),
    ("--transfer", "weight transfer by path"),
    ("--chunk-sweep", "map/unmap cost by chunk size"),
    ("--compat-tms", "the torch_memory_saver facade beside torch_memory_saver 0.0.10, same run"),
    ("--progressive", "progressive wake and background sleep beside the plain ones (with --backend NAME)"),
)


def mode_help() -> str:
    width = max(len(m) for m, _ in MODES)
    lines = ["usage: unisleep bench [--backend NAME [--progressive] | --transfer | --chunk-sweep | --compat-tms] [options]", "",
             "Benchmarks; every mode prints a table and writes JSON. Modes:"]
    lines += [f"  {m:<{width}}  {d}" for m, d in MODES]
    lines += ["", "Each mode's options: unisleep bench --transfer --help, unisleep bench --chunk-sweep --help,",
              "unisleep bench --backend NAME --help. Without a mode flag (the host benchmark):", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--transfer" in argv:
        argv.remove("--transfer")
        mod = "unisleep.bench.transfer"
    elif "--chunk-sweep" in argv:
        argv.remove("--chunk-sweep")
        mod = "unisleep.bench.chunk_sweep"
    elif "--compat-tms" in argv:
        argv.remove("--compat-tms")
        mod = "unisleep.bench.compat_tms"
    elif "--progressive" in argv:
        mod = "unisleep.bench.progressive"
    else:
        backend = None
        for i, a in enumerate(argv):
            if a == "--backend" and i + 1 < len(argv):
                backend = argv[i + 1]
            elif a.startswith("--backend="):
                backend = a.split("=", 1)[1]
        mod = "unisleep.bench.host" if backend in (None, "host") else "unisleep.bench.device"
        if mod == "unisleep.bench.host" and ("-h" in argv or "--help" in argv):
            print(mode_help())  # then the host benchmark's own options (argparse exits 0)
    return int(importlib.import_module(mod).main(argv) or 0)
