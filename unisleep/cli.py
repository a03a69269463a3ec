"""The ``unisleep`` command line: ``doctor``, ``demo``, ``bench``."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import importlib
import logging
import os
import re
import stat
import signal
import sys
import tempfile
import threading
from typing import Optional, Sequence

from .errors import InvalidArgumentError

COMMANDS = {
    "doctor": ("unisleep.doctor", "the platform and why, devices, optional packages, warnings"),
    "demo": ("unisleep.demo", "a colocated RL loop on the embedded default"),
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the description's line breaks and shows every option's default (where its
    help does not already say it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.option_strings == [] or action.nargs == 0):
            return text
        return f"{text} (default {action.default})"


class CommandParser(argparse.ArgumentParser):
    """The parser of every ``unisleep`` command: a wrong option or value is answered the same way
    everywhere — one line, ``PROG: what is wrong (PROG --help lists the options)``, exit 2, no usage
    dump — and ``--help`` shows the defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's contract: print and exit, never return
        message = message.rstrip(".")
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the options)\n")


_NEGATIVE = re.compile(r"-[0-9.]")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that a value which looks negative (``--size -1G``,
    ``--sizes -1,2``) stays the value of the option before it, so the option's own check says
    what is wrong with it (argparse would answer "expected one argument")."""
    takes_value = {s for a in parser._actions if isinstance(a, argparse._StoreAction) and a.nargs is None
                   for s in a.option_strings}
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in takes_value:
            nxt = next(it, None)
            if nxt is not None and _NEGATIVE.match(nxt):
                out.append(f"{arg}={nxt}")
                continue
            out.append(arg)
            if nxt is not None:
                out.append(nxt)
            continue
        out.append(arg)
    return parser.parse_args(out)


def nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def can_create_in(folder: str) -> Optional[str]:
    """None when something can be created in ``folder`` (tried with a folder made and removed
    at once: read-only mounts and pseudo-filesystems refuse root too); otherwise why not."""
    try:
        made = tempfile.mkdtemp(prefix=".unisleep-write-check-", dir=folder)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.isdir(folder):  # /proc, /sys: the kernel's files, no new ones
            return "it takes no new files (a kernel pseudo-filesystem such as /proc or /sys)"
        return e.strerror or str(e)
    os.rmdir(made)
    return None


def _check_folder(folder: str, option: str, shown: str, fix: str) -> None:
    where = nearest_existing(folder)
    if where == os.path.abspath(folder):
        if not os.path.isdir(where):
            raise InvalidArgumentError(f"{option} {shown}: {'it' if shown == folder else where} exists and is not a "
                                       f"folder. {fix}")
    elif not os.path.isdir(where):
        raise InvalidArgumentError(f"{option} {shown}: {where} is a file, so no folder can be made under it. {fix}")
    why = can_create_in(where)
    if why:
        raise InvalidArgumentError(f"{option} {shown}: cannot write in {where}: {why}. {fix}")


def check_out_dir(path: str, option: str = "--out") -> str:
    """Raise :class:`~unisleep.errors.InvalidArgumentError` unless ``path`` is a folder this
    process can write in, or one it can create; nothing is created.  Returns ``path``."""
    _check_folder(path, option, path, f"Pass {option} a folder you can write to.")
    return path


def check_out_file(path: str, option: str = "--json") -> str:
    """Raise :class:`~unisleep.errors.InvalidArgumentError` unless file ``path`` can be written
    (an existing regular file this process may write, or a new file in a folder it can write in
    or create); nothing is created or changed.  Returns ``path``."""
    fix = f"Pass {option} a file path you can write to."
    if os.path.lexists(path):
        try:
            st = os.stat(path)
        except OSError as e:
            raise InvalidArgumentError(f"{option} {path}: {e.strerror}. {fix}") from None
        if stat.S_ISDIR(st.st_mode):
            raise InvalidArgumentError(f"{option} {path}: it is a folder. {fix}")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{option} {path}: it is not a regular file. {fix}")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))  # opened, nothing written
        except OSError as e:
            raise InvalidArgumentError(f"{option} {path}: cannot write it: {e.strerror}. {fix}") from None
        return path
    _check_folder(os.path.dirname(os.path.abspath(path)), option, path, fix)
    return path


@contextlib.contextmanager
def children_leave_ctrl_c_to_us():
    """Processes started inside ignore SIGINT (an ignored signal stays ignored through exec, and
    Python keeps it so); keep only the start inside, as this process ignores it there too.  A
    Ctrl-C at the terminal reaches every process of the foreground group: this process answers
    it — it stops its children and says so in one line — instead of each child printing a
    traceback of its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


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
        try:
            module = importlib.import_module(COMMANDS[arg][0])
            return int(module.main(argv[i + 1:]) or 0)
        except KeyboardInterrupt:  # Ctrl-C: what was made is cleaned up on the way out; one line
            print(f"unisleep {arg}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
            return 130
    print(help_text())  # bare `unisleep`
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
