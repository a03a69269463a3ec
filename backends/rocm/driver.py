"""The ROCm driver: HIP virtual memory through ctypes, with the known ROCm traps handled.

=====================  ============================================================================
reserve                ``hipMemAddressReserve(&p, size, granularity, 0, 0)``; on failure retry with
                       alignment 0 and check the address is aligned (vLLM PR #43022)
create                 ``hipMemCreate(&h, chunk, &prop, 0)`` — one handle per chunk of
                       ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` MB (the shared Region/chunk policy)
map                    ``hipMemMap(va + off, chunk, 0, h, 0)`` — HIP maps whole handles, offset 0
set_access             ``hipMemSetAccess`` once over the whole range, after every (re)map
unmap / release        ``hipMemUnmap`` per chunk, ``hipMemRelease``
sleep                  after releasing, ``hipMemAddressFree`` + re-reserve the *same* address under a
                       process-wide lock, verified: ROCr keeps VRAM while the VA stays reserved
                       (ROCm/ROCm#6021); a moved address is a fatal error
wake                   discarded memory is zeroed explicitly (``hipMemset`` + ``hipDeviceSynchronize``):
                       remapped VRAM may hold stale data (vLLM PR #44972) — fresh_memory_is_zero=False
handles                each handle holds one file descriptor (dmabuf): the soft ``RLIMIT_NOFILE`` is
                       raised when needed, or the allocation is refused with the fix (rocm-systems#10604)
devices                HIP/CUDA/ROCR visible-device variables that disagree are refused at start
=====================  ============================================================================

The C function table is injectable (``lib=``): tests pass the simulated library in
``tests/sim/fake_hip.py``.  No ROCm hardware run has been made with this driver.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
from ctypes import byref, c_int, c_size_t, c_void_p
from dataclasses import dataclass
from typing import Any, Optional

from unisleep.driver import BackupStore, Driver, SaveJob
from unisleep.errors import UnisleepError
from unisleep.platform import SPECS
from unisleep.region import Region

from . import config, hip
from .store import HipHostStore

log = logging.getLogger("unisleep.rocm")

#: serialises every reservation in the process, so nothing can take an address between the
#: free and the re-reserve of a sleeping region
VA_LOCK = threading.RLock()
FD_MARGIN = 64  # descriptors kept free for the rest of the process


class FileLimitError(UnisleepError):
    """Creating another HIP handle would exceed the open-file limit (one descriptor per handle)."""


class AddressMovedError(UnisleepError):
    """A sleeping region's address could not be re-reserved at the same place: tensors that
    point into it are invalid.  Fatal for that lifecycle."""


@dataclass(eq=False)
class HipHandle:
    ptr: int
    size: int
    released: bool = False


class RocmDriver(Driver):
    name = "rocm"
    fresh_memory_is_zero = False  # remapped VRAM may hold stale data: zero explicitly
    retain_backups = False
    supports_pool = False

    def __init__(
        self,
        device: int = 0,
        *,
        lib: Any = None,
        chunk_bytes: Optional[int] = None,
        tensor_device: Any = None,
        rereserve_on_sleep: bool = True,
        raise_file_limit: bool = True,
        env: Optional[dict] = None,
        **options: Any,
    ):
        super().__init__(device, **options)
        config.check_visible_devices(env)
        self.default_chunk_bytes = chunk_bytes if chunk_bytes is not None else config.chunk_bytes_from_env(env)
        self.rereserve_on_sleep = rereserve_on_sleep
        self.raise_file_limit = raise_file_limit
        self.simulated = bool(getattr(lib, "SIMULATED", False))
        self.api = hip.HipApi(lib if lib is not None else hip.load_library())
        self._tls = threading.local()
        self._set_device()
        self._prop = hip.hipMemAllocationProp()
        self._prop.type = hip.hipMemAllocationTypePinned
        self._prop.requestedHandleType = hip.hipMemHandleTypeNone
        self._prop.location.type = hip.hipMemLocationTypeDevice
        self._prop.location.id = device
        self._access = hip.hipMemAccessDesc()
        self._access.location.type = hip.hipMemLocationTypeDevice
        self._access.location.id = device
        self._access.flags = hip.hipMemAccessFlagsProtReadWrite
        g = c_size_t()
        self.api.call(
            "hipMemGetAllocationGranularity", byref(g), byref(self._prop), hip.hipMemAllocationGranularityMinimum
        )
        self._gran = int(g.value)
        if self._gran <= 0:
            raise UnisleepError(f"hipMemGetAllocationGranularity returned {self._gran}")
        self._live_handles = 0
        self._fd_ok_below = 0  # handle count under which the descriptor limit is known to be fine
        import torch

        self._tensor_device = torch.device(tensor_device) if tensor_device is not None else torch.device(
            SPECS["rocm"].torch_device_type, device
        )

    # ---- context ---------------------------------------------------------------------
    def _set_device(self) -> None:
        """HIP's current device is per thread: set it once in every thread that calls in."""
        if getattr(self._tls, "device", None) != self.device:
            self.api.call("hipSetDevice", self.device)
            self._tls.device = self.device

    # ---- primitives ------------------------------------------------------------------
    def granularity(self) -> int:
        return self._gran

    def _reserve_raw(self, size: int, alignment: int, hint: int) -> tuple[int, int]:
        p = c_void_p()
        rc = self.api.hipMemAddressReserve(byref(p), size, alignment, hint or None, 0)
        return rc, int(p.value or 0)

    def reserve(self, size: int) -> int:
        self._set_device()
        with VA_LOCK:
            rc, va = self._reserve_raw(size, self._gran, 0)
            if rc != hip.hipSuccess:
                # a non-zero alignment can fail with OOM although VRAM is free: retry with 0
                log.debug("hipMemAddressReserve(alignment=%d) failed (%d); retrying with alignment 0", self._gran, rc)
                rc, va = self._reserve_raw(size, 0, 0)
                if rc != hip.hipSuccess:
                    raise hip.HipError("hipMemAddressReserve", rc, f"reserving {size} bytes of address space")
                if va % self._gran:
                    self.api.call("hipMemAddressFree", va, size)
                    raise UnisleepError(
                        f"hipMemAddressReserve(alignment=0) returned {va:#x}, which is not aligned to the "
                        f"granularity {self._gran}; cannot map chunks there"
                    )
            return va

    def free_address(self, va: int, size: int) -> None:
        with VA_LOCK:
            self.api.call("hipMemAddressFree", va, size)

    def _ensure_fd_headroom(self) -> None:
        """One descriptor per handle: keep below the soft RLIMIT_NOFILE, raising it if allowed."""
        if self._live_handles < self._fd_ok_below:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = self._live_handles
        need = open_now + 1 + FD_MARGIN
        if soft != resource.RLIM_INFINITY and need > soft:
            unlimited = hard == resource.RLIM_INFINITY
            target = max(need * 2, soft * 2)
            if not unlimited:
                target = min(target, hard)
            if self.raise_file_limit and target >= need:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                log.info("raised the soft RLIMIT_NOFILE from %d to %d (one descriptor per HIP handle)", soft, target)
                soft = target
            else:
                chunk = self.default_chunk_bytes
                raise FileLimitError(
                    f"creating another HIP memory handle needs a file descriptor, and {open_now} of the "
                    f"{soft} allowed (RLIMIT_NOFILE, hard limit {hard}) are open. Each handle holds one "
                    f"descriptor, so raise the limit (`ulimit -n {max(need * 2, 65536)}`, or LimitNOFILE= / "
                    f"`docker run --ulimit nofile=65536:65536`), or use fewer, larger chunks: "
                    f"{config.CHUNK_ENV} is {chunk >> 20 if chunk else 'unset'} MB now. Nothing was allocated "
                    "beyond what this call had mapped."
                )
        # re-check after half of the descriptors known to be free are used
        spare = (1 << 30) if soft == resource.RLIM_INFINITY else max(0, soft - need) // 2
        self._fd_ok_below = self._live_handles + spare

    def create(self, size: int) -> HipHandle:
        self._set_device()
        self._ensure_fd_headroom()
        h = c_void_p()
        rc = self.api.hipMemCreate(byref(h), size, byref(self._prop), 0)
        if rc != hip.hipSuccess:
            hint = f"creating a {size >> 20} MiB chunk"
            if rc == hip.hipErrorOutOfMemory:
                hint += (
                    f" (out of memory: free VRAM first, or lower {config.CHUNK_ENV}; hipMemCreate also reports "
                    "OOM when the process runs out of file descriptors)"
                )
            raise hip.HipError("hipMemCreate", rc, hint)
        self._live_handles += 1
        return HipHandle(int(h.value), size)

    def map(self, va: int, size: int, handle: HipHandle) -> None:
        if size != handle.size:
            raise UnisleepError(f"HIP maps whole handles only (offset 0): chunk {size} != handle {handle.size}")
        self.api.call("hipMemMap", va, size, 0, handle.ptr, 0)

    def set_access(self, va: int, size: int) -> None:
        self.api.call("hipMemSetAccess", va, size, byref(self._access), 1)

    def unmap(self, va: int, size: int) -> None:
        self.api.call("hipMemUnmap", va, size)

    def release(self, handle: HipHandle) -> None:
        if not handle.released:
            self.api.call("hipMemRelease", handle.ptr)
            handle.released = True
            self._live_handles -= 1

    def physical_bytes(self, handle: HipHandle) -> int:
        # HIP has no per-handle residency query: a live handle holds its whole size.  Whether
        # the device really returned it is read with memory_info() (hipMemGetInfo).
        return 0 if handle.released else handle.size

    def view(self, va: int, nbytes: int):
        import torch

        storage = torch._C._construct_storage_from_data_pointer(va, self._tensor_device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=self._tensor_device).set_(storage)

    def zero(self, va: int, nbytes: int) -> None:
        self._set_device()
        self.api.call("hipMemset", va, 0, nbytes)
        self.synchronize()  # zeroing is an explicit, synchronised step

    def synchronize(self) -> None:
        self._set_device()
        self.api.call("hipDeviceSynchronize")

    def memory_info(self) -> tuple[int, int]:
        self._set_device()
        free, total = c_size_t(), c_size_t()
        self.api.call("hipMemGetInfo", byref(free), byref(total))
        return int(free.value), int(total.value)

    def device_count(self) -> int:
        n = c_int()
        self.api.call("hipGetDeviceCount", byref(n))
        return int(n.value)

    def new_backup_store(self, budget_bytes, spill_dir) -> BackupStore:
        return HipHostStore(self.api, budget_bytes)

    @property
    def torch_device(self):
        return self._tensor_device

    # ---- sleep: release, then give the address back and take it again ------------------
    def _rereserve(self, region: Region) -> None:
        with VA_LOCK:
            self.api.call("hipMemAddressFree", region.va, region.size, hint="freeing a sleeping region's address")
            rc, got = self._reserve_raw(region.size, 0, region.va)
            if rc != hip.hipSuccess or got != region.va:
                if rc == hip.hipSuccess and got:
                    self.api.hipMemAddressFree(got, region.size)
                raise AddressMovedError(
                    f"re-reserving {region.size} bytes at {region.va:#x} after sleep "
                    + (f"returned {got:#x}" if rc == hip.hipSuccess else f"failed with {hip.ERROR_NAMES.get(rc, rc)}")
                    + ": another allocation took the address. Tensors in this region are invalid; close this "
                    "MemoryLifecycle and create a new one."
                )

    def suspend(self, saves: list[SaveJob], discards: list[Region], store: BackupStore) -> tuple[int, int]:
        released, copied = super().suspend(saves, discards, store)
        if self.rereserve_on_sleep:
            for region in [j.region for j in saves] + list(discards):
                if not any(c.handle is not None for c in region.chunks):
                    self._rereserve(region)
        return released, copied
