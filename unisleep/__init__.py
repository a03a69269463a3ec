"""unisleep: sleep, wake and weight transfer for trainers and rollout engines that share
accelerators — the same API on NVIDIA CUDA, AMD ROCm, Huawei Ascend and plain host memory.

Public aliases — modules that only re-export, kept because configurations and installed metadata
name them (code imports the real module):

* ``unisleep.vllm_plugin`` → :mod:`unisleep.vllm_worker.plugin` (vLLM's general-plugin entry point
  in environments installed before 2026-12-03; pyproject.toml now names the plugin itself);
* ``unisleep.engines.vllm_worker_ext`` → :mod:`unisleep.vllm_worker.extension`
  (``--worker-extension-cls``).
"""

from . import errors
from .errors import (
    BackupCorruptError,
    BackupError,
    BackupLostError,
    CopyInFlightError,
    HostBudgetError,
    HostMemoryError,
    InsufficientMemoryError,
    LiveTensorsError,
    SleepBudgetError,
    SpillDirError,
    InvalidArgumentError,
    InvalidTransitionError,
    LifecycleClosedError,
    PlatformError,
    UnisleepError,
    UnknownTagError,
    UnsupportedError,
)
from .lifecycle import MemoryLifecycle, Report
from .platform import DeviceInfo, Platform, detect_platform
from .registry import available_backends, register_backend

__version__ = "0.1.0"

__all__ = [
    "MemoryLifecycle",
    "Report",
    "Platform",
    "DeviceInfo",
    "detect_platform",
    "available_backends",
    "register_backend",
    "errors",
    "UnisleepError",
    "InvalidTransitionError",
    "LifecycleClosedError",
    "HostBudgetError",
    "HostMemoryError",
    "UnsupportedError",
    "PlatformError",
    "InvalidArgumentError",
    "UnknownTagError",
    "BackupError",
    "BackupCorruptError",
    "BackupLostError",
    "CopyInFlightError",
    "InsufficientMemoryError",
    "SpillDirError",
    "SleepBudgetError",
    "LiveTensorsError",
    "__version__",
]


def _map_source_backends() -> None:
    """The drivers live in the top-level ``backends/`` folder and install as
    ``unisleep.backends``.  When unisleep runs from a source tree (``PYTHONPATH=.``, or a
    checkout that shadows an editable install), map that folder to ``unisleep.backends``."""
    import importlib.util
    import os
    import sys

    if "unisleep.backends" in sys.modules:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(root, "backends")
    init = os.path.join(src, "__init__.py")
    # a source tree: unisleep/ beside backends/ and the project file (an installed unisleep sits
    # in site-packages, where a folder called backends/ may belong to another distribution)
    if not (os.path.exists(os.path.join(root, "pyproject.toml")) and os.path.exists(os.path.join(src, "host", "driver.py"))):
        return
    try:
        found = importlib.util.find_spec("unisleep.backends")
    except (ImportError, ValueError):
        found = None
    # an installed copy is used unless this package sits in a source tree with its own
    # backends/ (an editable install of another checkout must not shadow this one's drivers)
    if not os.path.exists(init):
        return
    if found is not None and os.path.realpath(found.origin or "") == os.path.realpath(init):
        return
    spec = importlib.util.spec_from_file_location("unisleep.backends", init, submodule_search_locations=[src])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["unisleep.backends"] = mod
    spec.loader.exec_module(mod)
    globals()["backends"] = mod


_map_source_backends()
