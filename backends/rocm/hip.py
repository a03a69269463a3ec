"""ctypes binding of the HIP runtime calls the ROCm driver uses (``libamdhip64.so``).

Nothing here loads a library at import time.  :func:`load_library` finds ``libamdhip64.so``
when a :class:`~unisleep.backends.rocm.RocmDriver` is created without an injected library;
:class:`HipApi` re-types every function by address from the prototypes below, so the injected
object may be the real ``ctypes.CDLL`` or a simulated library (tests/sim/fake_hip.py) that
exposes ``CFUNCTYPE`` callbacks with the same C prototypes.

Prototypes follow the HIP headers (``hip_runtime_api.h``, "Virtual Memory Management").
tests/test_hip_real.py compiles probes against the real header and compares every prototype,
struct layout and code declared here; the simulated library takes :data:`PROTOTYPES` and the
structs from here, so there is one declaration of the ABI.
"""

from __future__ import annotations

import ctypes
import glob
import os
from ctypes import POINTER, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

from unisleep.backends._native import bind_arguments, bind_prototypes, load_runtime
from unisleep.errors import PlatformError, UnisleepError

# ---- enums and error codes (hip_runtime_api.h, driver_types.h) -------------------------------
# Every name here is checked against the real header by tests/test_hip_real.py (ENUMS below).
hipSuccess = 0
hipErrorInvalidValue = 1
hipErrorOutOfMemory = 2
hipErrorNotInitialized = 3
hipErrorInsufficientDriver = 35
hipErrorNoDevice = 100
hipErrorInvalidDevice = 101
hipErrorInvalidHandle = 400
hipErrorIllegalAddress = 700
hipErrorNotSupported = 801

ERROR_NAMES = {
    hipSuccess: "hipSuccess",
    hipErrorInvalidValue: "hipErrorInvalidValue",
    hipErrorOutOfMemory: "hipErrorOutOfMemory",
    hipErrorNotInitialized: "hipErrorNotInitialized",
    hipErrorInsufficientDriver: "hipErrorInsufficientDriver",
    hipErrorNoDevice: "hipErrorNoDevice",
    hipErrorInvalidDevice: "hipErrorInvalidDevice",
    hipErrorInvalidHandle: "hipErrorInvalidHandle",
    hipErrorIllegalAddress: "hipErrorIllegalAddress",
    hipErrorNotSupported: "hipErrorNotSupported",
}

hipMemAllocationTypePinned = 1
hipMemHandleTypeNone = 0
hipMemHandleTypePosixFileDescriptor = 1
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

#: every enumerator, error code and flag the bindings use: C name -> value
ENUMS: dict[str, int] = {name: code for code, name in ERROR_NAMES.items()}
ENUMS.update({
    name: globals()[name]
    for name in (
        "hipMemAllocationTypePinned", "hipMemHandleTypeNone", "hipMemHandleTypePosixFileDescriptor",
        "hipMemLocationTypeDevice",
        "hipMemAllocationGranularityMinimum", "hipMemAllocationGranularityRecommended",
        "hipMemAccessFlagsProtReadWrite", "hipMemcpyHostToHost", "hipMemcpyHostToDevice",
        "hipMemcpyDeviceToHost", "hipMemcpyDeviceToDevice", "hipMemcpyDefault", "hipHostMallocDefault",
    )
})


# ---- structs ---------------------------------------------------------------------------------
# Field names are the header's, so the C probe in tests/test_hip_real.py can ask for each offset.
class hipMemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]  # same order as CUDA (type, id)


class _AllocFlags(ctypes.Structure):  # the anonymous ``allocFlags`` struct
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
    ]


