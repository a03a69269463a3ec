"""Which accelerator platform this process runs on, decided without touching a device.

This module and ``backends/`` are the only places that name vendors.  Everything else in
unisleep asks the :class:`Platform` object (its driver entry, its collective backend, its torch
device type) and stays vendor-neutral.

Detection order: ``UNISLEEP_PLATFORM`` (explicit override) → Ascend (``torch_npu`` + device
nodes) → ROCm (``torch.version.hip`` or ``/dev/kfd``) → CUDA (NVML or ``/dev/nvidia*``) → host.
No step creates a device context: NVML, amdsmi and sysfs/proc are read, never the runtime.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional

from .errors import PlatformError

ENV_OVERRIDE = "UNISLEEP_PLATFORM"


@dataclass(frozen=True)
class PlatformSpec:
    """Static facts about one platform name."""

    name: str
    driver: str  # "module:Class" of the built-in driver
    collective_backend: str  # torch.distributed backend for weight transfer
    torch_device_type: str  # what torch calls the device ("cpu" for host)
    extra: str  # pip extra that installs its optional packages


SPECS: dict[str, PlatformSpec] = {
    "cuda": PlatformSpec("cuda", "unisleep.backends.cuda:CudaDriver", "nccl", "cuda", "cuda12"),
    "rocm": PlatformSpec("rocm", "unisleep.backends.rocm:RocmDriver", "nccl", "cuda", "rocm"),
    "ascend": PlatformSpec("ascend", "unisleep.backends.ascend:AscendDriver", "hccl", "npu", "ascend"),
    "host": PlatformSpec("host", "unisleep.backends.host:HostDriver", "gloo", "cpu", "test"),
}
PLATFORM_NAMES = tuple(SPECS)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_bytes: Optional[int] = None
    free_bytes: Optional[int] = None
    uuid: Optional[str] = None


@dataclass(frozen=True)
class Platform:
    name: str
    reason: str
    devices: tuple[DeviceInfo, ...] = field(default_factory=tuple)

    @property
    def spec(self) -> PlatformSpec:
        if self.name in SPECS:
            return SPECS[self.name]
        # a third-party backend (entry point): host-like defaults until it says otherwise
        return PlatformSpec(self.name, "", "gloo", "cpu", "")

    @property
    def collective_backend(self) -> str:
        return self.spec.collective_backend

    @property
    def torch_device_type(self) -> str:
        return self.spec.torch_device_type

    @property
    def is_accelerator(self) -> bool:
        return self.name != "host"

    def torch_device(self, index: int = 0) -> str:
        t = self.torch_device_type
        return t if t == "cpu" else f"{t}:{index}"

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return f"{self.name} ({self.reason})"


# ----------------------------------------------------------------------------- probes
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _host_devices() -> tuple[DeviceInfo, ...]:
    total = free = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        total, free = info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        pass
    return (DeviceInfo(0, "host memory", total, free),)


def _nvml_devices() -> Optional[tuple[DeviceInfo, ...]]:
    """NVIDIA devices through NVML (no CUDA context is created); None when NVML is absent."""
    try:
        import pynvml  # nvidia-ml-py
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without GPUs
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out.append(DeviceInfo(i, name, int(mem.total), int(mem.free), uuid))
        return tuple(out)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _amdsmi_devices() -> Optional[tuple[DeviceInfo, ...]]:
    """The AMD GPUs this process sees, through amdsmi, numbered as HIP numbers them here.

    amdsmi lists every GPU of the machine whatever ``HIP_VISIBLE_DEVICES`` /
    ``ROCR_VISIBLE_DEVICES`` say; each GPU's enumeration info gives its ``hip_id`` (its HIP
    index with all GPUs visible), to which the visible-device variables are applied
    (``backends/rocm/config.visible_devices``).  An amdsmi without enumeration info cannot be
    mapped: its GPUs are listed only when no visible-device variable is set.  ``amdsmi_shut_down``
    runs whatever happens once ``amdsmi_init`` succeeded.  amdsmi raises KeyError (not
    ImportError) without its library."""
    try:
        import amdsmi  # type: ignore
    except Exception:  # KeyError('libamd_smi.so') without the library, ImportError, OSError...
        return None
    from .backends.rocm import config as rocm_config  # pure parsing, loads no vendor library

    try:
        amdsmi.amdsmi_init()
    except Exception:
        return None
    try:
        found = []
        for pos, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
            try:
                info = amdsmi.amdsmi_get_gpu_enumeration_info(h)
                hip_id, uuid = int(info["hip_id"]), info.get("hip_uuid") or None
            except Exception:  # older amdsmi, or "N/A"
                hip_id, uuid = None, None
            try:
                name = amdsmi.amdsmi_get_gpu_asic_info(h).get("market_name", "AMD GPU")
            except Exception:
                name = "AMD GPU"
            total = used = None
            try:
                vram = amdsmi.amdsmi_get_gpu_vram_usage(h)  # MB
                total, used = vram["vram_total"] * 2**20, vram["vram_used"] * 2**20
            except Exception:
                pass
            found.append((hip_id, uuid, name, total, used, pos))
        if any(f[0] is None for f in found):
            if any(v in os.environ for v in rocm_config.VISIBLE_VARS):
                return ()  # which GPUs are visible cannot be told without hip_id
            found = [(pos, *rest) for (_, *rest), pos in zip(found, range(len(found)))]
        visible = rocm_config.visible_devices([(f[0], f[1]) for f in found])
        out = []
        for i, k in enumerate(visible):
            _, uuid, name, total, used, _ = found[k]
            out.append(DeviceInfo(i, name, total, None if total is None else total - used, uuid))
        return tuple(out)
    except Exception:
        return None
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:
            pass


def _torch_version_attr(attr: str) -> Optional[str]:
    """torch.version.<attr> without importing torch.cuda machinery (importing torch is enough)."""
    if not _has_module("torch"):
        return None
    try:
        import torch

        return getattr(torch.version, attr, None)
    except Exception:
        return None


def _probe_ascend() -> Optional[Platform]:
    nodes = sorted(glob.glob("/dev/davinci[0-9]*"))
    if not _has_module("torch_npu"):
        return None
    if not nodes:
        return None
    devs = tuple(DeviceInfo(i, f"Ascend NPU ({os.path.basename(n)})") for i, n in enumerate(nodes))
    return Platform("ascend", f"torch_npu is installed and {len(nodes)} Ascend device node(s) exist", devs)


def _probe_rocm() -> Optional[Platform]:
    hip = _torch_version_attr("hip")
    kfd = os.path.exists("/dev/kfd")
    if not hip and not kfd:
        return None
    devs = _amdsmi_devices() or ()
    if not devs and not kfd:
        return None
    why = []
    if hip:
        why.append(f"torch is a ROCm build (HIP {hip})")
    if kfd:
        why.append("/dev/kfd exists")
    if devs:
        why.append(f"amdsmi sees {len(devs)} GPU(s)")
    return Platform("rocm", " and ".join(why), devs)


def _probe_cuda() -> Optional[Platform]:
    devs = _nvml_devices()
    if devs:
        return Platform("cuda", f"NVML reports {len(devs)} NVIDIA GPU(s)", devs)
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes and _torch_version_attr("cuda"):
        devs = tuple(DeviceInfo(i, "NVIDIA GPU") for i in range(len(nodes)))
        return Platform("cuda", f"{len(nodes)} /dev/nvidia* node(s) and a CUDA build of torch", devs)
    return None


def _forced(name: str) -> Platform:
    if name not in SPECS:
        from .registry import available_backends  # third-party backends (entry points) count too

        table = available_backends()
        if name in table:
            return Platform(name, f"{ENV_OVERRIDE}={name} is set (backend {table[name]})")
        choices = list(PLATFORM_NAMES) + sorted(set(table) - set(SPECS))
        raise PlatformError(f"{ENV_OVERRIDE}={name!r} is not a platform; choose one of: {', '.join(choices)}")
    probes = {"cuda": _probe_cuda, "rocm": _probe_rocm, "ascend": _probe_ascend}
    found = probes[name]() if name in probes else None
    devs = found.devices if found else (_host_devices() if name == "host" else ())
    return Platform(name, f"{ENV_OVERRIDE}={name} is set", devs)


def detect_platform(name: Optional[str] = None) -> Platform:
    """Return the platform this process should use.

    ``name`` (or the ``UNISLEEP_PLATFORM`` environment variable) forces a choice; an unknown
    name raises :class:`PlatformError` listing the valid ones.
    """
    forced = name or os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if forced:
        return _forced(forced.lower())
    for probe in (_probe_ascend, _probe_rocm, _probe_cuda):
        try:
            found = probe()
        except Exception:  # a broken vendor install must not break detection
            found = None
        if found is not None:
            return found
    return Platform("host", "no accelerator was found, so host memory (memfd/mmap) is used", _host_devices())


def env_flag(name: str) -> Optional[bool]:
    """An on/off environment variable: True for 1/true/yes/on, False for 0/false/no/off, None
    when unset or anything else."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return None


