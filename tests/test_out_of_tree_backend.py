"""Adding a platform is one package and one entry point: a backend written outside unisleep — a
fake "xpu" whose memory is host memory (labelled as such: no XPU is involved) — is built and
installed by pip into a folder of its own, and gets detection, a lifecycle that sleeps and wakes,
weight transfer between two processes and ``unisleep doctor`` through its descriptor alone.
Nothing of unisleep is edited or told about it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYPROJECT = """
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "unisleep-fake-xpu"
version = "0.1.0"
description = "A fake XPU backend for unisleep, on host memory"

[project.entry-points."unisleep.backends"]
xpu = "unisleep_fake_xpu:BACKEND"

[tool.setuptools]
packages = ["unisleep_fake_xpu"]
"""

INIT = '''
"""A fake XPU for unisleep: host memory under another name (no XPU is involved)."""
from unisleep.backend import Backend

BACKEND = Backend(
    name="xpu",
    package=__name__,
    torch_device="cpu",  # its tensors are host tensors
    driver=".driver:XpuDriver",
    detect=".detect:detect",
    priority=50,  # asked before the built-in accelerators
    store="unisleep.backends.host.spill_store:SpillStore",
    collective="unisleep.backends.host.collective",
    ipc="unisleep.backends.host.ipc",
    environment_warnings=".detect:environment_warnings",
    packages=(("fake-xpu-runtime", "fake_xpu_runtime"),),
    extra="xpu",
)
'''

DRIVER = '''
from unisleep.backends.host.driver import HostDriver


class XpuDriver(HostDriver):
    name = "xpu"
    created = 0

    def create(self, size):
        XpuDriver.created += 1
        return super().create(size)
'''

DETECT = '''
import os

from unisleep.backend import Detection, DeviceInfo


def detect():
    n = int(os.environ.get("FAKE_XPU_DEVICES", "0") or 0)
    if not n:
        return None
    return Detection(f"FAKE_XPU_DEVICES={n} (a fake XPU on host memory)",
                     tuple(DeviceInfo(i, f"fake XPU {i}", 1 << 30, 1 << 30) for i in range(n)))


def environment_warnings():
    return ["FAKE_XPU_SLOW is set: the fake XPU is slow"] if os.environ.get("FAKE_XPU_SLOW") else []
'''

WORKER = """
import json, sys, tempfile, torch, unisleep
from unisleep.platform import detect_platform
from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender

role, port = sys.argv[1], int(sys.argv[2])
p = detect_platform()
out = {"platform": p.name, "reason": p.reason, "devices": len(p.devices), "torch_device": p.torch_device(),
       "collective": p.collective_backend}
lc = unisleep.MemoryLifecycle(spill_dir=tempfile.mkdtemp())
out["driver"] = type(lc.driver).__module__ + "." + type(lc.driver).__name__
out["store"] = type(lc.backup_store).__name__
w = lc.empty((1 << 16,), torch.float32, tag="weights")
want = torch.arange(1 << 16, dtype=torch.float32)
if role == "sender":
    w.copy_(want)
    ptr = w.data_ptr()
    lc.sleep(1)
    out["asleep_bytes"] = lc.resident_bytes()
    lc.wake_up()
    out["woke_exact"] = bool(torch.equal(w, want)) and w.data_ptr() == ptr
    out["created"] = type(lc.driver).created
g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0 if role == "sender" else 1, 2, timeout_s=60)
out["group_platform"] = g.platform.name
if role == "sender":
    WeightSender(g, path="collective").send({"w": w}, 1)
else:
    WeightReceiver(g, target={"w": w}, guard=lc).receive()
    out["received_exact"] = bool(torch.equal(w, want))
lc.close()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The fake backend's project, built and installed by pip into a folder of its own."""
    base = tmp_path_factory.mktemp("fake_xpu")
    src = base / "src"
    (src / "unisleep_fake_xpu").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    for name, text in (("__init__.py", INIT), ("driver.py", DRIVER), ("detect.py", DETECT)):
        (src / "unisleep_fake_xpu" / name).write_text(textwrap.dedent(text))
    target = base / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (target / "unisleep_fake_xpu" / "__init__.py").exists()
    return str(target)


def _env(site: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "FAKE_XPU_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([site, ROOT])
    env.update(extra)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_detection_lifecycle_and_transfer_come_from_the_descriptor(site, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _port()
    env = _env(site, FAKE_XPU_DEVICES="2")
    procs = {role: subprocess.Popen([sys.executable, str(script), role, str(port)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
             for role in ("sender", "receiver")}
    res = {}
    for role, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, f"{role}: {stderr[-3000:]}"
        res[role] = json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")))
    s, r = res["sender"], res["receiver"]
    for side in (s, r):
        assert side["platform"] == "xpu" and side["devices"] == 2 and "FAKE_XPU_DEVICES=2" in side["reason"]
        assert side["driver"] == "unisleep_fake_xpu.driver.XpuDriver" and side["store"] == "SpillStore"
        assert side["torch_device"] == "cpu" and side["collective"] == "gloo" and side["group_platform"] == "xpu"
    assert s["woke_exact"] and s["asleep_bytes"] == 0 and s["created"] == 2
    assert r["received_exact"]


def test_without_its_devices_detection_passes_it_by(site):
    code = "import unisleep; print(unisleep.detect_platform().name)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(site), cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "xpu"


def test_doctor_reports_it(site):
    r = subprocess.run([sys.executable, "-m", "unisleep", "doctor", "--json"], capture_output=True, text=True,
                       env=_env(site, FAKE_XPU_DEVICES="1", FAKE_XPU_SLOW="1"), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["platform"]["name"] == "xpu" and rep["platform"]["devices"][0]["name"] == "fake XPU 0"
    assert rep["backends"]["xpu"] == {"target": "unisleep_fake_xpu:BACKEND", "module_found": True, "selected": True}
    assert rep["packages"]["fake-xpu-runtime"]["present"] is False
    assert "FAKE_XPU_SLOW is set: the fake XPU is slow" in rep["warnings"]
    assert rep["ok"]
