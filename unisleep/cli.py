"""The ``unisleep`` command line: ``doctor``, ``demo``, ``bench``."""

from __future__ import annotations

import difflib
import importlib
import logging
import re
import sys
from typing import Optional, Sequence

COMMANDS = {
    "doctor": ("unisleep.doctor", "the platform and why, devices, optional packages, warnings"),
    "demo": ("unisleep.demo", "the main job: a colocated RL loop on the embedded default"),
    "bench": ("unisleep.bench.cli", "benchmarks: a side-by-side table and JSON"),
}

USAGE = "usage: unisleep [-h] [--version] [-v] COMMAND [options]"


def plain(text: Optional[str]) -> str:
    """A docstring as plain text for ``--help``: no reStructuredText markup (``x``, :mod:`x`,
    table borders)."""
    if not text:
        return ""
    text = re.sub(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :mod:`x`, :class:`~a.b`
    text = text.replace("``", "")
    lines = [ln for ln in text.splitlines() if not re.fullmatch(r"\s*=+(\s+=+)*\s*", ln)]  # table borders
    return "\n".join(lines).strip("\n")


def help_text() -> str:
    from . import __version__

    width = max(len(c) for c in COMMANDS)
    lines = [USAGE, "",
             f"unisleep {__version__}: sleep, wake and weight transfer for RL trainers and rollout engines",
             "that share accelerators.", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "options:",
              "  -h, --help     show this help and exit",
              "  --version      print the version and exit",
              "  -v, --verbose  log every sleep/wake",
              "", "Each command has its own options: unisleep COMMAND --help"]
    return "\n".join(lines)


def _unknown(word: str) -> int:
    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    print(f"unisleep: unknown command '{word}'.{hint} Commands: {', '.join(COMMANDS)} "
          "(unisleep --help lists them).", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            print(help_text())
            return 0
        if arg == "--version":
            from . import __version__

            print(f"unisleep {__version__}")
            return 0
        if arg in ("-v", "--verbose"):
            verbose = True
            continue
        if arg.startswith("-"):
            print(f"unisleep: unknown option '{arg}' before the command. {USAGE}", file=sys.stderr)
            return 2
        if arg not in COMMANDS:
            return _unknown(arg)
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
        module = importlib.import_module(COMMANDS[arg][0])
        return int(module.main(argv[i + 1:]) or 0)
    print(help_text())  # bare `unisleep`
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
