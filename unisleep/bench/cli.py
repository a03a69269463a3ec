"""``unisleep bench``: dispatch to one benchmark.

=====================  ===================================================================
(no flag)              host sleep/wake throughput beside its limits (``unisleep.bench.host``)
``--backend NAME``     sleep/wake on a backend (``cuda``: the H200 workload, with peers)
``--transfer``         weight transfer by path (``unisleep.bench.transfer``)
``--chunk-sweep``      map/unmap cost by chunk size (``unisleep.bench.chunk_sweep``)
=====================  ===================================================================

Every mode prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv and len(argv) == 1 or "--help" in argv and len(argv) == 1:
        print(__doc__)
        return 0
    if "--transfer" in argv:
        argv.remove("--transfer")
        mod = "unisleep.bench.transfer"
    elif "--chunk-sweep" in argv:
        argv.remove("--chunk-sweep")
        mod = "unisleep.bench.chunk_sweep"
    else:
        backend = None
        for i, a in enumerate(argv):
            if a == "--backend" and i + 1 < len(argv):
                backend = argv[i + 1]
            elif a.startswith("--backend="):
                backend = a.split("=", 1)[1]
        mod = "unisleep.bench.host" if backend in (None, "host") else "unisleep.bench.device"
    return int(importlib.import_module(mod).main(argv) or 0)
