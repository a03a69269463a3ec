"""Platform detection: the override, the refusal, no vendor package needed, no device context."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

import unisleep
from unisleep.errors import PlatformError
from unisleep.platform import PLATFORM_NAMES, Platform, detect_platform, environment_warnings, optional_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_ACCELERATOR_NODES = bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or glob.glob("/dev/davinci[0-9]*"))


def run_py(code: str, env_extra: dict | None = None, pythonpath: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "UNISLEEP_PLATFORM"}
    env.update(env_extra or {})
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath + [env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_public_api_names():
    assert unisleep.detect_platform is detect_platform
    assert set(PLATFORM_NAMES) == {"cuda", "rocm", "ascend", "host"}


@pytest.mark.skipif(HAS_ACCELERATOR_NODES, reason="this machine has accelerator device nodes")
def test_autodetect_is_host_without_accelerator(monkeypatch):
    monkeypatch.delenv("UNISLEEP_PLATFORM", raising=False)
    p = detect_platform()
    assert isinstance(p, Platform)
    assert p.name == "host"
    assert "no accelerator" in p.reason
    assert len(p.devices) == 1 and p.devices[0].total_bytes and p.devices[0].total_bytes > 2**30
    assert p.torch_device() == "cpu" and not p.is_accelerator


@pytest.mark.parametrize("value", ["host", "HOST", "  host "])
def test_override_host(monkeypatch, value):
    monkeypatch.setenv("UNISLEEP_PLATFORM", value)
    p = detect_platform()
    assert p.name == "host"
    assert "UNISLEEP_PLATFORM" in p.reason
    assert p.devices and p.devices[0].name == "host memory"


@pytest.mark.parametrize("name", ["cuda", "rocm", "ascend"])
def test_override_vendor_names_without_hardware(monkeypatch, name):
    """Forcing a vendor platform is allowed (e.g. to test the refusal path later) and must not
    create a device context."""
    monkeypatch.setenv("UNISLEEP_PLATFORM", name)
    p = detect_platform()
    assert p.name == name and "UNISLEEP_PLATFORM" in p.reason
    import torch

    assert not torch.cuda.is_initialized()


def test_explicit_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "cuda")
    assert detect_platform("host").name == "host"


@pytest.mark.parametrize("value", ["tpu", "cpu", "gpu", "nvidia"])
def test_unknown_override_refused_with_choices(monkeypatch, value):
    monkeypatch.setenv("UNISLEEP_PLATFORM", value)
    with pytest.raises(PlatformError) as exc:
        detect_platform()
    msg = str(exc.value)
    assert repr(value) in msg
    for name in PLATFORM_NAMES:
        assert name in msg


def test_unknown_override_refused_by_lifecycle(monkeypatch):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "tpu")
    with pytest.raises(PlatformError, match="host"):
        unisleep.MemoryLifecycle()


def test_lifecycle_follows_override(monkeypatch, tmp_path):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    with unisleep.MemoryLifecycle(spill_dir=str(tmp_path)) as lc:
        assert lc.platform_name == "host"


@pytest.mark.slow
def test_detect_does_not_initialise_torch_device_runtime():
    r = run_py(
        """
        import sys, unisleep
        assert "torch" not in sys.modules, "import unisleep must not import torch"
        p = unisleep.detect_platform()
        import torch
        print(p.name, torch.cuda.is_initialized())
        """
    )
    assert r.returncode == 0, r.stderr
    name, initialised = r.stdout.split()
    assert initialised == "False"


BLOCKER = """
import sys, importlib.abc
VENDOR = {"torch", "torch_npu", "pynvml", "amdsmi", "cuda", "vllm", "vllm_ascend", "torch_memory_saver"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in VENDOR:
            raise ImportError(f"blocked for the test: {name}")
        return None
sys.meta_path.insert(0, Block())
"""


@pytest.mark.slow
def test_detect_without_torch_or_vendor_packages():
    """Detection needs none of the optional packages (and not even torch)."""
    r = run_py(
        BLOCKER
        + """
import unisleep, json
p = unisleep.detect_platform()
pk = unisleep.platform.optional_packages()
print(json.dumps({"name": p.name, "reason": p.reason, "n": len(p.devices), "pk": pk,
                  "mods": sorted(m for m in sys.modules if m.split(".")[0] in VENDOR)}))
"""
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if not HAS_ACCELERATOR_NODES:
        assert out["name"] == "host" and out["n"] == 1
    assert out["mods"] == []
    assert not any(out["pk"].values())


def _fake_package(root, name: str, body: str) -> None:
    os.makedirs(os.path.join(root, name), exist_ok=True)
    with open(os.path.join(root, name, "__init__.py"), "w") as f:
        f.write(textwrap.dedent(body))


@pytest.mark.slow
def test_detect_tolerates_broken_vendor_installs(tmp_path):
    """amdsmi raising KeyError at import and NVML failing to load must not break detection."""
    _fake_package(tmp_path, "amdsmi", "raise KeyError('libamd_smi.so')\n")
    _fake_package(
        tmp_path,
        "pynvml",
        """
        class NVMLError_LibraryNotFound(Exception):
            pass
        def nvmlInit():
            raise NVMLError_LibraryNotFound("libnvidia-ml.so.1 not found")
        def nvmlShutdown():
            pass
        """,
    )
    r = run_py("import unisleep; p = unisleep.detect_platform(); print(p.name)", pythonpath=[str(tmp_path)])
    assert r.returncode == 0, r.stderr
    if not HAS_ACCELERATOR_NODES:
        assert r.stdout.strip() == "host"


@pytest.mark.slow
def test_detect_reads_nvml_without_creating_a_context(tmp_path):
    """With NVML reporting GPUs, detection says cuda, lists them with memory, and leaves the
    device runtime untouched.  (pynvml here is a stand-in for the NVML library, which this CPU
    machine does not have; the code under test is unisleep's real probe.)"""
    _fake_package(
        tmp_path,
        "pynvml",
        """
        class _Mem:
            total, free = 141 << 30, 140 << 30
        def nvmlInit(): pass
        def nvmlShutdown(): pass
        def nvmlDeviceGetCount(): return 2
        def nvmlDeviceGetHandleByIndex(i): return i
        def nvmlDeviceGetName(h): return b"NVIDIA H200"
        def nvmlDeviceGetMemoryInfo(h): return _Mem()
        def nvmlDeviceGetUUID(h): return f"GPU-{h}"
        """,
    )
    r = run_py(
        """
        import unisleep, torch
        p = unisleep.detect_platform()
        print(p.name, len(p.devices), p.devices[1].name.replace(" ", "_"), p.devices[0].total_bytes,
              torch.cuda.is_initialized())
        """,
        pythonpath=[str(tmp_path)],
    )
    assert r.returncode == 0, r.stderr
    name, n, dev, total, init = r.stdout.split()
    assert (name, n, dev, int(total), init) == ("cuda", "2", "NVIDIA_H200", 141 << 30, "False")


def test_optional_packages_report():
    pk = optional_packages()
    assert pk["torch"] is True
    assert all(isinstance(v, bool) for v in pk.values())
    assert {"vllm", "torch_npu", "amdsmi"} <= set(pk)


def test_environment_warnings_expandable_segments(monkeypatch):
    host = Platform("host", "test")
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert environment_warnings(host) == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    warn = environment_warnings(host)
    assert len(warn) == 1 and "expandable" in warn[0]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert environment_warnings(host) == []
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    asc = environment_warnings(Platform("ascend", "test"))
    assert any("turns expandable segments off inside its pools" in w and "CaMemAllocator" in w for w in asc)
