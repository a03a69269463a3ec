"""Whether this machine has NVIDIA GPUs, read without creating a CUDA context: NVML (nvidia-ml-py)
first, then ``/dev/nvidia*`` device nodes beside a CUDA build of torch."""

from __future__ import annotations

import glob
from typing import Optional

from unisleep.backend import Detection, DeviceInfo, torch_version


def nvml_devices() -> Optional[tuple[DeviceInfo, ...]]:
    """NVIDIA devices through NVML (no CUDA context is created); None when NVML is absent."""
    try:
        import pynvml  # nvidia-ml-py
    except Exception:  # absent or broken: detection must raise nothing (Backend.detect's contract)
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
            try:
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            except Exception:  # an older driver without PCI info: only doctor's NUMA line needs it
                bus = None
            out.append(DeviceInfo(i, name, int(mem.total), int(mem.free), uuid, bus))
        return tuple(out)
    except Exception:  # any NVML failure means "not here": detection raises nothing
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # the answer is already made; a failed shutdown changes nothing
            pass


def detect() -> Optional[Detection]:
    devs = nvml_devices()
    if devs:
        return Detection(f"NVML reports {len(devs)} NVIDIA GPU(s)", devs)
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes and torch_version("cuda"):
        devs = tuple(DeviceInfo(i, "NVIDIA GPU") for i in range(len(nodes)))
        return Detection(f"{len(nodes)} /dev/nvidia* node(s) and a CUDA build of torch", devs)
    return None


def install_extra() -> str:
    """The extra of the CUDA major torch was built for (``cuda12``/``cuda13``); "" without a
    CUDA build of torch (the descriptor's default applies)."""
    v = torch_version("cuda")
    return f"cuda{str(v).split('.')[0]}" if v else ""
