"""unisleep: sleep, wake and weight transfer for trainers and rollout engines that share
accelerators — the same API on NVIDIA CUDA, AMD ROCm, Huawei Ascend and plain host memory."""

from . import errors
from .errors import (
    HostBudgetError,
    InvalidArgumentError,
    InvalidTransitionError,
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
    "HostBudgetError",
    "UnsupportedError",
    "PlatformError",
    "InvalidArgumentError",
    "UnknownTagError",
    "__version__",
]
