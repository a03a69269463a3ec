"""Ascend colocated IPC for weight transfer: bucket memory another process on the same NPU can
map, made with ACL's virtual-memory calls through the bindings (``acl.py``).

ACL shares physical memory by a 64-bit *shareable handle*, not a file descriptor
(``aclrtMemExportToShareableHandle``), and the driver lets a process import it
(``aclrtMemImportFromShareableHandle``) only if its pid is on the handle's whitelist
(``aclrtMemSetPidToShareableHandle``, set by the exporting process).  So the transfer asks a
buffer for its handle *per receiver*: :meth:`ExportBuffer.handle_for` takes the receiver's pid —
which the transfer reads from the kernel (``SO_PEERCRED`` on that receiver's authenticated IPC
connection), never from a message the receiver sends — whitelists exactly that pid, then returns
the number the transfer sends over the connection.  The whitelist is never switched off: the
export uses ``ACL_RT_VMM_EXPORT_FLAG_DEFAULT``, never ``..._DISABLE_PID_VALIDATION``.

The driver checks the pid it knows the process by on the host (``aclrtDeviceGetBareTgid``;
CANN's export page: use that call, a pid taken elsewhere "may be wrong"); in a container with
its own pid namespace that differs from ``getpid()`` and from what ``SO_PEERCRED`` reports, so
an :class:`~unisleep.errors.UnsupportedError` naming the fix is raised when a buffer is made,
before anything is exported or sent.

The receiver imports into its own device (the sender's: the transfer uses IPC only when every
receiver shares the sender's device), reserves an address range and maps the import at offset 0
(ACL grants access with the mapping, as for the driver's own memory).  Every call first makes
the device current on the calling thread (``driver.bind_device``).

NOT RUN ON ASCEND HARDWARE: tested against the SIMULATED ACL library in two real processes
(tests/test_ascend_ipc_sim.py), whose driver state is shared by the two processes and whose
rules are the Ascend driver's (tests/sim/fake_acl.py cites them).
"""

from __future__ import annotations

import os
import threading
from ctypes import byref, c_int32, c_size_t, c_uint64, c_void_p
from typing import Any, Optional

from unisleep.errors import UnsupportedError

from . import acl
from .driver import bind_device, tensor_over

KIND = "aclrtMem shareable handle (pid whitelist)"
#: how the transfer hands a buffer over (unisleep.transfer.ipc): a number per receiver, valid
#: only for that receiver's pid, instead of a file descriptor
SHARE = "pid-handle"

_lock = threading.Lock()
_api: Optional[acl.AclApi] = None
#: where tensors over the buffers live: None = the NPU (``npu:<index>``); the simulated
#: library's tests set "cpu" (its device memory is host memory)
TENSOR_DEVICE: Optional[str] = None


def use_library(lib: Any) -> None:
    """Use ``lib`` (a loaded ACL library or a simulated one) instead of loading the runtime."""
    global _api
    with _lock:
        _api = acl.AclApi(lib)


def _acl() -> acl.AclApi:
    global _api
    with _lock:
        if _api is None:
            _api = acl.AclApi(acl.load_library())
        api = _api
    if api.ipc_missing:
        raise UnsupportedError(f"this libascendcl lacks {', '.join(api.ipc_missing)}, which colocated IPC needs "
                               "(CANN 8.5.0 and 9.1.0 have them): upgrade CANN, put the engine on another NPU, or send "
                               "through host memory (TransferGroup.create(..., platform='host'))")
    return api


def _prop(device_index: int) -> acl.aclrtPhysicalMemProp:
    prop = acl.aclrtPhysicalMemProp()
    prop.handleType = acl.ACL_MEM_HANDLE_TYPE_NONE
    prop.allocationType = acl.ACL_MEM_ALLOCATION_TYPE_PINNED
    prop.memAttr = acl.ACL_HBM_MEM_HUGE
    prop.location.id = device_index
    prop.location.type = acl.ACL_MEM_LOCATION_TYPE_DEVICE
    prop.reserve = 0
    return prop


def _granularity(api: acl.AclApi, device_index: int) -> int:
    g = c_size_t()
    api.call("aclrtMemGetAllocationGranularity", prop=byref(_prop(device_index)),
             option=acl.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, granularity=byref(g))
    return int(g.value)


def driver_pid(api: acl.AclApi) -> int:
    """The pid the Ascend driver knows this process by (``aclrtDeviceGetBareTgid``)."""
    pid = c_int32(0)
    api.call("aclrtDeviceGetBareTgid", pid=byref(pid))
    return int(pid.value)


def check_pid_view(api: acl.AclApi) -> None:
    """The pids the kernel reports here (``getpid``, ``SO_PEERCRED``) must be the ones the driver
    checks, or a whitelist built from them would name other processes: refused otherwise."""
    bare, mine = driver_pid(api), os.getpid()
    if bare != mine:
        raise UnsupportedError(
            f"colocated IPC on Ascend needs the processes in the host's pid namespace: the driver knows this "
            f"process as pid {bare} (aclrtDeviceGetBareTgid) but it runs as pid {mine}, so the receivers' pids "
            "seen here cannot be whitelisted. Start the trainer and the engine with the host's pid namespace "
            "(docker run --pid=host), put the engine on another NPU, or send through host memory "
            "(TransferGroup.create(..., platform='host'))")


