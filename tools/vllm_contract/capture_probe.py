#!/usr/bin/env python3
"""Which driver calls made by *another* thread invalidate a CUDA-graph capture in torch's default
global mode: one fresh process per call (an invalidated capture can abort the process).

    python3 tools/vllm_contract/capture_probe.py [--json out.json]

The main thread captures a small GEMM chain with ``torch.cuda.graph`` (global mode); a second
thread makes one driver call while the capture is open; the main thread then records more work
and ends the capture.  A call is safe when the capture ends without error and its replay equals
eager.  Calls: what unisleep's background work does (page-locking host memory, releasing device
memory, creating and mapping it, a copy on its own stream, a device synchronise), and the
page-locking again from a thread switched to the relaxed capture-interaction mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CALLS = ["none", "cuMemHostRegister", "cuMemHostRegister-relaxed-thread", "cuMemRelease",
         "cuMemCreate+Map+SetAccess", "copy-on-own-stream", "torch.cuda.synchronize"]


def child(call: str) -> int:
    import ctypes
    import threading

    import torch
    from cuda.bindings import driver as cu

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    cu.cuInit(0)
    _, ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    size = 1 << 30
    pre_handle = cu.cuMemCreate(size, prop, 0)[1] if call == "cuMemRelease" else None
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)
    ctypes.memset(addr, 1, size)
    pinned = torch.empty(size // 4, dtype=torch.uint8, pin_memory=True) if call == "copy-on-own-stream" else None
    src = torch.ones(size // 4, dtype=torch.uint8, device=dev) if pinned is not None else None
    errs = []

    def work():
        try:
            cu.cuCtxSetCurrent(ctx)
            if call.endswith("relaxed-thread"):
                cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
            if call.startswith("cuMemHostRegister"):
                errs.append(str(cu.cuMemHostRegister(addr, size, 0)[0]))
            elif call == "cuMemRelease":
                errs.append(str(cu.cuMemRelease(pre_handle)[0]))
            elif call == "cuMemCreate+Map+SetAccess":
                e, h = cu.cuMemCreate(size, prop, 0)
                e2, va = cu.cuMemAddressReserve(size, 0, 0, 0)
                errs.append(str((e, e2, cu.cuMemMap(va, size, 0, h, 0)[0], cu.cuMemSetAccess(va, size, [acc], 1)[0])))
            elif call == "copy-on-own-stream":
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    pinned.copy_(src, non_blocking=True)
                s.synchronize()
                errs.append("copied")
            elif call == "torch.cuda.synchronize":
                torch.cuda.synchronize()
                errs.append("synchronized")
        except Exception as e:
            errs.append(f"{type(e).__name__}: {e}")

    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(4)])
    x = torch.randn(64, 2048, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        m(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    outcome = "ok"
    try:
        with torch.no_grad(), torch.cuda.graph(g):
            y = m(x)
            if call != "none":
                t = threading.Thread(target=work)
                t.start()
                t.join()
            time.sleep(0.05)
            y = m(y)
        g.replay()
        with torch.no_grad():
            if not torch.equal(y, m(m(x))):
                outcome = "replay differs"
    except Exception as e:
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps({"call": call, "outcome": outcome, "thread": errs}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    rows = []
    for call in CALLS:
        p = subprocess.run([sys.executable, __file__, "--child", call], capture_output=True, text=True, timeout=300)
        res = {"call": call, "outcome": "?", "thread": []}
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                res = json.loads(line)
        res["rc"] = p.returncode
        res["aborted"] = p.returncode in (-6, 134)
        res["stderr_signs"] = [s for s in ("terminate called", "INTERNAL ASSERT", "StreamCaptureInvalidated",
                                           "CUBLAS_STATUS", "operation not permitted when stream is capturing")
                               if s in p.stderr]
        rows.append(res)
        print(f"| {call} | {res['outcome']} | {res['thread']} | rc {p.returncode} | {', '.join(res['stderr_signs'])} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
