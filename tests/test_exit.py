"""The interpreter exits cleanly whatever state the memory is in, and frees it: exit code 0, no
traceback, no spill files left behind.  Each case runs in its own Python process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import os, sys, threading, torch
from unisleep import MemoryLifecycle
SPILL = sys.argv[1]
lc = MemoryLifecycle("host", spill_dir=SPILL)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
lc.adopt(model)
kv = lc.empty((8 << 20,), torch.uint8, tag="kv_cache")
kv.fill_(3)
"""

CASES = {
    "awake": "",
    "asleep-level1": "lc.sleep(1)",
    "asleep-level2": "lc.sleep(2)",
    "partly-awake": "lc.sleep(1); lc.wake_up(['weights'])",
    "kv-discarded": "lc.discard(['kv_cache'])",
    "closed-twice": "lc.sleep(1); lc.close(); lc.close()",
    "sys-exit-asleep": "lc.sleep(1); sys.exit(0)",
    "two-lifecycles": "lc2 = MemoryLifecycle('host', spill_dir=SPILL); t = lc2.empty((1 << 20,), tag='weights'); "
                      "lc2.sleep(1); lc.sleep(2)",
    "deleted-while-asleep": "lc.sleep(1); del lc; import gc; gc.collect()",
    "module-still-referenced": "lc.sleep(1); import builtins; builtins.KEEP = (model, kv)",
    "daemon-thread-cycling": """
from unisleep.errors import InvalidTransitionError
def spin():
    try:
        while True:
            lc.sleep(1)
            lc.wake_up()
    except InvalidTransitionError:  # the lifecycle was closed at exit: the documented answer
        pass
t = threading.Thread(target=spin, daemon=True)
t.start()
import time; time.sleep(0.3)
""",
}


def run_script(body: str, spill_dir: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if k != "UNISLEEP_PLATFORM"}
    return subprocess.run([sys.executable, "-c", code, spill_dir], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_clean_exit(tmp_path, case):
    spill = tmp_path / "spill"
    spill.mkdir()
    r = run_script(CASES[case], str(spill))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert os.listdir(spill) == [], "spill files left behind after exit"


def test_touching_sleeping_memory_faults(tmp_path):
    """Sleeping memory is really unmapped: touching it is the host analogue of an illegal address."""
    r = run_script("lc.sleep(1)\nkv[0] = 1\nprint('not reached')", str(tmp_path))
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr)
    assert "not reached" not in r.stdout