def accelerated_module(device_type: str, name: str) -> Optional[str]:
    """``"<driver package>.<name>"`` of the accelerator platform whose torch device type is
    ``device_type`` (e.g. kernels a backend ships for the core), or None for host memory."""
    for spec in SPECS.values():
        if spec.torch_device_type == device_type and spec.torch_device_type != "cpu":
            return spec.driver.split(":")[0] + "." + name
    return None


def install_extra(name: str) -> str:
    """The pip extra that installs platform ``name``'s packages here: for CUDA the one of the
    CUDA major torch was built for (``cuda12``/``cuda13``), read from ``torch.version.cuda``."""
    if name == "cuda":
        v = _torch_version_attr("cuda")
        if v:
            return f"cuda{str(v).split('.')[0]}"
    return SPECS[name].extra if name in SPECS else ""


def optional_packages() -> dict[str, bool]:
    """Which optional packages are importable (checked without importing them)."""
    names = {
        "torch": "torch",
        "torch_npu": "torch_npu",
        "vllm": "vllm",
        "vllm_ascend": "vllm_ascend",
        "cuda-bindings": "cuda.bindings",
        "pynvml (nvidia-ml-py)": "pynvml",
        "amdsmi": "amdsmi",
        "torch_memory_saver": "torch_memory_saver",
    }
    out = {}
    for label, mod in names.items():
        out[label] = _has_module(mod.split(".")[0]) and (
            "." not in mod or _has_module(mod)
        )
    return out


