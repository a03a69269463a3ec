"""The private parts of torch_memory_saver's ``_impl`` that its own examples use (its
test/examples/cpu_backup.py), on the host backend, in a child process with whole-process capture
(``TMS_INIT_ENABLE=1``) so that torch's own CPU allocations are lifecycle regions:

* the host tensor ``get_cpu_backup(x, zero_copy=True)`` hands out is forgotten when ``x``'s
  allocation is freed, so its memory goes back once the caller drops it (before: kept for the
  life of the process — a leak of every retained backup read that way);
* ``_impl._with_region_config`` sets the thread's tms settings and restores them;
* ``_impl._binary_wrapper.cdll`` reaches runtime functions the native library does not define
  (tms's library links the runtime; its example calls ``cdll.cudaHostGetFlags``): on the host
  backend, the process's own symbols;
* ``_impl._mem_pools`` lists only backends with pools (none here) and cannot be set.

The CUDA side (the pool popped from ``_mem_pools``, page-locked memory given back) is
tests/cuda/test_compat_tms_cuda.py::test_retained_backup_is_given_back_with_its_allocation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from unisleep.compat import shim_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CODE = """
    import gc, json, os
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    from unisleep.errors import InvalidArgumentError
    out = {}
    with tms.region(tag="r", enable_cpu_backup=True):
        x = torch.full((1 << 20,), 7, dtype=torch.uint8)
    tms.retain_cpu_backup = True
    tms.pause("r")
    b = tms.get_cpu_backup(x, zero_copy=True)
    out["backup_ok"] = int(b.min()) == 7 == int(b.max())
    tms.resume("r")
    out["same_after_resume"] = tms.get_cpu_backup(x, zero_copy=True).data_ptr() == b.data_ptr()
    out["held_while_retained"] = len(tms._zero_copy)
    with tms._impl._with_region_config(tag="r", enable_cpu_backup=True):
        c = tms._impl._binary_wrapper.cdll
        out["inside"] = [c.tms_get_current_tag().decode(), bool(c.tms_get_interesting_region()),
                         bool(c.tms_get_enable_cpu_backup())]
        del x
        gc.collect()
    out["held_after_free"] = len(tms._zero_copy)
    out["callers_copy_intact"] = int(b.min()) == 7 == int(b.max())  # the caller's tensor stays valid
    out["after"] = [c.tms_get_current_tag().decode(), bool(c.tms_get_enable_cpu_backup())]
    out["runtime_symbol"] = c.getpid() == os.getpid()
    try:
        c.no_such_function_anywhere
        out["unknown"] = "found"
    except AttributeError:
        out["unknown"] = "AttributeError"
    out["pools"] = len(tms._impl._mem_pools)
    try:
        tms._impl._mem_pools[("r", True, False, "pinned", 0)] = None
        out["set"] = "accepted"
    except InvalidArgumentError:
        out["set"] = "refused"
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_private_parts_used_by_torch_memory_savers_examples():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k not in ("LD_PRELOAD",)}
    env.update(UNISLEEP_PLATFORM="host", UNISLEEP_TMS="1", TMS_INIT_ENABLE="1",
               PYTHONPATH=f"{shim_dir()}:{ROOT}")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["backup_ok"] and got["same_after_resume"] and got["held_while_retained"] == 1, got
    assert got["inside"] == ["r", True, True], got
    assert got["held_after_free"] == 0 and got["callers_copy_intact"] is True, got
    assert got["after"] == ["default", False], got
    assert got["runtime_symbol"] is True and got["unknown"] == "AttributeError", got
    assert got["pools"] == 0 and got["set"] == "refused", got
