"""A platform as unisleep sees it: one :class:`Backend` descriptor per backend package.

Each backend package (``unisleep.backends.<name>``, or a third party's) exports one descriptor
and names it in the ``unisleep.backends`` entry-point group::

    [project.entry-points."unisleep.backends"]
    xpu = "my_package.unisleep_xpu:BACKEND"

The descriptor says everything the core needs to know about the platform, as data and as
references to the package's modules, imported only when used (so ``import unisleep`` and
platform detection load no vendor library): how to detect it, what torch calls its device, its
driver, backup store, collective, IPC, device kernels, pool, the graph class whose captures
unisleep watches, its environment warnings and the pip extra that installs its packages.
:mod:`unisleep.registry` finds the descriptors; :mod:`unisleep.platform` picks one.

A reference is ``"module"`` or ``"module:attribute"``; a module starting with ``.`` is relative
to the descriptor's ``package``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from .errors import PlatformError, UnsupportedError

log = logging.getLogger("unisleep")


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_bytes: Optional[int] = None
    free_bytes: Optional[int] = None
    uuid: Optional[str] = None
    #: the PCI bus id (``"0000:3b:00.0"``) where the detection can read it without a device
    #: context: doctor shows the device's NUMA node from it
    pci_bus_id: Optional[str] = None


@dataclass(frozen=True)
class Detection:
    """What a backend's ``detect`` found: why it applies here, and the devices it sees."""

    reason: str
    devices: tuple[DeviceInfo, ...] = ()


@dataclass(frozen=True)
class Backend:
    """One platform's descriptor (see the module docstring).  Only ``name``, ``package``,
    ``torch_device`` and ``driver`` are required."""

    #: the platform name (``MemoryLifecycle("xpu")``, ``UNISLEEP_PLATFORM=xpu``)
    name: str
    #: the package relative references are resolved in
    package: str
    #: what torch calls the device (``"cpu"`` for host memory); its module is the platform's
    #: torch device module (``torch.get_device_module(torch_device)``)
    torch_device: str
    #: the :class:`~unisleep.driver.Driver` subclass
    driver: str
    #: ``() -> Detection | None``, called in detection order (highest ``priority`` first); it
    #: must create no device context and raise nothing it can avoid (a raise counts as "not here")
    detect: Optional[str] = None
    priority: int = 0
    #: the :class:`~unisleep.backup.BackupStore` its driver's ``new_backup_store`` makes
    store: Optional[str] = None
    #: the weight-transfer collective module (``BACKEND``, ``SAME_DEVICE_OK``, ``device_key``,
    #: ``create_backend``, ``same_device_message``); None: no weight transfer on this platform
    collective: Optional[str] = None
    #: the colocated IPC module (shareable buffers between processes on one device), or None
    ipc: Optional[str] = None
    #: device kernels the core uses where the bytes are (``unisleep.keyed_hash``), or None
    checksum: Optional[str] = None
    #: the module that routes the framework's own allocations into a tag (``Driver.pool``)
    pool: Optional[str] = None
    #: the framework's graph class whose captures unisleep watches (:mod:`unisleep.graph_capture`)
    graph_class: Optional[str] = None
    #: ``() -> None``: give back to the framework's allocator what its device libraries keep
    #: beyond it (e.g. torch's per-handle BLAS workspaces), so that a side going to sleep can
    #: empty that cache too (:meth:`release_library_caches`); None: nothing such on this platform
    library_caches: Optional[str] = None
    #: ``() -> list[str]``: settings of this environment known to break sleep mode, with the fix
    environment_warnings: Optional[str] = None
    #: where torch reads its allocator settings on this platform (expandable segments are
    #: reported on every platform; ``expandable_note`` replaces the common advice)
    alloc_conf_vars: tuple[str, ...] = ()
    expandable_note: Optional[str] = None
    #: (label, module) of the optional packages it uses (``unisleep doctor`` lists them)
    packages: tuple[tuple[str, str], ...] = ()
    #: the pip extra that installs its packages, or ``() -> str`` choosing one here
    extra: str = ""
    extra_for: Optional[str] = None
    #: the module patched into a vLLM platform plugin's worker (``PLATFORM_PLUGIN``,
    #: ``WORKER_MODULE``, ``patch_worker``), or None
    vllm_worker: Optional[str] = None

    # ---- references ----------------------------------------------------------------------
    def resolve(self, ref: str) -> str:
        module = ref.split(":", 1)[0]
        return self.package + module if module.startswith(".") else module

    def load(self, ref: Optional[str]) -> Any:
        """What ``ref`` names (imported now); None for None."""
        if ref is None:
            return None
        module, _, attr = ref.partition(":")
        mod = importlib.import_module(self.resolve(module))
        return getattr(mod, attr) if attr else mod

    def has_module(self, ref: Optional[str]) -> bool:
        """Whether the module of ``ref`` exists, found without importing it."""
        if ref is None:
            return False
        try:
            return importlib.util.find_spec(self.resolve(ref)) is not None
        except (ImportError, ValueError):
            return False

    # ---- what the core asks ---------------------------------------------------------------
    @property
    def is_accelerator(self) -> bool:
        return self.torch_device != "cpu"

    def driver_class(self):
        """The driver class; :class:`~unisleep.errors.PlatformError` naming the pip extra when
        its module cannot be imported."""
        try:
            return self.load(self.driver)
        except ImportError as e:
            extra = self.install_extra()
            hint = f" Install it with: pip install 'unisleep[{extra}]'" if extra else ""
            raise PlatformError(f"the {self.name} backend could not be imported ({e}).{hint}") from e

    def collective_module(self):
        if self.collective is None:
            raise UnsupportedError(f"the {self.name} backend names no collective: weight transfer is not available "
                                   "on it (its descriptor's collective is None)")
        return self.load(self.collective)

    def ipc_module(self):
        return self.load(self.ipc)

    def device_module(self):
        """The platform's torch device module (``torch.cuda`` on NVIDIA GPUs, ...)."""
        import torch

        return torch.get_device_module(self.torch_device)

    def torch_device_name(self, index: int = 0) -> str:
        return self.torch_device if not self.is_accelerator else f"{self.torch_device}:{index}"

    def probe(self) -> Optional[Detection]:
        """Its ``detect`` (None without one, or when it raises: a broken vendor install must
        not break detection)."""
        if self.detect is None:
            return None
        try:
            return self.load(self.detect)()
        except Exception as e:  # a detector may fail any way (a vendor library, a driver); it means: not here
            log.debug("detecting %s failed: %s", self.name, e)
            return None

    def release_library_caches(self) -> None:
        """What the framework's device libraries keep (``library_caches``) back into its
        allocator, whose cache the caller then empties; the next call into such a library makes
        it again.  A no-op where the descriptor names nothing."""
        if self.library_caches is not None:
            self.load(self.library_caches)()

    def warnings(self) -> list[str]:
        return list(self.load(self.environment_warnings)()) if self.environment_warnings else []

    def install_extra(self) -> str:
        """The pip extra for this machine (``extra_for`` where the choice depends on it)."""
        if self.extra_for is not None:
            try:
                return self.load(self.extra_for)() or self.extra
            except Exception:  # advice only (doctor, error hints): a backend's probe that fails
                return self.extra  # falls back to its declared extra
        return self.extra

    def watch_graphs(self) -> bool:
        """Route every capture of its framework's graph class through unisleep's gate
        (:func:`unisleep.graph_capture.watch`); True when watched, False (with a warning) where
        that class cannot be wrapped; True where the platform has none."""
        from . import graph_capture

        if self.graph_class is None:
            return True
        try:
            cls = self.load(self.graph_class)
        except (ImportError, AttributeError) as e:
            log.debug("the %s backend's graph class %s is not available: %s", self.name, self.graph_class, e)
            return True  # no such class in this install: nothing can capture with it
        if graph_capture.watch(cls):
            return True
        log.warning("%s's captures cannot be watched here: a capture outside unisleep's capture contexts may "
                    "overlap unisleep's background work; wrap it in unisleep.graph_capture.capture()",
                    self.graph_class)
        return False


