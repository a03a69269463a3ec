"""Whole-process capture on an NVIDIA GPU (marker ``cuda``): with ``TMS_INIT_ENABLE=1`` every
segment torch's caching allocator asks the CUDA runtime for (libc10_cuda's ``cudaMalloc``)
is a lifecycle region of tag "default", in a child process started as slime's and AReaL's
workers are (``LD_PRELOAD`` of unisleep's library and the TMS_INIT_* variables, nothing else).

Checked with the device's own free memory (``cudaMemGetInfo``): a pause gives back weights,
optimizer state and torch's cached activations; ``disable()`` allocates from a throwaway pool
given back at its end; resume brings the bytes back at the same addresses; torch's own
release of cached segments on out-of-memory still works under capture (the case a
process-wide pool routing breaks); and ``get_cpu_backup(zero_copy=True)`` keeps its host
tensor across a retained resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CODE = """
    import json, os, sys
    sys.path.append(os.environ["UNISLEEP_SRC"])
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    GiB, MiB = 1 << 30, 1 << 20
    out = {"facade": type(tms).__module__, "library": os.path.basename(tms._capture.library)}

    def free():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    start = free()
    w = torch.full((GiB,), 42, dtype=torch.uint8, device="cuda")          # "weights"
    m = torch.randn(64 * MiB, device="cuda")                              # "optimizer state"
    act = torch.ones(GiB // 4, device="cuda") * 3                         # an activation...
    del act                                                               # ...left in torch's cache
    with tms.disable():
        ref_m = m.cpu()
    out["captured"] = tms.resident_bytes("default")
    before = free()
    tms.pause()
    out["freed_by_pause"] = free() - before
    with tms.disable():
        out["disable_same"] = free() == free()
        x = torch.full((2 * GiB,), 1, dtype=torch.uint8, device="cuda")
        out["disable_used"] = int(x.sum().item()) == 2 * GiB
        del x
    out["disable_given_back"] = abs(free() - (before + out["freed_by_pause"])) < 64 * MiB
    backup = tms.get_cpu_backup(m, zero_copy=True)
    ptr = backup.data_ptr()
    tms.retain_cpu_backup = True
    tms.resume()
    out["restored"] = bool(torch.equal(m.cpu(), ref_m)) and int(w.min().item()) == 42 == int(w.max().item())
    out["retained_same_tensor"] = tms.get_cpu_backup(m, zero_copy=True).data_ptr() == ptr
    # torch frees its cached (captured) segments and retries when the device runs out
    total = torch.cuda.mem_get_info()[1]
    a = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    b = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    del a, b
    c = torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
    out["oom_retry"] = c.numel() == int(total * 0.6)
    del c
    torch.cuda.empty_cache()
    out["owned_after_empty_cache"] = tms._capture.owned
    print(json.dumps(out))
"""


def test_whole_process_capture_on_cuda():
    so = os.path.join(ROOT, "unisleep", "torch_memory_saver_hook_mode_preload.abi3.so")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k not in ("PYTHONPATH", "UNISLEEP_TMS")}
    env.update(LD_PRELOAD=so, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", UNISLEEP_SRC=ROOT)
    env.pop("UNISLEEP_PLATFORM", None)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(got))
    GiB = 1 << 30
    assert got["facade"] == "unisleep.compat.torch_memory_saver" and got["library"].startswith("libc10_cuda"), got
    assert got["captured"] >= GiB + GiB // 4 + GiB // 4, got  # weights, state, the cached activation
    assert got["freed_by_pause"] >= GiB + GiB // 4, got
    for k in ("disable_same", "disable_used", "disable_given_back", "restored", "retained_same_tensor", "oom_retry"):
        assert got[k] is True, (k, got)
