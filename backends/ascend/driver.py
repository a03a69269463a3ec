"""The Ascend driver: ACL virtual memory through ctypes ``libascendcl.so``.

=====================  ============================================================================
granularity            ``aclrtMemGetAllocationGranularity(&prop, MINIMUM, &g)`` (2 MiB, ACL_HBM_MEM_HUGE)
reserve                ``aclrtReserveMemAddress(&p, size, 0, NULL, 0)`` (alignment must be 0)
create                 ``aclrtMallocPhysical(&h, size, &prop, 0)``
map                    ``aclrtMapMem(va, size, 0, h, 0)`` — size equals the physical size; access is
                       granted by the mapping (no SetAccess step)
unmap                  ``aclrtUnmapMem(va)`` — no size
release                ``aclrtFreePhysical(h)`` (after unmapping)
free address           ``aclrtReleaseMemAddress(va)``
copies                 ``aclrtMemcpy(dst, destMax, src, count, kind)`` into ``aclrtMallocHost`` buffers
zero                   ``aclrtMemset`` + ``aclrtSynchronizeDevice`` (fresh memory is not assumed zero)
pool(tag)              torch_npu pluggable allocator + ``MemPool`` (backends/ascend/pool.py); expandable
                       segments switched off inside the pool
view                   ``torch_npu._C._construct_storage_from_data_pointer`` (an ``NPUStorageImpl``)
=====================  ============================================================================

The C function table is injectable (``lib=``); tests use the simulated ACL library in
tests/sim/fake_acl.py.  No Ascend hardware run has been made with this driver.
"""

from __future__ import annotations

import contextlib
import logging
from ctypes import byref, c_int32, c_size_t, c_void_p
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from unisleep.backends._native import Reservations
from unisleep.backup import BackupStore
from unisleep.driver import Capabilities, Driver
from unisleep.errors import PlatformError, UnisleepError

from . import acl
from .store import AclHostStore

log = logging.getLogger("unisleep.ascend")


def bind_device(api: acl.AclApi, device: int) -> None:
    """Make ``device`` current on the calling thread unless ACL says it already is (a thread
    without a context answers ``ACL_ERROR_RT_CONTEXT_NULL``)."""
    cur = c_int32(-1)
    if api.rc("aclrtGetDevice", deviceId=byref(cur)) != acl.ACL_SUCCESS or cur.value != device:
        api.call("aclrtSetDevice", deviceId=device)


def tensor_over(va: int, nbytes: int, dev):
    """A uint8 tensor over ``[va, va + nbytes)`` on torch device ``dev`` (see
    :meth:`AscendDriver.view` for why an NPU storage is made by torch_npu)."""
    import torch

    if dev.type == "cpu":  # the simulated library's host memory
        storage = torch._C._construct_storage_from_data_pointer(va, dev, nbytes)
    else:
        import torch_npu

        construct = getattr(torch_npu._C, "_construct_storage_from_data_pointer", None)
        if construct is None:
            raise PlatformError(
                f"torch_npu {getattr(torch_npu, '__version__', '?')} has no "
                "torch_npu._C._construct_storage_from_data_pointer, so no NPU tensor can be made over "
                "lifecycle memory; use torch_npu 2.10 or later (the version vllm-ascend pins)")
        storage = construct(va, dev, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)


@dataclass(eq=False)
class AclHandle:
    ptr: int
    size: int
    freed: bool = False


