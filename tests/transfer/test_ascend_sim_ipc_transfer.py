"""The transfer's IPC path with the Ascend ipc module, in two real processes over the SIMULATED
ACL library — no Ascend hardware, no torch_npu: the group runs on the host platform with only its
ipc module replaced (ascend_sim_ipc_worker.py says what stands in).  The sender whitelists the
pid the kernel reports for the receiver's connection and sends the handle in the ``buf`` message;
the simulated driver refuses an import by any other pid, so a whitelist built from anything but
the receiver's real pid fails here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts two processes

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ascend_sim_ipc_transfer_whitelists_the_receivers_kernel_pid(tmp_path):
    port = _free_port()
    driver = tmp_path / "driver"
    driver.mkdir()
    env = dict(os.environ, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    worker = os.path.join(HERE, "ascend_sim_ipc_worker.py")
    procs = {role: subprocess.Popen([sys.executable, worker, role, str(port), str(driver), str(tmp_path / f"{role}.json")],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for role in ("sender", "receiver")}
    logs = {}
    for role, p in procs.items():
        try:
            logs[role] = p.communicate(timeout=180)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            p.kill()
            logs[role] = p.communicate()[0].decode(errors="replace")
    out = {}
    for role in procs:
        path = tmp_path / f"{role}.json"
        assert path.exists(), f"{role} wrote no result; its output:\n{logs[role][-3000:]}"
        out[role] = json.loads(path.read_text())
        assert "crash" not in out[role], out[role]["crash"]
        assert not out[role]["errors"] and not out[role]["internal_errors"], out[role]
    s, r = out["sender"], out["receiver"]
    assert r["holds"] == [True, True]  # both versions arrived bit for bit through the imports
    assert all(rep["path"] == "ipc" for rep in s["reports"] + r["reports"])
    assert s["exports"] and all(flags == 0 for flags in s["exports"])  # the whitelist stays on
    # every exported buffer names exactly the receiver's process, as the kernel knows it
    assert s["whitelists"] and all(pids == [str(r["pid"])] for pids in s["whitelists"]), (s["whitelists"], r["pid"])
    assert r["imports"] == len(s["exports"])  # buffers kept between the updates: imported once each
