"""ctypes binding of the AscendCL runtime calls the Ascend driver uses (``libascendcl.so``).

Nothing here loads a library at import time.  :class:`AclApi` re-types every function by
address from :data:`PROTOTYPES`, so the injected object may be the real ``ctypes.CDLL`` or the
simulated library in tests/sim/fake_acl.py.

Argument orders that differ from CUDA/HIP (CANN ``acl_rt.h``):

* ``aclrtMemGetAllocationGranularity(prop, option, &granularity)`` — the output comes *last*;
* ``aclrtUnmapMem(virPtr)`` and ``aclrtReleaseMemAddress(virPtr)`` take no size;
* ``aclrtMemcpy(dst, destMax, src, count, kind)`` — ``destMax`` is the destination's capacity
  in bytes (we pass the real capacity, not an address as vllm-ascend does);
* ``aclrtMemset(devPtr, maxCount, value, count)``;
* ``aclrtMemLocation`` is ``{id, type}`` — id first, the opposite of CUDA/HIP.
"""

from __future__ import annotations

import ctypes
import glob
import os
from ctypes import POINTER, c_int, c_int32, c_size_t, c_uint32, c_uint64, c_void_p
from typing import Any

from unisleep.backends._native import bind_arguments, bind_prototypes, load_runtime
from unisleep.errors import PlatformError, UnisleepError

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002

ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_NO_PERMISSION = 207006
ACL_ERROR_RT_DRV_INTERNAL_ERROR = 507899

ERROR_NAMES = {
    0: "ACL_SUCCESS",
    100000: "ACL_ERROR_INVALID_PARAM",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    107017: "ACL_ERROR_RT_INVALID_HANDLE",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE",
    207006: "ACL_ERROR_RT_NO_PERMISSION",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}

ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_HBM_MEM = 1
ACL_HBM_MEM_HUGE = 4  # 2 MiB granularity
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0

ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3

#: ``aclrtMemExportToShareableHandle``'s flags: the default keeps the driver's pid whitelist on
#: (only pids given to ``aclrtMemSetPidToShareableHandle`` may import).  unisleep never passes
#: ``ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION``; it is bound only so the ABI check covers it.
ACL_RT_VMM_EXPORT_FLAG_DEFAULT = 0
ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 1

#: every enumerator and code the bindings use: C name -> value (compared with CANN's headers by
#: tests/test_ascend_sim.py::test_acl_bindings_match_the_cann_headers where they exist)
ENUMS: dict[str, int] = {name: code for code, name in ERROR_NAMES.items()}
ENUMS.update({
    name: globals()[name]
    for name in (
        "ACL_MEM_HANDLE_TYPE_NONE", "ACL_MEM_ALLOCATION_TYPE_PINNED", "ACL_HBM_MEM", "ACL_HBM_MEM_HUGE",
        "ACL_MEM_LOCATION_TYPE_DEVICE", "ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM", "ACL_MEMCPY_HOST_TO_HOST",
        "ACL_MEMCPY_HOST_TO_DEVICE", "ACL_MEMCPY_DEVICE_TO_HOST", "ACL_MEMCPY_DEVICE_TO_DEVICE",
        "ACL_RT_VMM_EXPORT_FLAG_DEFAULT", "ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION",
    )
})


class aclrtMemLocation(ctypes.Structure):
    _fields_ = [("id", c_uint32), ("type", c_int)]  # id FIRST


class aclrtPhysicalMemProp(ctypes.Structure):
    _fields_ = [
        ("handleType", c_int),
        ("allocationType", c_int),
        ("memAttr", c_int),
        ("location", aclrtMemLocation),
        ("reserve", c_uint64),
    ]


#: C name -> ctypes declaration of every struct the bindings pass
STRUCTS = {"aclrtMemLocation": aclrtMemLocation, "aclrtPhysicalMemProp": aclrtPhysicalMemProp}

