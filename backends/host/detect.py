"""Host memory is always there: the fallback when no accelerator backend finds its devices."""

from __future__ import annotations

from unisleep.backend import Detection, DeviceInfo


def host_devices() -> tuple[DeviceInfo, ...]:
    """The host's memory as one device, its size and what is available (``/proc/meminfo``)."""
    total = free = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        total, free = info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        pass
    return (DeviceInfo(0, "host memory", total, free),)


def detect() -> Detection:
    return Detection("no accelerator was found, so host memory (memfd/mmap) is used", host_devices())
