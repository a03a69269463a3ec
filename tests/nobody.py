"""Running an attacker as another user (uid 65534 through ``setpriv``) for the security tests.

Two kinds of attacker: one that needs this Python with torch and unisleep (a transfer-group
intruder), and one that needs only the standard library (a file-system attacker), run by the
first interpreter uid 65534 can execute — this one, or the system's ``python3`` when this one
lies where that uid cannot reach (e.g. a virtual environment under a 0700 home directory).
Without root or ``setpriv`` the attacks skip, saying which is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = 65534

_PROBLEMS: dict = {}


def _base_problem() -> Optional[str]:
    if os.geteuid() != 0:
        return "the attack tests switch to uid 65534 and need root (CI runs them as root)"
    if shutil.which("setpriv") is None:
        return "the attack tests need setpriv (util-linux) to run a process as uid 65534"
    return None


def as_nobody(args: list, python: Optional[str] = None) -> list:
    """The command running ``python`` (default: this interpreter) with ``args`` as uid 65534."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python or sys.executable, *args]


def nobody_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, HOME="/tmp", UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")


def nobody_problem() -> Optional[str]:
    """Why this Python with torch and unisleep cannot be run as uid 65534 here (None: it can)."""
    if "unisleep" not in _PROBLEMS:
        why = _base_problem()
        if why is None:
            r = subprocess.run(as_nobody(["-c", "import torch, unisleep, os; print(os.getuid())"]),
                               capture_output=True, text=True, timeout=120, env=nobody_env())
            if r.returncode != 0 or r.stdout.strip() != str(NOBODY):
                last = ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1]
                why = (f"setpriv --reuid={NOBODY} could not run this Python with torch and unisleep (are the "
                       f"interpreter and the checkout readable by uid {NOBODY}?): {last.split(':')[0][:80]}")
        _PROBLEMS["unisleep"] = why
    return _PROBLEMS["unisleep"]


def skip_without_nobody() -> None:
    why = nobody_problem()
    if why:
        pytest.skip(why)


def stdlib_python_for_nobody() -> str:
    """An interpreter uid 65534 can execute for a standard-library-only attacker (run it with
    ``-I -S``); skips, saying why, when there is none."""
    if "stdlib" not in _PROBLEMS:
        why, found = _base_problem(), None
        if why is None:
            tried = []
            for cand in (sys.executable, os.path.realpath(sys.executable), shutil.which("python3"),
                         "/usr/bin/python3", "/usr/local/bin/python3"):
                if not cand or cand in tried:
                    continue
                tried.append(cand)
                r = subprocess.run(as_nobody(["-I", "-S", "-c", "import os; print(os.getuid())"], python=cand),
                                   capture_output=True, text=True, timeout=60, cwd="/")
                if r.returncode == 0 and r.stdout.strip() == str(NOBODY):
                    found = cand
                    break
            if found is None:
                why = (f"no Python interpreter that uid {NOBODY} can execute (tried {', '.join(tried)}); install "
                       "the system python3 (Debian package: python3)")
        _PROBLEMS["stdlib"] = (why, found)
    why, found = _PROBLEMS["stdlib"]
    if why:
        pytest.skip(why)
    return found
