"""Host memory is always there: the fallback when no accelerator backend finds its devices."""

from __future__ import annotations

from unisleep.backend import Detection, DeviceInfo
from unisleep.hostmem import meminfo


def host_devices() -> tuple[DeviceInfo, ...]:
    """The host's memory as one device, its size and what is available (``/proc/meminfo``;
    None for what cannot be read)."""
    info = meminfo()
    return (DeviceInfo(0, "host memory", info.get("MemTotal"), info.get("MemAvailable")),)


def detect() -> Detection:
    return Detection("no accelerator was found, so host memory (memfd/mmap) is used", host_devices())
