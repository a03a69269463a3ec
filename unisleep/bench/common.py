"""Shared output for every ``unisleep bench`` mode: a side-by-side table on stdout and a JSON
file with the machine, the command and every figure, so a run can be reproduced."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform as _platform
import socket
import sys
from typing import Any, Optional, Sequence

from ..cli import check_out_dir, check_out_file, children_leave_ctrl_c_to_us
from ..hostmem import meminfo


#: the folder every mode writes its JSON to unless --json says otherwise (out/ is in .gitignore)
OUT_DIR = "out"


def default_json(name: str) -> str:
    """``out/bench-<name>.json``, under the current folder."""
    return os.path.join(OUT_DIR, f"bench-{name}.json")


def add_output_options(ap, name: str) -> None:
    """Every mode's two output options, the same everywhere: ``--out FOLDER`` (the folder its JSON
    goes to, as ``unisleep demo --out``) and ``--json PATH`` (the file itself; wins over --out).
    ``name`` is how the mode's file is named in the help, ``bench-<name>.json``."""
    ap.add_argument("--out", default=None, help=f"folder for the JSON (default {OUT_DIR}, under the current folder)")
    ap.add_argument("--json", default=None, help=f"the JSON file itself (default bench-{name}.json in --out)")


def output_path(args, name: str) -> str:
    """The JSON file the options name (``--json``, else ``bench-<name>.json`` in ``--out`` or
    out/), checked before anything runs: :class:`~unisleep.errors.InvalidArgumentError` naming the
    option when it cannot be written; nothing is created."""
    if args.json:
        return check_out_file(args.json, "--json")
    if args.out:
        check_out_dir(args.out, "--out")
        return check_out_file(os.path.join(args.out, f"bench-{name}.json"), "--out")
    return check_out_file(default_json(name), "--out")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "platform": _platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception:  # no usable torch: the machine info says nothing of it
        pass
    total = meminfo().get("MemTotal")
    if total:  # absent when /proc/meminfo cannot be read
        info["mem_total_gib"] = round(total / 2**30, 1)
    return info


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> str:
    """Print and return a plain-text table (numbers formatted by the caller or with %.4g)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def write_json(path: Optional[str], kind: str, results: Any, argv: Optional[Sequence[str]] = None) -> Optional[str]:
    if not path:
        return None
    doc = {
        "kind": kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "unisleep bench " + " ".join(argv if argv is not None else sys.argv[2:]),
        "machine": machine_info(),
        "results": results,
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    print(f"wrote {path}", flush=True)
    return path


#: seconds between a wake and the next sleep where the workload stands for the rollout that
#: follows a wake (the unchanged-weights and level-2 cycles): a driver finishes the work a
#: release left under it, as under real generation, instead of handing it to the next sleep
GENERATION_PAUSE_S = 0.1
#: seconds between a sleep and the wake that follows it in the "after the trainer's turn" rows: in
#: RL the trainer runs between them (seconds), so by the wake the driver has finished what the
#: sleep's releases left it, and creating memory costs what it costs once the driver has settled
#: (more than right after a release, when the rows without this pause wake)
TRAINER_TURN_S = 1.0


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


RESULT_PREFIX = "UNISLEEP_RESULT "


def emit_result(result: Any) -> None:
    """A worker process's answer: one line on stdout that :func:`run_worker` reads."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(cmd: Sequence[str], impl: str) -> dict:
    """Run one implementation's benchmark worker in its own process; its result, or an entry
    saying it failed."""
    import subprocess

    progress(f"running {impl} ...")
    with children_leave_ctrl_c_to_us():  # on Ctrl-C the worker is killed here; it prints nothing
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        stdout, _ = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    line = next((l for l in stdout.splitlines() if l.startswith(RESULT_PREFIX)), None)
    if proc.returncode != 0 or line is None:
        progress(f"{impl} failed (exit {proc.returncode})")
        return {"impl": impl, "error": f"exit {proc.returncode}"}
    return json.loads(line[len(RESULT_PREFIX):])

