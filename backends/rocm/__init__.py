"""ROCm backend: HIP virtual memory through ctypes ``libamdhip64.so`` (loaded only when a
driver is created).  The bindings are checked against the real HIP 5.2.3 runtime and header
(tests/test_hip_real.py), the driver's logic against the simulated HIP library in tests/sim;
not run on ROCm hardware — see docs/rocm.md."""

from .driver import AddressMovedError, FileLimitError, HipHandle, RocmDriver
from .hip import HipError, HipNoDeviceError

__all__ = ["RocmDriver", "HipHandle", "FileLimitError", "AddressMovedError", "HipError", "HipNoDeviceError"]
