"""Ascend colocated IPC (backends/ascend/ipc.py) over the SIMULATED ACL library — no Ascend hardware.

Two real processes on one simulated NPU: the simulated driver's state (one record per shareable
handle, its pid whitelist) lives in a folder both processes use, and an import maps the
exporter's real memfd, so both processes see the same bytes, as two processes on one NPU would.
The sender learns the receiver's pid from the kernel (``SO_PEERCRED`` on the socket pair), never
from the receiver.  The simulator refuses what the Ascend driver refuses (tests/sim/fake_acl.py
cites its source): an import by a pid not on the whitelist, before any pid is set, by a process
that started after its pid was listed, twice, of an unknown handle or of another device's.
What this cannot show: that the real runtime behaves like the simulator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from sim.fake_acl import (ACL_ERROR_RT_DRV_INTERNAL_ERROR, ACL_ERROR_RT_INVALID_HANDLE, ACL_ERROR_RT_PARAM_INVALID,
                          FakeAcl)
from unisleep.backends.ascend import acl, ipc
from unisleep.errors import UnsupportedError
from unisleep.transfer.ipc import peer_credentials

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GRAN = 64 << 10

#: the receiver: imports what it is told over the socket and answers with the result
RECEIVER = textwrap.dedent("""
    import json, os, socket, sys, torch
    sys.path.insert(0, sys.argv[1])
    from sim.fake_acl import FakeAcl
    from unisleep.backends.ascend import ipc
    from unisleep.backends.ascend.acl import AclError
    bare = int(sys.argv[4])  # 0: the driver knows this process by its own pid
    lib = FakeAcl(driver_dir=sys.argv[3], granularity=64 << 10, total_bytes=64 << 20, device_count=2,
                  pid_offset=(bare - os.getpid()) if bare else 0)
    ipc.use_library(lib)
    ipc.TENSOR_DEVICE = "cpu"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[2].encode().decode("unicode_escape"))
    f = sock.makefile("rw")
    bufs = []
    for line in f:
        cmd = json.loads(line)
        out = {"ok": True}
        if cmd["op"] == "import":
            try:
                bufs.append(ipc.ImportedBuffer(cmd["handle"], cmd["nbytes"], cmd["device"]))
                out["sum"] = int(bufs[-1].tensor.to(torch.int64).sum())
            except AclError as e:
                why = next((x[3] for x in reversed(lib.dev.log) if x[0] == "error"), "")
                out = {"ok": False, "code": e.code, "call": e.call, "why": why}
        elif cmd["op"] == "write":
            bufs[-1].tensor.fill_(cmd["value"])
            ipc.synchronize(0)
        elif cmd["op"] == "close":
            for b in bufs:
                b.close()
            bufs.clear()
            out["used"] = lib.dev.used_bytes
        elif cmd["op"] == "exit":
            out["internal_errors"] = [repr(e) for e in lib.dev.internal_errors]
        f.write(json.dumps(out) + "\\n")
        f.flush()
        if cmd["op"] == "exit":
            break
