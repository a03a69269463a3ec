"""Which platform this process runs on, decided without touching a device.

``UNISLEEP_PLATFORM`` (or a name passed in) picks one; otherwise each backend's ``detect`` is
asked in detection order (:func:`unisleep.registry.backends`: the highest ``priority`` first)
and the first that finds its devices wins.  Everything a platform is — its driver, collective,
torch device, warnings — comes from its :class:`~unisleep.backend.Backend` descriptor, so this
module names no vendor.  No step creates a device context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from . import registry
from .backend import Backend, DeviceInfo, module_present
from .errors import PlatformError

ENV_OVERRIDE = "UNISLEEP_PLATFORM"

#: the optional packages every platform may use (each backend adds its own)
COMMON_PACKAGES = (("torch", "torch"), ("vllm", "vllm"), ("torch_memory_saver", "torch_memory_saver"))
EXPANDABLE_NOTE = "unisleep turns expandable segments off inside its pools (as vLLM does); memory outside the pools keeps it."


@dataclass(frozen=True)
class Platform:
    """The platform chosen, why, and the devices its backend found."""

    name: str
    reason: str
    devices: tuple[DeviceInfo, ...] = field(default_factory=tuple)

    @property
    def backend(self) -> Backend:
        return registry.backend(self.name)

    @property
    def collective_backend(self) -> str:
        """The torch.distributed backend its weight transfer uses ("none" without one)."""
        b = self.backend
        return b.collective_module().BACKEND if b.collective else "none"

    @property
    def torch_device_type(self) -> str:
        return self.backend.torch_device

    @property
    def is_accelerator(self) -> bool:
        return self.backend.is_accelerator

    def torch_device(self, index: int = 0) -> str:
        return self.backend.torch_device_name(index)

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return f"{self.name} ({self.reason})"


def platform_names() -> list[str]:
    """The names of every backend unisleep can load, in detection order."""
    return [b.name for b in registry.backends()]


def detect_platform(name: Optional[str] = None) -> Platform:
    """Return the platform this process should use.

    ``name`` (or the ``UNISLEEP_PLATFORM`` environment variable) forces a choice; an unknown
    name raises :class:`PlatformError` listing the valid ones.
    """
    forced = (name or os.environ.get(ENV_OVERRIDE, "")).strip().lower()
    if forced:
        try:
            b = registry.backend(forced)
        except PlatformError as e:
            if forced in registry.available_backends():
                raise
            raise PlatformError(f"{ENV_OVERRIDE}={forced!r} is not a platform; choose one of: "
                                f"{', '.join(platform_names())}") from e
        found = b.probe()
        return Platform(forced, f"{ENV_OVERRIDE}={forced} is set", found.devices if found else ())
    for b in registry.backends():
        found = b.probe()
        if found is not None:
            return Platform(b.name, found.reason, tuple(found.devices))
    raise PlatformError("no backend detected this machine, not even host memory; check that unisleep is installed "
                        f"whole (its backends: {', '.join(registry.available_backends()) or 'none'})")


def load_driver(platform: Any = None, *, device: int = 0, **options: Any):
    """A ready driver for ``platform`` (None = autodetect, a name, or a Platform)."""
    if platform is None:
        name = detect_platform().name
    elif isinstance(platform, Platform):
        name = platform.name
    elif isinstance(platform, str):
        name = platform.strip().lower()
    else:
        raise PlatformError(f"platform must be None, a name or a Platform, not {type(platform).__name__}")
    return registry.driver_class(name)(device=device, **options)


def env_flag(name: str) -> Optional[bool]:
    """An on/off environment variable: True for 1/true/yes/on, False for 0/false/no/off, None
    when unset or anything else."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return None


def install_extra(name: str) -> str:
    """The pip extra that installs platform ``name``'s packages here ("" when unknown)."""
    try:
        return registry.backend(name).install_extra()
    except PlatformError:
        return ""


def optional_packages() -> dict[str, bool]:
    """Which optional packages are importable (checked without importing them)."""
    out = {}
    for label, mod in list(COMMON_PACKAGES) + [p for b in registry.backends() for p in b.packages]:
        out[label] = all(module_present(".".join(mod.split(".")[:i + 1])) for i in range(mod.count(".") + 1))
    return out


def environment_warnings(platform: Platform) -> list[str]:
    """Settings that are known to break sleep mode, with the fix: expandable segments in any
    allocator setting a backend reads, then the platform's own."""
    b = platform.backend
    note = b.expandable_note or EXPANDABLE_NOTE
    warn, seen = [], []
    for other in [b] + registry.backends():
        seen += [v for v in other.alloc_conf_vars if v not in seen]
    for var in seen:
        val = os.environ.get(var, "")
        if "expandable_segments:true" in val.replace(" ", "").lower():
            warn.append(f"{var}={val}: {note}")
    return warn + b.warnings()


def __getattr__(attr: str):
    if attr == "PLATFORM_NAMES":  # the names as a tuple (found through the entry points when asked)
        return tuple(platform_names())
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = [
    "Platform",
    "DeviceInfo",
    "ENV_OVERRIDE",
    "detect_platform",
    "load_driver",
    "platform_names",
    "install_extra",
    "optional_packages",
    "environment_warnings",
    "env_flag",
]
