"""``unisleep`` command line: ``doctor``, ``demo``, ``bench``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

COMMANDS = {
    "doctor": ("unisleep.doctor", "the platform and why, devices, optional packages, warnings"),
    "demo": ("unisleep.demo", "the main job: a colocated RL loop on the embedded default"),
    "bench": ("unisleep.bench.cli", "benchmarks: a side-by-side table and JSON"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="unisleep", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every sleep/wake")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    # split global options from the subcommand's own
    idx = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if idx is None:
        parser.print_help()
        return 2
    args = parser.parse_args(argv[: idx + 1])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.main(argv[idx + 1 :]) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