class AscendDriver(Driver):
    name = "ascend"
    #: fresh memory is not documented as zeroed by CANN: discarded memory is zeroed explicitly.
    #: One physical handle per region (the map size equals the physical size): no chunk size
    capabilities = Capabilities(supports_pool=True)

    def __init__(
        self,
        device: int = 0,
        *,
        lib: Any = None,
        tensor_device: Any = None,
        chunk_bytes: Optional[int] = None,
        mem_attr: int = acl.ACL_HBM_MEM_HUGE,
        **options: Any,
    ):
        super().__init__(device, **options)
        if chunk_bytes is not None:
            self.configure(chunk_bytes=chunk_bytes)
        self.simulated = bool(getattr(lib, "SIMULATED", False))
        self.api = acl.AclApi(lib if lib is not None else acl.load_library())
        self.reservations = Reservations()  # this driver's address ranges (device memory)
        self._set_device()
        self._prop = acl.aclrtPhysicalMemProp()
        self._prop.handleType = acl.ACL_MEM_HANDLE_TYPE_NONE
        self._prop.allocationType = acl.ACL_MEM_ALLOCATION_TYPE_PINNED
        self._prop.memAttr = mem_attr
        self._prop.location.id = device
        self._prop.location.type = acl.ACL_MEM_LOCATION_TYPE_DEVICE
        self._prop.reserve = 0
        g = c_size_t()
        # (prop, option, &granularity): the output comes last, unlike CUDA/HIP
        self.api.call("aclrtMemGetAllocationGranularity", prop=byref(self._prop),
                      option=acl.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, granularity=byref(g))
        self._gran = int(g.value)
        if self._gran <= 0:
            raise UnisleepError(f"aclrtMemGetAllocationGranularity returned {self._gran}")
        import torch

        if tensor_device is None:
            self._tensor_device = None  # resolved lazily: "npu" exists only once torch_npu is imported
        else:
            self._tensor_device = torch.device(tensor_device)

    # ---- context ---------------------------------------------------------------------
    def _set_device(self) -> None:
        """Bind the device's default context to the calling thread (``aclrtSetDevice``), at
        every entry point, as vllm-ascend's allocator calls ``ensure_context`` at each of its
        (``csrc/camem_allocator.cpp``): ACL contexts are per thread, and unisleep is called from
        the sleeping thread, progressive-wake workers, the release thread and torch_npu's
        allocator.  The thread's current device is asked of ACL first (``aclrtGetDevice``), so a
        device set on the thread behind unisleep's back (``torch.npu.set_device``, another
        driver) is seen, and ``aclrtSetDevice``'s reference count is not counted up at every call."""
        bind_device(self.api, self.device)

    def prepare_thread(self) -> None:
        self._set_device()

    # ---- primitives ------------------------------------------------------------------
    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        self._set_device()
        p = c_void_p()
        # alignment must be 0; expectPtr NULL (a user address is experimental in CANN 9 only)
        self.api.call("aclrtReserveMemAddress", virPtr=byref(p), size=size, alignment=0, expectPtr=None, flags=0,
                      hint=f"reserving {size} bytes")
        self.reservations.add(int(p.value), size)
        return int(p.value)

    def free_address(self, va: int, size: int) -> None:
        self._set_device()
        self.api.call("aclrtReleaseMemAddress", virPtr=va)
        self.reservations.remove(va)

    def create(self, size: int) -> AclHandle:
        self._set_device()
        h = c_void_p()
        self.api.call("aclrtMallocPhysical", handle=byref(h), size=size, prop=byref(self._prop), flags=0,
                      hint=f"{size >> 20} MiB of device memory")
        return AclHandle(int(h.value), size)

    def map(self, va: int, size: int, handle: AclHandle) -> None:
        self._set_device()
        if size != handle.size:
            raise UnisleepError(f"aclrtMapMem maps whole physical allocations: {size} != {handle.size}")
        self.api.call("aclrtMapMem", virPtr=va, size=size, offset=0, handle=handle.ptr, flags=0)

    def unmap(self, va: int, size: int) -> None:
        self._set_device()
        self.api.call("aclrtUnmapMem", virPtr=va)  # no size argument

    def release(self, handle: AclHandle) -> None:
        self._set_device()
        if not handle.freed:
            self.api.call("aclrtFreePhysical", handle=handle.ptr)
            handle.freed = True

    def physical_bytes(self, handle: AclHandle) -> int:
        # ACL has no per-handle residency query; device totals come from memory_info()
        return 0 if handle.freed else handle.size

    @property
    def torch_device(self):
        if self._tensor_device is None:
            import torch
            import torch_npu  # noqa: F401  (registers the "npu" device type)

            from .descriptor import BACKEND

            self._tensor_device = torch.device(BACKEND.torch_device, self.device)
        return self._tensor_device

    def view(self, va: int, nbytes: int, owner=None):
        """A uint8 tensor over ``[va, va + nbytes)``.  On an NPU its storage is made by torch_npu's
        own ``torch_npu._C._construct_storage_from_data_pointer`` (an ``NPUStorageImpl``, whose
        ``npu_desc_`` torch_npu's ``set_`` reads and writes): torch's constructor would make a
        plain ``StorageImpl``, which torch_npu casts to ``NPUStorageImpl`` out of bounds or
        refuses.  ``owner`` cannot be attached to a storage made from a raw pointer: the
        lifecycle keeps it on the returned tensor instead (weaker: views of it do not hold it)."""
        return tensor_over(va, nbytes, self.torch_device)

    def zero(self, va: int, nbytes: int) -> None:
        self._set_device()
        self.api.call("aclrtMemset", devPtr=va, maxCount=nbytes, value=0, count=nbytes)
        self.synchronize()

    def synchronize(self) -> None:
        self._set_device()
        self.api.call("aclrtSynchronizeDevice")

    def memory_info(self) -> tuple[int, int]:
        self._set_device()
        free, total = c_size_t(), c_size_t()
        self.api.call("aclrtGetMemInfo", attr=acl.ACL_HBM_MEM, free=byref(free), total=byref(total))
        return int(free.value), int(total.value)

    def new_file_store(self, budget_bytes, spill_dir, layout: str = "private") -> BackupStore:
        """Spill files under ``spill_dir``, written and read through a host staging buffer."""
        from unisleep.backends.host.staged_spill import StagedSpillStore

        return StagedSpillStore(budget_bytes, spill_dir, layout=layout)

    def new_backup_store(self, budget_bytes, spill_dir) -> BackupStore:
        return AclHostStore(self.api, budget_bytes, is_device=self.reservations.covers, bind=self._set_device)

    @contextlib.contextmanager
    def pool(self, lifecycle, tag: str) -> Iterator[None]:
        """Route torch_npu allocations made inside the block into ``tag`` (torch_npu only;
        written against torch_npu's pluggable-allocator API, not run here)."""
        from .pool import npu_mem_pool

        with npu_mem_pool(self, lifecycle, tag):
            yield