#: every function the bindings call: name -> (restype, [(parameter name, ctype), ...]), with the
#: header's names in the header's order.  The one declaration: :data:`PROTOTYPES` and
#: :data:`PARAM_NAMES` derive from it, :meth:`AclApi.call` passes keyword arguments by these
#: names, and the simulated library's functions must take the same names.
SIGNATURES: dict[str, tuple[Any, list[tuple[str, Any]]]] = {
    "aclrtSetDevice": (c_int, [("deviceId", c_int32)]),
    "aclrtGetDevice": (c_int, [("deviceId", POINTER(c_int32))]),
    "aclrtSynchronizeDevice": (c_int, []),
    "aclrtGetMemInfo": (c_int, [("attr", c_int), ("free", POINTER(c_size_t)), ("total", POINTER(c_size_t))]),
    "aclrtMemGetAllocationGranularity": (c_int, [("prop", POINTER(aclrtPhysicalMemProp)), ("option", c_int),
                                                 ("granularity", POINTER(c_size_t))]),
    "aclrtReserveMemAddress": (c_int, [("virPtr", POINTER(c_void_p)), ("size", c_size_t), ("alignment", c_size_t),
                                       ("expectPtr", c_void_p), ("flags", c_uint64)]),
    "aclrtReleaseMemAddress": (c_int, [("virPtr", c_void_p)]),
    "aclrtMallocPhysical": (c_int, [("handle", POINTER(c_void_p)), ("size", c_size_t),
                                    ("prop", POINTER(aclrtPhysicalMemProp)), ("flags", c_uint64)]),
    "aclrtFreePhysical": (c_int, [("handle", c_void_p)]),
    "aclrtMapMem": (c_int, [("virPtr", c_void_p), ("size", c_size_t), ("offset", c_size_t), ("handle", c_void_p),
                            ("flags", c_uint64)]),
    "aclrtUnmapMem": (c_int, [("virPtr", c_void_p)]),
    "aclrtMemcpy": (c_int, [("dst", c_void_p), ("destMax", c_size_t), ("src", c_void_p), ("count", c_size_t),
                            ("kind", c_int)]),
    "aclrtMemset": (c_int, [("devPtr", c_void_p), ("maxCount", c_size_t), ("value", c_int32), ("count", c_size_t)]),
    "aclrtMallocHost": (c_int, [("hostPtr", POINTER(c_void_p)), ("size", c_size_t)]),
    "aclrtFreeHost": (c_int, [("hostPtr", c_void_p)]),
    # colocated IPC (ipc.py): a 64-bit shareable handle, importable only by whitelisted pids
    "aclrtMemExportToShareableHandle": (c_int, [("handle", c_void_p), ("handleType", c_int), ("flags", c_uint64),
                                                ("shareableHandle", POINTER(c_uint64))]),
    "aclrtMemImportFromShareableHandle": (c_int, [("shareableHandle", c_uint64), ("deviceId", c_int32),
                                                  ("handle", POINTER(c_void_p))]),
    "aclrtMemSetPidToShareableHandle": (c_int, [("shareableHandle", c_uint64), ("pid", POINTER(c_int32)),
                                                ("pidNum", c_size_t)]),
    "aclrtDeviceGetBareTgid": (c_int, [("pid", POINTER(c_int32))]),
}
PROTOTYPES: dict[str, tuple[Any, list]] = {n: (r, [t for _, t in a]) for n, (r, a) in SIGNATURES.items()}
#: the calls only colocated IPC needs: a library without them still runs the driver (ipc.py
#: names what is missing when IPC is asked for)
IPC_FUNCTIONS = ("aclrtMemExportToShareableHandle", "aclrtMemImportFromShareableHandle",
                 "aclrtMemSetPidToShareableHandle", "aclrtDeviceGetBareTgid")
PARAM_NAMES: dict[str, list[str]] = {n: [p for p, _ in a] for n, (_, a) in SIGNATURES.items()}


class AclError(UnisleepError):
    def __init__(self, call: str, code: int, hint: str = ""):
        self.call, self.code = call, code
        super().__init__(f"{call} failed with {ERROR_NAMES.get(code, 'aclError')} ({code}){': ' + hint if hint else ''}")


def library_candidates() -> list[str]:
    out = []
    for root in (os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
                 "/usr/local/Ascend/ascend-toolkit/latest"):
        if root:
            out.append(os.path.join(root, "lib64", "libascendcl.so"))
            out += sorted(glob.glob(os.path.join(root, "*-linux", "lib64", "libascendcl.so")))
    out.append("libascendcl.so")
    return out


def load_library():
    """The real runtime library: the copy already loaded in this process (torch_npu's) wins,
    else ``UNISLEEP_ACL_LIBRARY``, else the CANN toolkit's; a second, different copy is refused
    naming both.  A PlatformError says what to install or set."""
    return load_runtime(
        "libascendcl", "ACL", library_candidates(),
        "the Ascend backend needs libascendcl.so from the CANN toolkit, which was not found "
        "(source set_env.sh, or set UNISLEEP_ACL_LIBRARY to its full path).",
        override=os.environ.get("UNISLEEP_ACL_LIBRARY") or None,
    )


class AclApi:
    """The ACL function table (see :class:`unisleep.backends.rocm.hip.HipApi` for the idea)."""

    def __init__(self, lib):
        self._lib = lib
        missing = bind_prototypes(self, lib, PROTOTYPES)
        #: the IPC calls this library lacks (see :data:`IPC_FUNCTIONS`)
        self.ipc_missing = [n for n in missing if n in IPC_FUNCTIONS]
        missing = [n for n in missing if n not in IPC_FUNCTIONS]
        if missing:
            raise PlatformError(f"libascendcl lacks {', '.join(missing)} (virtual memory needs CANN >= 8)")

    def rc(self, name: str, *args, **kwargs) -> int:
        """Call ``name`` like :meth:`call`, returning its error code instead of raising."""
        return getattr(self, name)(*bind_arguments(name, PARAM_NAMES[name], args, kwargs))

    def call(self, name: str, *args, hint: str = "", **kwargs) -> None:
        """Call ``name`` with its arguments by position or by the header's parameter names
        (:data:`PARAM_NAMES`); raise :class:`AclError` on an error code."""
        rc = getattr(self, name)(*bind_arguments(name, PARAM_NAMES[name], args, kwargs))
        if rc != ACL_SUCCESS:
            raise AclError(name, rc, hint)