class hipMemAllocationProp(ctypes.Structure):
    """HIP >= 5.3 (ROCm 5.3 onwards, unchanged through 6.x).  ``requestedHandleType`` shares a
    union with ``requestedHandleTypes`` in newer headers; same slot."""

    _fields_ = [
        ("type", c_int),
        ("requestedHandleType", c_int),
        ("location", hipMemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class hipMemAllocationProp_v5_2(ctypes.Structure):
    """HIP 5.2 (ROCm 5.2.x, e.g. Debian 12's libamdhip64-5 5.2.3): the first VMM release laid the
    struct out differently — same size, every field elsewhere.  Chosen by the runtime's version."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("location", hipMemLocation),
        ("requestedHandleType", c_int),
        ("type", c_int),
        ("usage", ctypes.c_ushort),
        ("win32HandleMetaData", c_void_p),
    ]


class hipMemAccessDesc(ctypes.Structure):
    _fields_ = [("location", hipMemLocation), ("flags", c_int)]


#: HIP_VERSION (major * 10^7 + minor * 10^5 + patch) from which ``hipMemAllocationProp`` has its
#: current layout; hipRuntimeGetVersion returns the same encoding
PROP_LAYOUT_CHANGED = 50300000


#: HIP_VERSION from which ``hipMemSetAccess`` must start at the start of a reservation: ROCm 7.2
#: rejects valid sub-buffer mappings at a non-zero offset (rocm-systems PR #9360, SWDEV-568260;
#: the fix is on develop only, so every later runtime is treated alike until one is shown fixed)
ACCESS_FROM_BASE_SINCE = 70200000


def alloc_prop_type(runtime_version: int):
    """The ``hipMemAllocationProp`` declaration for a runtime of this HIP_VERSION."""
    return hipMemAllocationProp_v5_2 if 0 < runtime_version < PROP_LAYOUT_CHANGED else hipMemAllocationProp


def structs(runtime_version: int) -> dict[str, type]:
    """C name -> ctypes declaration of every struct the bindings pass, for this HIP_VERSION."""
    return {
        "hipMemLocation": hipMemLocation,
        "hipMemAccessDesc": hipMemAccessDesc,
        "hipMemAllocationProp": alloc_prop_type(runtime_version),
    }


# ---- prototypes: name -> (restype, [(parameter name, ctype), ...]) ------------------------------
def signatures(prop: type = hipMemAllocationProp) -> dict[str, tuple[Any, list[tuple[str, Any]]]]:
    """Every function the bindings call, with the header's parameter names and types in the
    header's order (``prop``: the ``hipMemAllocationProp`` layout in use).  The one declaration:
    :func:`prototypes` and :data:`PARAM_NAMES` derive from it, :meth:`HipApi.call` passes keyword
    arguments by these names, and the simulated library's functions must take the same names."""
    return {
        "hipRuntimeGetVersion": (c_int, [("runtimeVersion", POINTER(c_int))]),
        "hipSetDevice": (c_int, [("deviceId", c_int)]),
        "hipGetDevice": (c_int, [("deviceId", POINTER(c_int))]),
        "hipGetDeviceCount": (c_int, [("count", POINTER(c_int))]),
        "hipDeviceSynchronize": (c_int, []),
        "hipMemGetInfo": (c_int, [("free", POINTER(c_size_t)), ("total", POINTER(c_size_t))]),
        "hipMemGetAllocationGranularity": (c_int, [("granularity", POINTER(c_size_t)), ("prop", POINTER(prop)),
                                                   ("option", c_int)]),
        "hipMemAddressReserve": (c_int, [("ptr", POINTER(c_void_p)), ("size", c_size_t), ("alignment", c_size_t),
                                         ("addr", c_void_p), ("flags", c_ulonglong)]),
        "hipMemAddressFree": (c_int, [("devPtr", c_void_p), ("size", c_size_t)]),
        "hipMemCreate": (c_int, [("handle", POINTER(c_void_p)), ("size", c_size_t), ("prop", POINTER(prop)),
                                 ("flags", c_ulonglong)]),
        "hipMemMap": (c_int, [("ptr", c_void_p), ("size", c_size_t), ("offset", c_size_t), ("handle", c_void_p),
                              ("flags", c_ulonglong)]),
        "hipMemSetAccess": (c_int, [("ptr", c_void_p), ("size", c_size_t), ("desc", POINTER(hipMemAccessDesc)),
                                    ("count", c_size_t)]),
        "hipMemUnmap": (c_int, [("ptr", c_void_p), ("size", c_size_t)]),
        "hipMemRelease": (c_int, [("handle", c_void_p)]),
        # colocated IPC (backends/rocm/ipc.py): the fd is written to *shareableHandle on export and
        # passed by value, cast to a pointer, on import (HIP's own hip-tests,
        # unit/virtualMemoryManagement/hipMemImportFromShareableHandle.cc)
        "hipMemExportToShareableHandle": (c_int, [("shareableHandle", c_void_p), ("handle", c_void_p),
                                                  ("handleType", c_int), ("flags", c_ulonglong)]),
        "hipMemImportFromShareableHandle": (c_int, [("handle", POINTER(c_void_p)), ("osHandle", c_void_p),
                                                    ("shHandleType", c_int)]),
        "hipMemcpy": (c_int, [("dst", c_void_p), ("src", c_void_p), ("sizeBytes", c_size_t), ("kind", c_int)]),
        "hipMemset": (c_int, [("dst", c_void_p), ("value", c_int), ("sizeBytes", c_size_t)]),
        "hipHostMalloc": (c_int, [("ptr", POINTER(c_void_p)), ("size", c_size_t), ("flags", c_uint)]),
        "hipHostFree": (c_int, [("ptr", c_void_p)]),
    }


def prototypes(prop: type = hipMemAllocationProp) -> dict[str, tuple[Any, list]]:
    """The C prototypes of every function the bindings call: name -> (restype, argtypes)."""
    return {name: (res, [t for _, t in params]) for name, (res, params) in signatures(prop).items()}


#: name -> the header's parameter names, in order
PARAM_NAMES: dict[str, list[str]] = {name: [n for n, _ in params] for name, (_, params) in signatures().items()}

#: the table for the current layout (the simulated library builds its callbacks from it)
PROTOTYPES = prototypes()


def _hint_for(code: int) -> str:
    if code in (hipErrorNoDevice, hipErrorInvalidDevice):
        return "no usable AMD GPU: " + NO_GPU_HELP
    if code == hipErrorInsufficientDriver:
        return "the amdgpu kernel driver is missing or too old for this HIP runtime: " + NO_GPU_HELP
    return ""


NO_GPU_HELP = (
    "this needs an AMD GPU with the amdgpu kernel driver (/dev/kfd and /dev/dri/renderD*, readable by "
    "this user: groups render and video); check ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES. On a "
    "machine without one, use the host backend: MemoryLifecycle(\"host\")."
)


class HipError(UnisleepError):
    """A HIP call returned an error code."""

    def __init__(self, call: str, code: int, hint: str = ""):
        self.call, self.code = call, code
        name = ERROR_NAMES.get(code, "unknown")
        hint = "; ".join(h for h in (hint, _hint_for(code)) if h)
        super().__init__(f"{call} failed with {name} ({code}){': ' + hint if hint else ''}")


class HipNoDeviceError(PlatformError):
    """The HIP runtime loaded but sees no (or not the requested) AMD GPU."""


def library_candidates() -> list[str]:
    """Where to look when no HIP runtime is loaded yet: torch's ROCm wheel first, then the
    system's (``ROCM_PATH``/``ROCM_HOME``, ``/opt/rocm*``, the linker's path by name)."""
    out = []
    try:  # ROCm wheels of torch ship the runtime next to libtorch
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec and spec.origin:
            out.append(os.path.join(os.path.dirname(spec.origin), "lib", "libamdhip64.so"))
    except Exception:  # torch absent or broken: one candidate fewer
        pass
    for root in (os.environ.get("ROCM_PATH"), os.environ.get("ROCM_HOME"), "/opt/rocm"):
        if root:
            out.append(os.path.join(root, "lib", "libamdhip64.so"))
    out += sorted(glob.glob("/opt/rocm-*/lib/libamdhip64.so"), reverse=True)
    out += ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"]
    return out


def load_library():
    """The real runtime library: the copy already loaded in this process (torch's, typically),
    else ``UNISLEEP_HIP_LIBRARY``, torch's, the system's; a second, different copy is refused
    naming both.  A PlatformError says what to install or set."""
    return load_runtime(
        "libamdhip64", "HIP", library_candidates(),
        "the ROCm backend needs the HIP runtime libamdhip64.so, which was not found "
        "(set ROCM_PATH, or UNISLEEP_HIP_LIBRARY to its full path).",
        override=os.environ.get("UNISLEEP_HIP_LIBRARY") or None,
    )


class HipApi:
    """The HIP function table: each attribute is a typed ctypes function.

    ``lib`` is anything whose attributes named like the C functions are ctypes function
    pointers (a ``CDLL`` or a simulated library); each is re-typed by address with
    :func:`prototypes`, so the calls are marshalled exactly as against the real library.
    ``runtime_version`` is ``hipRuntimeGetVersion``'s HIP_VERSION, and ``Prop`` the
    ``hipMemAllocationProp`` declaration for it.
    """

    def __init__(self, lib):
        self._lib = lib  # keep the library (and a simulated one's callbacks) alive
        self.path = getattr(lib, "unisleep_path", None) or getattr(lib, "_name", None) or type(lib).__name__
        missing = bind_prototypes(self, lib, {"hipRuntimeGetVersion": PROTOTYPES["hipRuntimeGetVersion"]})
        v = c_int(0)
        if missing or self.hipRuntimeGetVersion(ctypes.byref(v)) != hipSuccess or v.value <= 0:
            raise PlatformError(f"{self.path} does not report its HIP version (hipRuntimeGetVersion); "
                                "is it libamdhip64 from ROCm >= 5.2?")
        self.runtime_version = int(v.value)
        self.Prop = alloc_prop_type(self.runtime_version)
        missing = bind_prototypes(self, lib, prototypes(self.Prop))
        if missing:
            raise PlatformError(f"the HIP library {self.path} (HIP {version_text(self.runtime_version)}) lacks "
                                f"{', '.join(missing)}: HIP virtual memory needs ROCm >= 5.2")

    def rc(self, name: str, *args, **kwargs) -> int:
        """Call ``name`` (arguments as for :meth:`call`) and return its error code."""
        return getattr(self, name)(*bind_arguments(name, PARAM_NAMES[name], args, kwargs))

    def call(self, name: str, *args, hint: str = "", **kwargs) -> None:
        """Call ``name`` with its arguments by position or by the header's parameter names
        (:data:`PARAM_NAMES`); raise :class:`HipError` on an error code."""
        rc = getattr(self, name)(*bind_arguments(name, PARAM_NAMES[name], args, kwargs))
        if rc != hipSuccess:
            raise HipError(name, rc, hint)


def version_text(v: int) -> str:
    """HIP_VERSION as ``major.minor.patch`` (50221153 -> 5.2.21153)."""
    return f"{v // 10_000_000}.{v // 100_000 % 100}.{v % 100_000}"
