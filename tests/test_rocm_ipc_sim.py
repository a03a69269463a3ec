"""ROCm colocated IPC (backends/rocm/ipc.py) over the SIMULATED HIP library — no ROCm hardware.

Two real processes: the sender's exported descriptor is a real memfd (the simulator's physical
memory) sent with SCM_RIGHTS; the receiver imports and maps it, so both see the same bytes, as
two processes on one AMD GPU would.  The simulator refuses an export of memory not created for
it (``requestedHandleType``) and a grant away from the reservation's start (HIP 7.2 profile).
What this cannot show: that real HIP behaves like the simulator."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from sim.fake_hip import FakeHip
from unisleep.backends.rocm import hip, ipc
from unisleep.backends.rocm.hip import HipError

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GRAN = 64 << 10

RECEIVER = textwrap.dedent("""
    import os, socket, sys, torch
    sys.path.insert(0, sys.argv[1])
    from sim.fake_hip import FakeHip
    from unisleep.backends.rocm import ipc
    lib = FakeHip(granularity=64 << 10, total_bytes=64 << 20, runtime_version=int(sys.argv[3]))
    ipc.use_library(lib)
    ipc.TENSOR_DEVICE = "cpu"
    sock = socket.socket(fileno=int(sys.argv[2]))
    msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    nbytes = int(msg.decode())
    buf = ipc.ImportedBuffer(fds[0], nbytes, 0)
    got = int(buf.tensor.to(torch.int64).sum())
    buf.tensor.fill_(7)  # written through the import: the sender must see it
    ipc.synchronize(0)
    buf.close()
    assert lib.dev.used_bytes == 0 and not lib.dev.internal_errors, lib.dev.internal_errors
    sock.sendall(str(got).encode())
""")


@pytest.fixture(autouse=True)
def _sim_library():
    yield
    ipc._api = None
    ipc.TENSOR_DEVICE = None


@pytest.mark.slow
@pytest.mark.parametrize("version", [60200000, 70200000], ids=["hip-6.2", "hip-7.2"])
def test_rocm_sim_ipc_two_processes_share_one_buffer(version):
    lib = FakeHip(granularity=GRAN, total_bytes=64 << 20, runtime_version=version)
    ipc.use_library(lib)
    ipc.TENSOR_DEVICE = "cpu"
    nbytes = 3 * GRAN + 123
    buf = ipc.ExportBuffer(nbytes, 0)
    assert buf.size == 4 * GRAN and buf.tensor.numel() == nbytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    buf.tensor.copy_(src)
    ipc.synchronize(0)
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, TESTS, str(b.fileno()), str(version)],
                             pass_fds=[b.fileno()], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    b.close()
    try:
        socket.send_fds(a, [str(nbytes).encode()], [buf.fd()])
        a.settimeout(60)
        reply = a.recv(64).decode()
        rc = child.wait(60)
    finally:
        a.close()
        if child.poll() is None:
            child.kill()
    assert rc == 0, child.stderr.read()[-2000:]
    assert int(reply) == int(src.to(torch.int64).sum())  # the receiver read the sender's bytes
    assert int((buf.tensor == 7).sum()) == nbytes  # and the sender sees the receiver's writes
    grants = [e for e in lib.dev.log if e[0] == "hipMemSetAccess"]
    assert grants and all(e[1] == buf._va and e[2] == buf.size for e in grants)  # whole range, from its start
    buf.close()
    assert lib.dev.used_bytes == 0 and not lib.dev.reservations and not lib.dev.internal_errors
    lib.close()


def test_rocm_sim_ipc_export_needs_the_handle_type_requested_at_create():
    """An allocation created without requestedHandleType = POSIX fd (every lifecycle region)
    cannot be exported: the simulator refuses it, as HIP does, so IPC buffers are made for it."""
    from ctypes import byref, c_uint64, c_void_p

    lib = FakeHip(granularity=GRAN, total_bytes=16 << 20)
    ipc.use_library(lib)
    api = ipc._hip()
    prop = ipc._prop(api, 0)
    prop.requestedHandleType = hip.hipMemHandleTypeNone
    h = c_void_p()
    api.call("hipMemCreate", handle=byref(h), size=GRAN, prop=byref(prop), flags=0)
    out = c_uint64(0)
    with pytest.raises(HipError, match="hipErrorInvalidValue"):
        api.call("hipMemExportToShareableHandle", shareableHandle=byref(out), handle=h.value,
                 handleType=hip.hipMemHandleTypePosixFileDescriptor, flags=0)
    api.call("hipMemRelease", handle=h.value)
    assert lib.dev.used_bytes == 0
    lib.close()