def environment_warnings(platform: Platform) -> list[str]:
    """Settings that are known to break sleep mode, with the fix."""
    warn = []
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF"):
        val = os.environ.get(var, "")
        if "expandable_segments:true" in val.replace(" ", "").lower():
            if platform.name == "ascend":
                warn.append(
                    f"{var}={val}: unisleep turns expandable segments off inside its pools, but vllm-ascend's own "
                    "CaMemAllocator refuses to start with them (vllm-ascend sets them unless --enable-sleep-mode); "
                    "remove expandable_segments:True when vllm-ascend's sleep mode is used.")
            else:
                warn.append(
                    f"{var}={val}: unisleep turns expandable segments off inside its pools (as vLLM does); "
                    "memory outside the pools keeps it."
                )
    if platform.name == "ascend":
        if os.environ.get("VLLM_ASCEND_ENABLE_NZ", "") not in ("0",):
            warn.append("VLLM_ASCEND_ENABLE_NZ is not 0: FRACTAL_NZ weights cannot be updated by RL; export VLLM_ASCEND_ENABLE_NZ=0.")
        if not os.environ.get("HCCL_HOST_SOCKET_PORT_RANGE") or not os.environ.get("HCCL_NPU_SOCKET_PORT_RANGE"):
            warn.append(
                "HCCL_HOST_SOCKET_PORT_RANGE / HCCL_NPU_SOCKET_PORT_RANGE are unset: two processes sharing an NPU "
                "(trainer + engine) need disjoint ranges, e.g. export HCCL_HOST_SOCKET_PORT_RANGE=auto HCCL_NPU_SOCKET_PORT_RANGE=auto."
            )
    if platform.name == "rocm":
        from .backends.rocm import config as rocm_config  # pure parsing, loads no vendor library

        chunk = os.environ.get(rocm_config.CHUNK_ENV)
        if chunk is None:
            warn.append(f"{rocm_config.CHUNK_ENV} is unset: 256 MiB chunks are used; tune with `unisleep bench --chunk-sweep`.")
        else:
            problem = rocm_config.chunk_env_problem()
            if problem:
                warn.append(problem)
        problem = rocm_config.visible_device_problem()
        if problem:
            warn.append(problem)
    return warn


__all__ = [
    "Platform",
    "PlatformSpec",
    "DeviceInfo",
    "SPECS",
    "PLATFORM_NAMES",
    "ENV_OVERRIDE",
    "detect_platform",
    "accelerated_module",
    "install_extra",
    "optional_packages",
    "environment_warnings",
]
