"""Backend registry: platform name -> driver class, resolved lazily.

Built-in drivers come from :data:`unisleep.platform.SPECS`.  A third party adds a backend (say
for Intel XPU) without touching unisleep by declaring an entry point::

    [project.entry-points."unisleep.backends"]
    xpu = "my_package.unisleep_xpu:XpuDriver"

and selecting it with ``MemoryLifecycle("xpu")`` or ``UNISLEEP_PLATFORM=xpu``.  Nothing is
imported until a driver is asked for, so no vendor package loads at ``import unisleep``.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, Optional

from .errors import PlatformError

ENTRY_POINT_GROUP = "unisleep.backends"
_extra: dict[str, str] = {}


def register_backend(name: str, target: str) -> None:
    """Register ``"module:Class"`` as the driver for ``name`` (overrides an entry point)."""
    _extra[name] = target


def _entry_points() -> dict[str, str]:
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken metadata must not break unisleep
        return {}
    return {ep.name: ep.value for ep in eps}


def available_backends() -> dict[str, str]:
    """name -> "module:Class" for every backend unisleep can load."""
    from .platform import SPECS

    table = {name: spec.driver for name, spec in SPECS.items()}
    for name, target in _entry_points().items():
        table.setdefault(name, target)
    table.update(_extra)
    return table


def driver_class(name: str):
    table = available_backends()
    if name not in table:
        raise PlatformError(f"no backend named {name!r}; available: {', '.join(sorted(table))}")
    module, _, attr = table[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        from .platform import SPECS, install_extra

        extra = install_extra(name) if name in SPECS else None
        hint = f" Install it with: pip install 'unisleep[{extra}]'" if extra else ""
        raise PlatformError(f"the {name} backend could not be imported ({e}).{hint}") from e
    return getattr(mod, attr)


def load_driver(platform: Any = None, *, device: int = 0, **options: Any):
    """A ready driver for ``platform`` (None = autodetect, a name, or a Platform)."""
    from .platform import Platform, detect_platform

    if platform is None:
        name: Optional[str] = detect_platform().name
    elif isinstance(platform, Platform):
        name = platform.name
    elif isinstance(platform, str):
        name = platform.strip().lower()
    else:
        raise PlatformError(f"platform must be None, a name or a Platform, not {type(platform).__name__}")
    return driver_class(name)(device=device, **options)
