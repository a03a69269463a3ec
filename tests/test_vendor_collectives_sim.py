"""The Ascend and ROCm transfer collectives (backends/ascend/collective.py, backends/rocm/
collective.py) driven over STAND-INS for HCCL and RCCL: no NPU, no AMD GPU, no torch_npu here, so
``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` (a simulated module) and, for RCCL, this CPU
torch's ``ProcessGroupNCCL`` (replaced in the child) build torch's real gloo backend on the same
store.  What runs for real: unisleep's ``create_backend`` (its imports, the
Options it fills, the device it sets, HCCL's loopback setting) in two real processes over one
real store, and a broadcast through the backend it returns.  What does not: HCCL itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = textwrap.dedent("""
    import datetime, os, sys, types, torch
    import torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    calls = []

    class Options:  # torch_npu's ProcessGroupHCCL.Options: unisleep sets _timeout
        def __init__(self):
            self._timeout = None

    class ProcessGroupHCCL:  # SIMULATED: the real one needs an NPU; this is torch's gloo backend
        Options = Options
        def __new__(cls, store, rank, size, options):
            assert isinstance(options, Options) and isinstance(options._timeout, datetime.timedelta)
            calls.append(("ProcessGroupHCCL", rank, size, options._timeout.total_seconds()))
            return dist.ProcessGroupGloo(store, rank, size, options._timeout)

    c10d = types.ModuleType("torch_npu._C._distributed_c10d")
    c10d.ProcessGroupHCCL = ProcessGroupHCCL
    C = types.ModuleType("torch_npu._C"); C._distributed_c10d = c10d
    npu = types.ModuleType("torch_npu"); npu._C = C
    sys.modules.update({"torch_npu": npu, "torch_npu._C": C, "torch_npu._C._distributed_c10d": c10d})
    torch.npu = types.SimpleNamespace(set_device=lambda i: calls.append(("set_device", i)))

    from unisleep.backends.ascend import collective
    store = dist.FileStore(path, 2)
    pg = collective.create_backend(store, rank, 2, datetime.timedelta(seconds=30), 0, host="127.0.0.1")
    t = torch.arange(1000, dtype=torch.float32) if rank == 0 else torch.zeros(1000)
    pg.broadcast([t], dist.BroadcastOptions()).wait()
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32)), "broadcast did not arrive"
    print(collective.BACKEND, calls, os.environ.get("HCCL_IF_IP"), flush=True)
    pg.barrier().wait()
    del pg  # a gloo backend still alive when the interpreter ends can abort it (torch 2.13.0: std::terminate)
""")


@pytest.mark.slow
def test_ascend_collective_create_backend_over_a_gloo_stand_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HCCL_IF_IP"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-2000:]
        outs.append(out.strip().splitlines()[-1])
    for r, line in enumerate(outs):
        assert line == f"hccl [('set_device', 0), ('ProcessGroupHCCL', {r}, 2, 30.0)] 127.0.0.1", line


RCCL_RANK = textwrap.dedent("""
    import datetime, os, sys, torch
    import torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    calls = []

    class Options:
        def __init__(self):
            self._timeout = None

    class ProcessGroupNCCL:  # SIMULATED: RCCL needs an AMD GPU; this is torch's gloo backend
        Options = Options
        def __new__(cls, store, rank, size, options):
            assert isinstance(options, Options) and isinstance(options._timeout, datetime.timedelta)
            calls.append(("ProcessGroupNCCL", rank, size))
            return dist.ProcessGroupGloo(store, rank, size, options._timeout)

    dist.ProcessGroupNCCL = ProcessGroupNCCL
    torch.cuda.set_device = lambda i: calls.append(("set_device", i))
    from unisleep.backends.rocm import collective
    store = dist.FileStore(path, 2)
    pg = collective.create_backend(store, rank, 2, datetime.timedelta(seconds=30), 0, host="127.0.0.1")
    t = torch.arange(1000, dtype=torch.float32) if rank == 0 else torch.zeros(1000)
    pg.broadcast([t], dist.BroadcastOptions()).wait()
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32)), "broadcast did not arrive"
    print(collective.BACKEND, calls, os.environ.get("NCCL_SOCKET_IFNAME"), flush=True)
    pg.barrier().wait()
    del pg  # a gloo backend still alive when the interpreter ends can abort it (torch 2.13.0: std::terminate)
""")


@pytest.mark.slow
def test_rocm_collective_create_backend_over_a_gloo_stand_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_SOCKET_IFNAME"}
    procs = [subprocess.Popen([sys.executable, "-c", RCCL_RANK, str(r), str(tmp_path / "store")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-2000:]
        line = out.strip().splitlines()[-1]
        assert line.startswith(f"nccl [('set_device', 0), ('ProcessGroupNCCL', {r}, 2)] "), line
        assert line.split()[-1] not in ("None", ""), line  # NCCL's sockets pinned to the loopback interface