def _tensor(ptr: int, nbytes: int, device_index: int):
    import torch

    if TENSOR_DEVICE:
        dev = torch.device(TENSOR_DEVICE)
    else:
        from .descriptor import BACKEND

        dev = torch.device(BACKEND.torch_device, device_index)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    return tensor_over(ptr, nbytes, dev)


class _MappedBuffer:
    """Physical memory ``_handle`` mapped at ``_va`` (``size`` bytes), ``.tensor`` over it."""

    _va: Optional[int] = None
    _handle: Optional[int] = None

    def _sized(self, api: acl.AclApi, nbytes: int, device_index: int) -> None:
        gran = _granularity(api, device_index)
        self.device_index, self.nbytes = device_index, nbytes
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)

    def _adopt(self, api: acl.AclApi, handle: int) -> None:
        """Map physical memory ``handle`` (freed again if the mapping fails) and make ``.tensor``."""
        self._handle = handle
        try:
            self._map(api)
        except Exception:
            api.rc("aclrtFreePhysical", handle=self._handle)
            self._handle = None
            raise
        self.tensor = _tensor(self._va, self.nbytes, self.device_index)

    def _map(self, api: acl.AclApi) -> None:
        p = c_void_p()
        api.call("aclrtReserveMemAddress", virPtr=byref(p), size=self.size, alignment=0, expectPtr=None, flags=0,
                 hint="address range for an IPC buffer")
        va = int(p.value)
        try:
            api.call("aclrtMapMem", virPtr=va, size=self.size, offset=0, handle=self._handle, flags=0)
        except Exception:
            api.rc("aclrtReleaseMemAddress", virPtr=va)
            raise
        self._va = va

    def close(self) -> None:
        if self._handle is None:
            return
        api = _acl()
        self.tensor = None
        bind_device(api, self.device_index)
        if self._va is not None:
            api.call("aclrtSynchronizeDevice")
            api.call("aclrtUnmapMem", virPtr=self._va)
            api.call("aclrtReleaseMemAddress", virPtr=self._va)
            self._va = None
        api.call("aclrtFreePhysical", handle=self._handle)
        self._handle = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # a finalizer must not raise; the runtime may already be torn down at exit
            pass


class ExportBuffer(_MappedBuffer):
    """Sender side: ``nbytes`` of NPU memory (rounded up to the granularity) that receivers can
    import by a shareable handle; ``.tensor`` is a uint8 tensor over it."""

    def __init__(self, nbytes: int, device_index: int = 0):
        api = _acl()
        bind_device(api, device_index)
        check_pid_view(api)
        self._sized(api, nbytes, device_index)
        self._shareable: Optional[int] = None
        self._granted: set[int] = set()
        h = c_void_p()
        api.call("aclrtMallocPhysical", handle=byref(h), size=self.size, prop=byref(_prop(device_index)), flags=0,
                 hint="an exportable IPC buffer")
        self._adopt(api, int(h.value))

    def handle_for(self, pid: int) -> int:
        """The shareable handle, importable by process ``pid`` (the kernel's word for the
        receiver, ``SO_PEERCRED``): exported once with the whitelist on, ``pid`` added to it once.
        A pid the kernel could not name (0: a process outside this pid namespace) is refused."""
        if not isinstance(pid, int) or pid <= 0:
            raise UnsupportedError(f"the receiver's pid is not known here (SO_PEERCRED says {pid!r}: it runs in "
                                   "another pid namespace): colocated IPC on Ascend whitelists receivers by pid. "
                                   "Run both in one pid namespace, or send through host memory "
                                   "(TransferGroup.create(..., platform='host'))")
        api = _acl()
        bind_device(api, self.device_index)
        if self._shareable is None:
            out = c_uint64(0)
            api.call("aclrtMemExportToShareableHandle", handle=self._handle, handleType=acl.ACL_MEM_HANDLE_TYPE_NONE,
                     flags=acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, shareableHandle=byref(out))
            self._shareable = int(out.value)
        if pid not in self._granted:
            arr = (c_int32 * 1)(pid)
            api.call("aclrtMemSetPidToShareableHandle", shareableHandle=self._shareable, pid=arr, pidNum=1,
                     hint=f"whitelisting receiver pid {pid}")
            self._granted.add(pid)
        return self._shareable


class ImportedBuffer(_MappedBuffer):
    """Receiver side: import shareable handle ``handle`` (this process's pid must be on its
    whitelist) into ``device_index``, map it into a reserved range; ``.tensor`` over it."""

    def __init__(self, handle: int, nbytes: int, device_index: int = 0):
        if not isinstance(handle, int) or not 0 < handle < 2**64:
            raise UnsupportedError(f"not an ACL shareable handle: {handle!r}")
        api = _acl()
        bind_device(api, device_index)
        self._sized(api, nbytes, device_index)
        h = c_void_p()
        api.call("aclrtMemImportFromShareableHandle", shareableHandle=handle, deviceId=device_index, handle=byref(h),
                 hint="importing the sender's bucket memory (is this process's pid on its whitelist?)")
        self._adopt(api, int(h.value))


def synchronize(device_index: int = 0) -> None:
    """Wait for the NPU work of this process before the peer reads or reuses a buffer."""
    api = _acl()
    bind_device(api, device_index)
    api.call("aclrtSynchronizeDevice")
