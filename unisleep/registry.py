"""Backend registry: platform name -> :class:`~unisleep.backend.Backend` descriptor, found through
the ``unisleep.backends`` entry points.

unisleep's own backends are entry points of its own distribution (pyproject.toml); a third party
adds a backend (say for Intel XPU) the same way, with no edit to unisleep::

    [project.entry-points."unisleep.backends"]
    xpu = "my_package.unisleep_xpu:BACKEND"     # a unisleep.backend.Backend

and selects it with ``MemoryLifecycle("xpu")`` or ``UNISLEEP_PLATFORM=xpu`` — or lets detection
pick it, when its descriptor has a ``detect``.  Listing the backends imports nothing; a
descriptor is imported when its platform is asked for (detection asks every one), and its
vendor modules only when they are used.

Run from a source tree (``unisleep/`` beside ``pyproject.toml``, as ``unisleep/__init__.py``
maps ``backends/``), unisleep's own entry points are read from that tree's pyproject.toml, so an
installed copy of another checkout cannot shadow them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from importlib import metadata
from typing import Optional, Union

from . import keyed_hash
from .backend import Backend
from .errors import PlatformError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged (a dependency there)
    import tomli as tomllib

log = logging.getLogger("unisleep")

ENTRY_POINT_GROUP = "unisleep.backends"
_DIST = "unisleep"
_extra: dict[str, Union[str, Backend]] = {}  # register_backend: name -> "module:attr" or a descriptor
_loaded: dict[str, Backend] = {}  # "module:attr" -> its descriptor
#: name -> the descriptor its entry point named, once loaded: reading the entry points walks the
#: metadata of every installed distribution, and the hot paths (a weight update, a sleep) ask
#: ``Platform.backend`` several times each
_by_name: dict[str, Backend] = {}


def register_backend(backend: Union[Backend, str], target: Optional[str] = None) -> None:
    """Register a backend in this process (it overrides an entry point of the same name):
    ``register_backend(descriptor)``, or ``register_backend(name, "module:attr")`` naming one."""
    if isinstance(backend, Backend):
        _extra[backend.name] = backend
    elif isinstance(backend, str) and isinstance(target, str):
        _extra[backend.strip().lower()] = target
    else:
        raise PlatformError("register_backend takes a unisleep.backend.Backend, or a name and a 'module:attr' "
                            f"naming one; got {backend!r}, {target!r}")


@functools.lru_cache(maxsize=1)
def _source_tree_entry_points() -> Optional[dict[str, str]]:
    """This source tree's own entry points (None when unisleep is not run from a source tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    project = os.path.join(root, "pyproject.toml")
    if not (os.path.exists(project) and os.path.isdir(os.path.join(root, "backends"))):
        return None
    with open(project, encoding="utf-8") as f:
        text = f.read()
    try:
        return dict(tomllib.loads(text)["project"]["entry-points"][ENTRY_POINT_GROUP])
    except (KeyError, ValueError):
        return {}


def _entry_points() -> dict[str, str]:
    own = _source_tree_entry_points()
    table: dict[str, str] = {}
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken metadata must not break unisleep
        eps = []
    for ep in eps:
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if own is not None and dist is not None and dist.lower() == _DIST:
            continue  # an installed unisleep seen from a source tree: the tree's own entries count
        table[ep.name] = ep.value
    table.update(own or {})
    return table


def available_backends() -> dict[str, str]:
    """name -> where its descriptor is (``"module:attr"``) for every backend unisleep can load,
    without importing any of them."""
    table = _entry_points()
    for name, b in _extra.items():
        table[name] = b if isinstance(b, str) else f"{b.package} (registered in this process)"
    return table


def backend(name: str) -> Backend:
    """The descriptor of platform ``name``: :class:`~unisleep.errors.PlatformError` naming the
    choices when there is none, or saying what is wrong with it.  The entry points are read once
    per name and process (a backend registered with :func:`register_backend` still overrides it;
    a distribution installed later is seen by a new process)."""
    name = name.strip().lower()
    registered = _extra.get(name)
    if isinstance(registered, Backend):
        return registered
    if registered is None and name in _by_name:
        return _by_name[name]
    target = registered or _entry_points().get(name)
    if target is None:
        raise PlatformError(f"no backend named {name!r}; available: {', '.join(sorted(available_backends()))}")
    if target not in _loaded:
        module, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr) if attr else None
        except (ImportError, AttributeError) as e:
            raise PlatformError(f"the {name} backend could not be imported ({target}: {e})") from e
        if not isinstance(obj, Backend):
            raise PlatformError(
                f"the {name} backend's entry point {target} names {type(obj).__name__}, not a unisleep.backend.Backend "
                "descriptor: point the entry point at the package's descriptor (docs/lifecycle.md, 'Writing a backend')")
        if obj.name != name:
            raise PlatformError(f"the entry point {name} = {target} names the descriptor of {obj.name!r}; name the "
                                "entry point as the descriptor does")
        _loaded[target] = obj
    if registered is None:
        _by_name[name] = _loaded[target]
    return _loaded[target]


def backends() -> list[Backend]:
    """Every backend that loads, in detection order (highest ``priority`` first, then name); one
    that cannot be loaded is logged and left out."""
    out = []
    for name in available_backends():
        try:
            out.append(backend(name))
        except PlatformError as e:
            log.warning("%s", e)
    return sorted(out, key=lambda b: (-b.priority, b.name))


def backend_of(driver) -> Optional[Backend]:
    """The descriptor of ``driver``'s platform (by its ``name``), or None for a driver no
    backend describes."""
    try:
        return backend(driver.name)
    except PlatformError:
        return None


def driver_class(name: str):
    return backend(name).driver_class()


def checksum_kernel(device_type: str, name: str):
    """``name`` from the ``checksum`` module of the first accelerator backend with torch device
    ``device_type`` that ships one (:attr:`Backend.checksum`), or None — how the keyed digest
    finds a backend's fused kernels (installed below, as :mod:`unisleep.keyed_hash` is imported
    by the backends and must not look them up itself)."""
    for b in backends():
        if b.torch_device == device_type and b.is_accelerator and b.checksum:
            try:
                return getattr(b.load(b.checksum), name, None)
            except ImportError:  # its kernel's packages are missing: the digest runs in torch ops
                return None
    return None


keyed_hash.find_kernels_with(checksum_kernel)


__all__ = ["ENTRY_POINT_GROUP", "register_backend", "available_backends", "backend", "backends", "backend_of",
           "driver_class", "checksum_kernel"]
