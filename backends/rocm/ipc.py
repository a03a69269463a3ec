"""AMD colocated IPC for weight transfer: bucket memory another process on the same GPU can map,
made with HIP's virtual-memory calls through the bindings (``hip.py``).

Never ``hipIpcGetMemHandle``: it does not reject VMM memory and has crashed kernels with it
(ROCm/clr #265).  The sender creates its buffers itself with ``requestedHandleType =
hipMemHandleTypePosixFileDescriptor`` and exports a file descriptor
(``hipMemExportToShareableHandle`` writes it to ``*shareableHandle``); the receiver imports it
(``hipMemImportFromShareableHandle`` takes the fd by value, cast to a pointer — as HIP's own
hip-tests do), reserves an address range, maps the allocation and grants itself access with one
``hipMemSetAccess`` over the whole range from its start (ROCm 7.2 rejects any other offset).  The
descriptor travels over a Unix socket with SCM_RIGHTS (unisleep.transfer does that part).
Every call first makes the device current on the calling thread.  Needs HIP >= 6.2 (the
multi-process import HIP's tests require).

NOT RUN ON ROCm HARDWARE: tested against the SIMULATED HIP library in two real processes
(tests/test_rocm_ipc_sim.py), whose exported descriptor is a real memfd both processes map.
"""

from __future__ import annotations

import os
import threading
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
from typing import Any, Optional

from . import hip

KIND = "hipMem POSIX fd"

_lock = threading.Lock()
_api: Optional[hip.HipApi] = None
#: where tensors over the buffers live: None = the ROCm torch device (``cuda:<index>``); the
#: simulated library's tests set "cpu" (its device memory is host memory)
TENSOR_DEVICE: Optional[str] = None


def use_library(lib: Any) -> None:
    """Use ``lib`` (a loaded HIP library or a simulated one) instead of loading the runtime."""
    global _api
    with _lock:
        _api = hip.HipApi(lib)


def _hip() -> hip.HipApi:
    global _api
    with _lock:
        if _api is None:
            _api = hip.HipApi(hip.load_library())
        return _api


def _device(api: hip.HipApi, device_index: int) -> None:
    cur = c_int(-1)
    if api.rc("hipGetDevice", deviceId=byref(cur)) != hip.hipSuccess or cur.value != device_index:
        api.call("hipSetDevice", deviceId=device_index)


def _prop(api: hip.HipApi, device_index: int):
    prop = api.Prop()
    prop.type = hip.hipMemAllocationTypePinned
    prop.requestedHandleType = hip.hipMemHandleTypePosixFileDescriptor
    prop.location.type = hip.hipMemLocationTypeDevice
    prop.location.id = device_index
    return prop


def _granularity(api: hip.HipApi, device_index: int) -> int:
    g = c_size_t()
    api.call("hipMemGetAllocationGranularity", granularity=byref(g), prop=byref(_prop(api, device_index)),
             option=hip.hipMemAllocationGranularityMinimum)
    return int(g.value)


def _tensor(ptr: int, nbytes: int, device_index: int):
    import torch

    dev = torch.device(TENSOR_DEVICE) if TENSOR_DEVICE else torch.device("cuda", device_index)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    storage = torch._C._construct_storage_from_data_pointer(ptr, dev, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)


class _MappedBuffer:
    """Device memory mapped at ``_va`` (``size`` bytes, handle ``_handle``), ``.tensor`` over it."""

    _fd = -1
    _va: Optional[int] = None

    def _map(self, api: hip.HipApi) -> None:
        p = c_void_p()
        api.call("hipMemAddressReserve", ptr=byref(p), size=self.size, alignment=0, addr=None, flags=0,
                 hint="address range for an IPC buffer")
        va = int(p.value)
        try:
            api.call("hipMemMap", ptr=va, size=self.size, offset=0, handle=self._handle, flags=0)
        except Exception:
            api.rc("hipMemAddressFree", devPtr=va, size=self.size)
            raise
        acc = hip.hipMemAccessDesc()
        acc.location.type = hip.hipMemLocationTypeDevice
        acc.location.id = self.device_index
        acc.flags = hip.hipMemAccessFlagsProtReadWrite
        try:
            api.call("hipMemSetAccess", ptr=va, size=self.size, desc=byref(acc), count=1)
        except Exception:
            api.rc("hipMemUnmap", ptr=va, size=self.size)
            api.rc("hipMemAddressFree", devPtr=va, size=self.size)
            raise
        self._va = va

    def close(self) -> None:
        if self._va is None:
            return
        api = _hip()
        self.tensor = None
        _device(api, self.device_index)
        api.call("hipDeviceSynchronize")
        api.call("hipMemUnmap", ptr=self._va, size=self.size)
        api.call("hipMemRelease", handle=self._handle)
        api.call("hipMemAddressFree", devPtr=self._va, size=self.size)
        self._va = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # __del__: nothing left to report to
            pass


class ExportBuffer(_MappedBuffer):
    """Sender side: ``nbytes`` of device memory (rounded up to the granularity) that can be
    exported as a POSIX fd; ``.tensor`` is a uint8 tensor over it."""

    def __init__(self, nbytes: int, device_index: int = 0):
        api = _hip()
        _device(api, device_index)
        gran = _granularity(api, device_index)
        self.device_index, self.nbytes = device_index, nbytes
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)
        h = c_void_p()
        api.call("hipMemCreate", handle=byref(h), size=self.size, prop=byref(_prop(api, device_index)), flags=0,
                 hint="an exportable IPC buffer")
        self._handle = int(h.value)
        try:
            self._map(api)
        except Exception:
            api.rc("hipMemRelease", handle=self._handle)
            raise
        self.tensor = _tensor(self._va, nbytes, device_index)

    def fd(self) -> int:
        """An fd for the allocation (exported once; SCM_RIGHTS duplicates it for the receiver)."""
        if self._fd < 0:
            api = _hip()
            _device(api, self.device_index)
            out = c_uint64(0)  # HIP writes an int; a pointer-sized slot takes either width
            api.call("hipMemExportToShareableHandle", shareableHandle=byref(out), handle=self._handle,
                     handleType=hip.hipMemHandleTypePosixFileDescriptor, flags=0)
            self._fd = int(out.value & 0xFFFFFFFF)
        return self._fd


class ImportedBuffer(_MappedBuffer):
    """Receiver side: import the fd, map it into a reserved range, grant access; the fd is closed
    once imported (the imported handle keeps the memory alive until ``close``)."""

    def __init__(self, fd: int, nbytes: int, device_index: int = 0):
        api = _hip()
        h = c_void_p()
        try:
            _device(api, device_index)
            gran = _granularity(api, device_index)
            api.call("hipMemImportFromShareableHandle", handle=byref(h), osHandle=fd,
                     shHandleType=hip.hipMemHandleTypePosixFileDescriptor)
        finally:
            os.close(fd)
        self._handle = int(h.value)
        self.device_index, self.nbytes = device_index, nbytes
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)
        try:
            self._map(api)
        except Exception:
            api.rc("hipMemRelease", handle=self._handle)
            raise
        self.tensor = _tensor(self._va, nbytes, device_index)


def synchronize(device_index: int = 0) -> None:
    """Wait for the device work of this process before the peer reads or reuses a buffer."""
    api = _hip()
    _device(api, device_index)
    api.call("hipDeviceSynchronize")
