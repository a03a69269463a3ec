"""ctypes binding of the HIP runtime calls the ROCm driver uses (``libamdhip64.so``).

Nothing here loads a library at import time.  :func:`load_library` finds ``libamdhip64.so``
when a :class:`~unisleep.backends.rocm.RocmDriver` is created without an injected library;
:class:`HipApi` re-types every function by address from the prototypes below, so the injected
object may be the real ``ctypes.CDLL`` or a simulated library (tests/sim/fake_hip.py) that
exposes ``CFUNCTYPE`` callbacks with the same C prototypes.

Prototypes follow the HIP headers (``hip_runtime_api.h``, "Virtual Memory Management").
"""

from __future__ import annotations

import ctypes
import glob
import os
from ctypes import POINTER, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

from unisleep.backends._native import bind_prototypes, load_first
from unisleep.errors import PlatformError, UnisleepError

# ---- enums (hip_runtime_api.h) ---------------------------------------------------------------
hipSuccess = 0
hipErrorInvalidValue = 1
hipErrorOutOfMemory = 2
hipErrorNotInitialized = 3
hipErrorInvalidDevice = 101
hipErrorNotSupported = 801

ERROR_NAMES = {
    0: "hipSuccess",
    1: "hipErrorInvalidValue",
    2: "hipErrorOutOfMemory",
    3: "hipErrorNotInitialized",
    100: "hipErrorNoDevice",
    101: "hipErrorInvalidDevice",
    400: "hipErrorInvalidHandle",
    801: "hipErrorNotSupported",
}

hipMemAllocationTypePinned = 1
hipMemHandleTypeNone = 0
hipMemLocationTypeDevice = 1
hipMemAllocationGranularityMinimum = 0
hipMemAllocationGranularityRecommended = 1
hipMemAccessFlagsProtReadWrite = 3

hipMemcpyHostToHost = 0
hipMemcpyHostToDevice = 1
hipMemcpyDeviceToHost = 2
hipMemcpyDeviceToDevice = 3
hipMemcpyDefault = 4

hipHostMallocDefault = 0


# ---- structs ---------------------------------------------------------------------------------
class hipMemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]  # same order as CUDA (type, id)


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
    ]


class hipMemAllocationProp(ctypes.Structure):
    # ``requestedHandleType`` is called ``requestedHandleTypes`` in older HIP; same slot.
    _fields_ = [
        ("type", c_int),
        ("requestedHandleType", c_int),
        ("location", hipMemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class hipMemAccessDesc(ctypes.Structure):
    _fields_ = [("location", hipMemLocation), ("flags", c_int)]


# ---- prototypes: name -> (restype, argtypes) -------------------------------------------------
PROTOTYPES: dict[str, tuple[Any, list]] = {
    "hipSetDevice": (c_int, [c_int]),
    "hipGetDeviceCount": (c_int, [POINTER(c_int)]),
    "hipDeviceSynchronize": (c_int, []),
    "hipMemGetInfo": (c_int, [POINTER(c_size_t), POINTER(c_size_t)]),
    "hipMemGetAllocationGranularity": (c_int, [POINTER(c_size_t), POINTER(hipMemAllocationProp), c_int]),
    "hipMemAddressReserve": (c_int, [POINTER(c_void_p), c_size_t, c_size_t, c_void_p, c_ulonglong]),
    "hipMemAddressFree": (c_int, [c_void_p, c_size_t]),
    "hipMemCreate": (c_int, [POINTER(c_void_p), c_size_t, POINTER(hipMemAllocationProp), c_ulonglong]),
    "hipMemMap": (c_int, [c_void_p, c_size_t, c_size_t, c_void_p, c_ulonglong]),
    "hipMemSetAccess": (c_int, [c_void_p, c_size_t, POINTER(hipMemAccessDesc), c_size_t]),
    "hipMemUnmap": (c_int, [c_void_p, c_size_t]),
    "hipMemRelease": (c_int, [c_void_p]),
    "hipMemcpy": (c_int, [c_void_p, c_void_p, c_size_t, c_int]),
    "hipMemset": (c_int, [c_void_p, c_int, c_size_t]),
    "hipHostMalloc": (c_int, [POINTER(c_void_p), c_size_t, c_uint]),
    "hipHostFree": (c_int, [c_void_p]),
}


class HipError(UnisleepError):
    """A HIP call returned an error code."""

    def __init__(self, call: str, code: int, hint: str = ""):
        self.call, self.code = call, code
        name = ERROR_NAMES.get(code, "unknown")
        super().__init__(f"{call} failed with {name} ({code}){': ' + hint if hint else ''}")


def library_candidates() -> list[str]:
    out = []
    for var in ("UNISLEEP_HIP_LIBRARY",):
        if os.environ.get(var):
            out.append(os.environ[var])
    for root in (os.environ.get("ROCM_PATH"), os.environ.get("ROCM_HOME"), "/opt/rocm"):
        if root:
            out.append(os.path.join(root, "lib", "libamdhip64.so"))
    out += sorted(glob.glob("/opt/rocm-*/lib/libamdhip64.so"), reverse=True)
    try:  # ROCm wheels of torch ship the runtime next to libtorch
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec and spec.origin:
            out.append(os.path.join(os.path.dirname(spec.origin), "lib", "libamdhip64.so"))
    except Exception:
        pass
    out.append("libamdhip64.so")
    return out


def load_library():
    """The real runtime library, or a PlatformError that says what to install/set."""
    return load_first(
        library_candidates(),
        "the ROCm backend needs the HIP runtime libamdhip64.so, which was not found "
        "(set ROCM_PATH, or UNISLEEP_HIP_LIBRARY to its full path).",
    )


class HipApi:
    """The HIP function table: each attribute is a typed ctypes function.

    ``lib`` is anything whose attributes named like the C functions are ctypes function
    pointers (a ``CDLL`` or a simulated library); each is re-typed by address with
    :data:`PROTOTYPES`, so the calls are marshalled exactly as against the real library.
    """

    def __init__(self, lib):
        self._lib = lib  # keep the library (and a simulated one's callbacks) alive
        missing = bind_prototypes(self, lib, PROTOTYPES)
        if missing:
            raise PlatformError(f"the HIP library lacks {', '.join(missing)} (HIP virtual memory needs ROCm >= 5.x)")

    def call(self, name: str, *args, hint: str = "") -> None:
        rc = getattr(self, name)(*args)
        if rc != hipSuccess:
            raise HipError(name, rc, hint)