""")


class Receiver:
    """A receiver process that connects to this process's Unix socket, as a transfer receiver
    does; ``pid`` is what the kernel says of the connecting process (SO_PEERCRED)."""

    def __init__(self, driver_dir: str, bare: int = 0):
        name = f"\0unisleep-test-ascend-ipc-{os.getpid()}-{id(self)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        listener.listen(1)
        listener.settimeout(60)
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, TESTS, name.encode("unicode_escape").decode(),
                                      driver_dir, str(bare)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            self.sock, _ = listener.accept()
        finally:
            listener.close()
        self.sock.settimeout(60)
        self.f = self.sock.makefile("rw")
        self.pid = peer_credentials(self.sock)[0]

    def ask(self, **cmd) -> dict:
        self.f.write(json.dumps(cmd) + "\n")
        self.f.flush()
        line = self.f.readline()
        assert line, self.proc.stderr.read()[-2000:] if self.proc.poll() is not None else "no answer"
        return json.loads(line)

    def finish(self) -> None:
        try:
            out = self.ask(op="exit")
            assert self.proc.wait(60) == 0, self.proc.stderr.read()[-2000:]
            assert out["internal_errors"] == []
        finally:
            self.sock.close()
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def sender(tmp_path):
    lib = FakeAcl(driver_dir=str(tmp_path), granularity=GRAN, total_bytes=64 << 20, device_count=2)
    ipc.use_library(lib)
    ipc.TENSOR_DEVICE = "cpu"
    yield lib
    ipc._api = None
    ipc.TENSOR_DEVICE = None
    assert not lib.dev.internal_errors
    lib.close()


def _calls(lib, name):
    return [e for e in lib.dev.log if e[0] == name]


@pytest.mark.slow
def test_ascend_sim_ipc_two_processes_share_one_buffer(sender, tmp_path):
    nbytes = 3 * GRAN + 123
    buf = ipc.ExportBuffer(nbytes, 0)
    assert buf.size == 4 * GRAN and buf.tensor.numel() == nbytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    buf.tensor.copy_(src)
    ipc.synchronize(0)
    rx = Receiver(str(tmp_path))
    try:
        assert rx.pid == rx.proc.pid  # the kernel's word, not the receiver's
        h = buf.handle_for(rx.pid)
        assert buf.handle_for(rx.pid) == h  # exported once, the pid listed once
        got = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert got["ok"], got
        assert got["sum"] == int(src.to(torch.int64).sum())  # the receiver read the sender's bytes
        assert rx.ask(op="write", value=7)["ok"]
        assert int((buf.tensor == 7).sum()) == nbytes  # and the sender sees the receiver's writes
        assert rx.ask(op="close")["used"] == 0
        rx.finish()
    finally:
        if rx.proc.poll() is None:
            rx.proc.kill()
    exports = _calls(sender, "aclrtMemExportToShareableHandle")
    assert len(exports) == 1 and exports[0][3] == acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT  # the whitelist stays on
    assert len(_calls(sender, "aclrtMemSetPidToShareableHandle")) == 1
    buf.close()
    assert sender.dev.used_bytes == 0 and not sender.dev.reservations


@pytest.mark.slow
def test_ascend_sim_ipc_imports_the_driver_refuses(sender, tmp_path):
    """Each refusal of the simulated driver, in a real second process, with ACL's code."""
    nbytes = GRAN
    buf = ipc.ExportBuffer(nbytes, 0)
    buf.tensor.fill_(3)
    ipc.synchronize(0)
    api = ipc._acl()
    rx = Receiver(str(tmp_path))
    late = None
    try:
        # exported, no pid set yet: nobody may import
        from ctypes import byref, c_uint64

        out = c_uint64(0)
        api.call("aclrtMemExportToShareableHandle", handle=buf._handle, handleType=0, flags=0,
                 shareableHandle=byref(out))
        buf._shareable = h = int(out.value)
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_DRV_INTERNAL_ERROR and "not add in pid list" in r["why"], r
        assert r["call"] == "aclrtMemImportFromShareableHandle"
        # another process's pid listed: still not this one
        buf.handle_for(os.getppid())
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_DRV_INTERNAL_ERROR and "not add in pid list" in r["why"], r
        # listed now (the kernel's pid): another device's import, then a handle naming another device
        buf.handle_for(rx.pid)
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=1)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_PARAM_INVALID, r
        r = rx.ask(op="import", handle=h ^ (1 << 32), nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_INVALID_HANDLE and "doesn't exist" in r["why"], r
        # the right one imports, once
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert r["ok"] and r["sum"] == 3 * nbytes, r
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_INVALID_HANDLE and "multi times" in r["why"], r
        assert rx.ask(op="close")["used"] == 0  # freed: it may import again
        assert rx.ask(op="import", handle=h, nbytes=nbytes, device=0)["ok"]
        assert rx.ask(op="close")["used"] == 0
        # a pid listed before its process started (a reused pid) is not that process
        listed = 4_000_000 + os.getpid() % 100_000
        buf.handle_for(listed)
        time.sleep(0.05)  # /proc's start time counts 10 ms ticks: start the process a tick later
        late = Receiver(str(tmp_path), bare=listed)
        r = late.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_DRV_INTERNAL_ERROR and "Time check" in r["why"], r
        late.finish()
        # the exporter cannot import its own handle
        with pytest.raises(acl.AclError, match="ACL_ERROR_RT_DRV_INTERNAL_ERROR"):
            ipc.ImportedBuffer(h, nbytes, 0)
        # once the exporter frees it, the handle is gone for new imports
        buf.close()
        r = rx.ask(op="import", handle=h, nbytes=nbytes, device=0)
        assert not r["ok"] and r["code"] == ACL_ERROR_RT_INVALID_HANDLE, r
        rx.finish()
    finally:
        for p in (rx, late):
            if p is not None and p.proc.poll() is None:
                p.proc.kill()
    assert sender.dev.used_bytes == 0


def test_ascend_sim_ipc_refuses_a_pid_namespace_the_driver_does_not_share(tmp_path):
    """In a container with its own pid namespace the driver knows the process by another pid
    (SIMULATED: ``pid_offset``); the pids SO_PEERCRED reports there would whitelist the wrong
    processes.  Refused when the buffer is made, before any memory is allocated or exported."""
    lib = FakeAcl(driver_dir=str(tmp_path), granularity=GRAN, total_bytes=16 << 20, pid_offset=100_000)
    ipc.use_library(lib)
    ipc.TENSOR_DEVICE = "cpu"
    try:
        with pytest.raises(UnsupportedError, match=r"--pid=host.*platform='host'"):
            ipc.ExportBuffer(GRAN, 0)
        assert not _calls(lib, "aclrtMallocPhysical") and not _calls(lib, "aclrtMemExportToShareableHandle")
    finally:
        ipc._api = None
        ipc.TENSOR_DEVICE = None
        lib.close()


def test_ascend_sim_ipc_refuses_a_pid_the_kernel_could_not_name(sender):
    """SO_PEERCRED says 0 for a peer outside this pid namespace: nothing is exported for it."""
    buf = ipc.ExportBuffer(GRAN, 0)
    for bad in (0, -1):
        with pytest.raises(UnsupportedError, match="pid"):
            buf.handle_for(bad)
    assert not _calls(sender, "aclrtMemExportToShareableHandle")
    buf.close()
    assert sender.dev.used_bytes == 0
