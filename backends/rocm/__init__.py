"""ROCm backend: HIP virtual memory through ctypes ``libamdhip64.so`` (loaded only when a
driver is created).  Verified against the simulated HIP library in tests/sim, not on ROCm
hardware — see docs/rocm.md."""

from .driver import AddressMovedError, FileLimitError, HipHandle, RocmDriver

__all__ = ["RocmDriver", "HipHandle", "FileLimitError", "AddressMovedError"]