def module_present(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torch_version(attr: str) -> Optional[str]:
    """``torch.version.<attr>`` (e.g. the CUDA or HIP version torch was built for) without
    initialising any device runtime; None without torch."""
    if not module_present("torch"):
        return None
    if "torch" not in sys.modules:  # read torch/version.py, without importing torch (a second or more)
        found = _torch_version_file(attr)
        if found is not _UNKNOWN:
            return found
    try:
        import torch

        return getattr(torch.version, attr, None)
    except Exception:  # a torch that fails to import (broken install, missing library) has no
        return None  # version to report; the caller says torch is unusable


_UNKNOWN = object()


def _torch_version_file(attr: str):
    """``attr``'s value as the installed torch's ``version.py`` assigns it (a literal, read with
    :func:`ast.literal_eval`, never executed); ``_UNKNOWN`` when the file says it otherwise."""
    import ast
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
        where = list(spec.submodule_search_locations or []) if spec else []
        with open(os.path.join(where[0], "version.py"), encoding="utf-8") as f:
            text = f.read()
        m = re.search(rf"^{re.escape(attr)}\s*(?::[^=\n]*)?=\s*(.+?)\s*$", text, re.MULTILINE)
        if m is None:
            return _UNKNOWN
        value = ast.literal_eval(m.group(1))
    except (OSError, IndexError, ValueError, SyntaxError, ImportError):
        return _UNKNOWN
    return value if value is None or isinstance(value, str) else _UNKNOWN


__all__ = ["Backend", "Detection", "DeviceInfo", "module_present", "torch_version"]
