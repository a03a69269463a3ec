"""NVIDIA colocated IPC for weight transfer: bucket memory that another process on the same GPU
can map, built on the driver's virtual-memory calls (``cuda.bindings.driver``, imported lazily).

Why not ``cudaIpcGetMemHandle`` (what ``torch.multiprocessing`` uses): it rejects memory made with
``cuMemCreate`` — which is what a lifecycle pool hands out — and it shares a whole caching-allocator
block.  Here the sender creates its send buffers itself with
``requestedHandleTypes = POSIX_FILE_DESCRIPTOR``, exports a file descriptor
(``cuMemExportToShareableHandle``), and the receiver imports it
(``cuMemImportFromShareableHandle``), reserves an address range, ``cuMemMap``s the allocation and
grants itself access (``cuMemSetAccess``).  The descriptor travels over a Unix socket with
SCM_RIGHTS (unisleep.transfer does that part; it is the same on every platform).

Every driver call runs with the device's primary context current (``cuDevicePrimaryCtxRetain`` +
``cuCtxSetCurrent``) — the context the CUDA runtime and therefore torch use — and never a context
of its own.
"""

from __future__ import annotations

import os
import threading

KIND = "cuMem POSIX fd"

_lock = threading.Lock()
_ctx: dict[int, object] = {}  # device ordinal -> retained primary context (kept for the process)


def _cu():
    from cuda.bindings import driver as cu  # lazy: importing this module must not need a GPU

    return cu


def _check(result, what: str):
    cu = _cu()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        try:
            _, name = cu.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else name
        except Exception:  # naming the error must not replace it: its number is shown
            name = str(err)
        raise RuntimeError(f"{what} failed: {name} ({int(err)})")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else rest


def _device(device_index: int):
    """Make the primary context of ``device_index`` current on this thread; return the CUdevice."""
    cu = _cu()
    with _lock:
        if not _ctx:
            _check(cu.cuInit(0), "cuInit")
        dev = _check(cu.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
        ctx = _ctx.get(device_index)
        if ctx is None:
            ctx = _ctx[device_index] = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev


def _prop(device_index: int):
    cu = _cu()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _granularity(device_index: int) -> int:
    cu = _cu()
    return int(_check(cu.cuMemGetAllocationGranularity(
        _prop(device_index), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))


class _DeviceBytes:
    """A raw device range as something ``torch.as_tensor`` understands (no ownership)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _tensor(ptr: int, nbytes: int, device_index: int):
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device_index}")
    t = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=f"cuda:{device_index}")
    assert t.data_ptr() == ptr and t.dtype == torch.uint8
    return t


def _map(handle, size: int, device_index: int, gran: int) -> int:
    cu = _cu()
    va = _check(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve")
    try:
        _check(cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
    except Exception:
        cu.cuMemAddressFree(va, size)
        raise
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = device_index
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    try:
        _check(cu.cuMemSetAccess(va, size, [acc], 1), "cuMemSetAccess")
    except Exception:
        cu.cuMemUnmap(va, size)
        cu.cuMemAddressFree(va, size)
        raise
    return int(va)


def _unmap(va: int, size: int, handle) -> None:
    cu = _cu()
    cu.cuMemUnmap(va, size)
    cu.cuMemRelease(handle)
    cu.cuMemAddressFree(va, size)


class _MappedBuffer:
    """Device memory mapped at ``_va`` (``size`` bytes, handle ``_handle``) with ``.tensor`` over it."""

    _fd = -1

    def close(self) -> None:
        if getattr(self, "_va", None) is None:
            return
        self.tensor = None
        _device(self.device_index)
        import torch

        torch.cuda.synchronize(self.device_index)
        _unmap(self._va, self.size, self._handle)
        self._va = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # a finalizer must not raise (the interpreter may be shutting down)
            pass


class ExportBuffer(_MappedBuffer):
    """Sender side: ``nbytes`` of device memory (rounded up to the granularity) that can be
    exported as a POSIX fd; ``.tensor`` is a uint8 tensor over it."""

    def __init__(self, nbytes: int, device_index: int = 0):
        cu = _cu()
        _device(device_index)
        gran = _granularity(device_index)
        self.device_index = device_index
        self.nbytes = nbytes
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)
        self._handle = _check(cu.cuMemCreate(self.size, _prop(device_index), 0), "cuMemCreate (exportable)")
        try:
            self._va = _map(self._handle, self.size, device_index, gran)
        except Exception:
            cu.cuMemRelease(self._handle)
            raise
        self._fd = -1
        self.tensor = _tensor(self._va, nbytes, device_index)

    def fd(self) -> int:
        """An fd for the allocation (exported once; SCM_RIGHTS duplicates it for the receiver)."""
        if self._fd < 0:
            cu = _cu()
            _device(self.device_index)
            h = _check(cu.cuMemExportToShareableHandle(
                self._handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "cuMemExportToShareableHandle")
            self._fd = int(h)
        return self._fd

class ImportedBuffer(_MappedBuffer):
    """Receiver side: import the fd, map it into a reserved range, grant access; the fd is closed
    once imported (the imported handle keeps the memory alive until ``close``)."""

    def __init__(self, fd: int, nbytes: int, device_index: int = 0):
        cu = _cu()
        try:
            _device(device_index)
            gran = _granularity(device_index)
            self._handle = _check(cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        self.device_index = device_index
        self.nbytes = nbytes
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)
        try:
            self._va = _map(self._handle, self.size, device_index, gran)
        except Exception:
            cu.cuMemRelease(self._handle)
            raise
        self.tensor = _tensor(self._va, nbytes, device_index)


def synchronize(device_index: int = 0) -> None:
    """Wait for the device work of this process (packing / copying out) before the peer reads
    or reuses the buffer."""
    import torch

    torch.cuda.synchronize(device_index)
