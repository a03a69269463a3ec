"""ROCm backend: HIP virtual memory through ctypes ``libamdhip64.so`` (loaded only when a
driver is created).  The bindings are checked against the real HIP 5.2.3 runtime and header
(tests/test_hip_real.py), the driver's logic against the simulated HIP library in tests/sim;
not run on ROCm hardware — see docs/rocm.md."""

from .descriptor import BACKEND

_LAZY = {"RocmDriver": ".driver", "HipHandle": ".driver", "FileLimitError": ".driver", "AddressMovedError": ".driver",
         "HipError": ".hip", "HipNoDeviceError": ".hip"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = ["BACKEND", *_LAZY]
