"""The ROCm driver: HIP virtual memory through ctypes, with the known ROCm traps handled.

=====================  ============================================================================
reserve                ``hipMemAddressReserve(&p, size, granularity, 0, 0)``; on failure retry with
                       alignment 0 and check the address is aligned (vLLM PR #43022)
create                 ``hipMemCreate(&h, chunk, &prop, 0)`` — one handle per chunk of
                       ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` MB (the shared Region/chunk policy)
map                    ``hipMemMap(va + off, chunk, 0, h, 0)`` — HIP maps whole handles, offset 0
set_access             ``hipMemSetAccess`` once over the whole range, after every (re)map; a chunk
                       mapped by itself (progressive wake) is granted at its own start before HIP
                       7.2, and from the reservation's start over every chunk up to it from 7.2 on
                       (ROCm 7.2 rejects a non-zero offset: rocm-systems PR #9360), the chunks
                       before it mapped first; several progressive workers are refused there
unmap / release        ``hipMemUnmap`` per chunk, ``hipMemRelease``
sleep                  after releasing, ``hipMemAddressFree`` + re-reserve the *same* address under a
                       process-wide lock, verified: ROCr keeps VRAM while the VA stays reserved
                       (ROCm/ROCm#6021).  Before the first such step, a probe range checks that the
                       runtime re-reserves a freed address in place; if not, the driver never frees
                       a region's address: it keeps the reservation (memory not returned, shown in
                       ``last_sleep_kept``, the sleep's ``bytes_released`` and ``unisleep doctor``)
wake                   discarded memory is zeroed explicitly (``hipMemset`` + ``hipDeviceSynchronize``):
                       remapped VRAM may hold stale data (vLLM PR #44972) — fresh_memory_is_zero=False.
                       Zeros go only where the wake restores nothing: a region restored in part
                       from its backup is zeroed in the gaps only, after every chunk is mapped and
                       granted.  vLLM PR #52478 removed its allocator-wide wake memset after
                       intermittent MI300 faults at it and zeroes only the state views read before
                       written; unisleep cannot see which bytes an engine reads first and its
                       contract promises zeros in a discarded tag, so a wholly discarded region is
                       still zeroed (one ``hipMemset`` per mapped chunk; that this avoids the MI300
                       fault is not shown)
handles                each handle holds one file descriptor (dmabuf): the soft ``RLIMIT_NOFILE`` is
                       raised when needed, or the allocation is refused with the fix (rocm-systems#10604)
devices                HIP/CUDA/ROCR visible-device variables that disagree are refused at start; no
                       GPU (``hipGetDeviceCount`` -> hipErrorNoDevice) is ``HipNoDeviceError``
pool                   torch's own allocations routed into a tag through the CUDA backend's pool code
                       (``backends/_pool.py``), with a ROCm build of torch; not over the simulator
=====================  ============================================================================

The C function table is injectable (``lib=``): tests pass the simulated library in
``tests/sim/fake_hip.py``.  No ROCm hardware run has been made with this driver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
from ctypes import byref, c_int, c_size_t, c_void_p
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

from unisleep.backends._native import Reservations, record_fallback
from unisleep.backends._capture import CaptureSpec
from unisleep.backup import BackupStore
from unisleep.driver import Capabilities, Driver, SaveJob
from unisleep.errors import UnisleepError
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
    #: remapped VRAM may hold stale data (zeroed explicitly); ``supports_pool`` is decided per
    #: driver: True with a ROCm build of torch on a real HIP library
    capabilities = Capabilities()
    #: torch's caching allocator asks HIP for segments through these two imports (NOT RUN on ROCm
    #: hardware: the rewrite is the code path run on CUDA and on the host)
    capture_spec = CaptureSpec("libc10_hip", "hipMalloc", "hipFree", "device", "libamdhip64")

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
        self.configure(chunk_bytes=chunk_bytes if chunk_bytes is not None else config.chunk_bytes_from_env(env))
        self.rereserve_on_sleep = rereserve_on_sleep
        #: why sleep keeps address reservations (device memory not returned), or None while the
        #: free-and-re-reserve step is in use
        self.kept_reason: Optional[str] = None
        self._probed = False
        self._lost: list[tuple[int, int]] = []  # address ranges given up and taken by someone else
        self._last_kept: Optional[dict] = None  # last_sleep_kept
        self.raise_file_limit = raise_file_limit
        self.simulated = bool(getattr(lib, "SIMULATED", False))
        self.api = hip.HipApi(lib if lib is not None else hip.load_library())
        self.reservations = Reservations()  # this driver's address ranges (device memory)
        self._mapped: dict[int, int] = {}  # va -> size of every mapped chunk
        self._maps_lock = threading.Lock()
        self._check_device()
        self._set_device()
        self._prop = self.api.Prop()
        self._prop.type = hip.hipMemAllocationTypePinned
        self._prop.requestedHandleType = hip.hipMemHandleTypeNone
        self._prop.location.type = hip.hipMemLocationTypeDevice
        self._prop.location.id = device
        self._access = hip.hipMemAccessDesc()
        self._access.location.type = hip.hipMemLocationTypeDevice
        self._access.location.id = device
        self._access.flags = hip.hipMemAccessFlagsProtReadWrite
        g = c_size_t()
        self.api.call("hipMemGetAllocationGranularity", granularity=byref(g), prop=byref(self._prop),
                      option=hip.hipMemAllocationGranularityMinimum)
        self._gran = int(g.value)
        if self._gran <= 0:
            raise UnisleepError(f"hipMemGetAllocationGranularity returned {self._gran}")
        self._live_handles = 0
        self._fd_ok_below = 0  # handle count under which the descriptor limit is known to be fine
        import torch

        from .descriptor import BACKEND

        self._tensor_device = torch.device(tensor_device) if tensor_device is not None else torch.device(
            BACKEND.torch_device, device
        )
        from .pool import pool_problem

        self._pool_problem = pool_problem(self)
        self.capabilities = replace(self.capabilities, supports_pool=self._pool_problem is None)
        self._pools = None  # made by pool()

    # ---- context ---------------------------------------------------------------------
    def _check_device(self) -> None:
        """A missing GPU is a named error that says what is missing, not a bare HIP code."""
        n = c_int(0)
        rc = self.api.rc("hipGetDeviceCount", count=byref(n))
        where = f"the HIP runtime {self.api.path} (HIP {hip.version_text(self.api.runtime_version)})"
        if rc == hip.hipErrorNoDevice or (rc == hip.hipSuccess and n.value == 0):
            kfd = "present" if os.path.exists("/dev/kfd") else "missing"
            raise hip.HipNoDeviceError(
                f"{where} sees no AMD GPU (hipGetDeviceCount returned {hip.ERROR_NAMES[hip.hipErrorNoDevice]}; "
                f"/dev/kfd is {kfd}): {hip.NO_GPU_HELP}"
            )
        if rc != hip.hipSuccess:
            raise hip.HipError("hipGetDeviceCount", rc, f"{where} cannot list its GPUs")
        if not 0 <= self.device < n.value:
            raise hip.HipNoDeviceError(
                f"device {self.device} was asked for, but {where} sees {n.value} AMD GPU(s) "
                f"(indices 0..{n.value - 1}; HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES narrow the list)"
            )

    def _set_device(self) -> None:
        """Make this driver's device the calling thread's current one, at every entry point:
        HIP's current device is per thread (device 0 on a thread that never set one), CLR
        allocates ``hipMemCreate`` memory on it and checks copies against it
        (``hip_memory.cpp``), and another driver or torch may have changed it since this
        driver last looked.  Leaves it set, as vLLM's allocator does."""
        cur = c_int(-1)
        if self.api.rc("hipGetDevice", deviceId=byref(cur)) != hip.hipSuccess or cur.value != self.device:
            self.api.call("hipSetDevice", deviceId=self.device)

    def prepare_thread(self) -> None:
        self._set_device()

    # ---- primitives ------------------------------------------------------------------
    def granularity(self) -> int:
        return self._gran

    def _reserve_raw(self, size: int, alignment: int, hint: int) -> tuple[int, int]:
        p = c_void_p()
        rc = self.api.rc("hipMemAddressReserve", ptr=byref(p), size=size, alignment=alignment, addr=hint or None, flags=0)
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
                    self.api.call("hipMemAddressFree", devPtr=va, size=size)
                    raise UnisleepError(
                        f"hipMemAddressReserve(alignment=0) returned {va:#x}, which is not aligned to the "
                        f"granularity {self._gran}; cannot map chunks there"
                    )
            self.reservations.add(va, size)
            return va

    def free_address(self, va: int, size: int) -> None:
        """Give an address range back; a range given up after it moved (``AddressMovedError``)
        is not this driver's any more and is never freed: HIP (6.2-era ROCr) dereferences a null
        pointer when asked to free a range it does not hold."""
        self._set_device()
        with VA_LOCK:
            if any(lo == va for lo, _ in self._lost):
                log.debug("not freeing %#x+%d: given up after it moved", va, size)
                return
            self.api.call("hipMemAddressFree", devPtr=va, size=size)
            self.reservations.remove(va)

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
                chunk = self.config.chunk_bytes
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
        rc = self.api.rc("hipMemCreate", handle=byref(h), size=size, prop=byref(self._prop), flags=0)
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
        self._set_device()
        for lo, n in self._lost:
            if lo <= va < lo + n:
                raise AddressMovedError(
                    f"the address range {lo:#x}+{n} was given up during a sleep and another allocation took it; "
                    "mapping there would write into someone else's memory. Close this MemoryLifecycle."
                )
        if size != handle.size:
            raise UnisleepError(f"HIP maps whole handles only (offset 0): chunk {size} != handle {handle.size}")
        self.api.call("hipMemMap", ptr=va, size=size, offset=0, handle=handle.ptr, flags=0)
        with self._maps_lock:
            self._mapped[va] = size

    def set_access(self, va: int, size: int) -> None:
        self._set_device()
        self.api.call("hipMemSetAccess", ptr=va, size=size, desc=byref(self._access), count=1)

    @property
    def access_from_base(self) -> bool:
        """Whether this HIP grants access only from the start of a reservation: ROCm 7.2 rejects
        ``hipMemSetAccess`` at a non-zero offset (rocm-systems PR #9360 / SWDEV-568260, fixed
        on develop only), as vLLM's and torch_memory_saver's single whole-range call avoid."""
        return self.api.runtime_version >= hip.ACCESS_FROM_BASE_SINCE

    def grant_chunk(self, region: Region, chunk) -> None:
        """A chunk mapped by itself: before HIP 7.2 its own range (ROCr 6.x wants the range to
        start at a mapped handle); from 7.2, the chunks before it are mapped (no access yet) and
        one ``hipMemSetAccess`` covers the region from its start through this chunk."""
        if chunk.offset == 0 or not self.access_from_base:
            self.set_access(region.va + chunk.offset, chunk.size)
            return
        for c in region.chunks:
            if c.offset >= chunk.offset:
                break
            region.map_chunk(self, c, access=False)
        self.set_access(region.va, chunk.offset + chunk.size)

    def configure(self, **knobs: Any):
        workers = knobs.get("progressive_workers")
        if (workers is not None and isinstance(workers, int) and workers > 1 and getattr(self, "api", None) is not None
                and self.access_from_base):
            from unisleep.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"progressive_workers={workers} on HIP {hip.version_text(self.api.runtime_version)}: this ROCm grants "
                "memory access only from the start of a reservation (ROCm 7.2 rejects hipMemSetAccess at a non-zero "
                "offset, rocm-systems PR #9360), so a chunk is granted together with every chunk before it, which "
                "one worker at a time can do; use progressive_workers=1 (the default). Nothing was changed")
        return super().configure(**knobs)

    def unmap(self, va: int, size: int) -> None:
        self._set_device()
        self.api.call("hipMemUnmap", ptr=va, size=size)
        with self._maps_lock:
            self._mapped.pop(va, None)

    def release(self, handle: HipHandle) -> None:
        self._set_device()
        if not handle.released:
            self.api.call("hipMemRelease", handle=handle.ptr)
            handle.released = True
            self._live_handles -= 1

    def physical_bytes(self, handle: HipHandle) -> int:
        # HIP has no per-handle residency query: a live handle holds its whole size.  Whether
        # the device really returned it is read with memory_info() (hipMemGetInfo).
        return 0 if handle.released else handle.size

    def view(self, va: int, nbytes: int, owner=None):
        # ``owner`` cannot be attached to a storage made from a raw pointer: the lifecycle
        # keeps it on the returned tensor instead (weaker: views of it do not hold it)
        import torch

        storage = torch._C._construct_storage_from_data_pointer(va, self._tensor_device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=self._tensor_device).set_(storage)

    def _mapping_pieces(self, va: int, nbytes: int) -> list[tuple[int, int]]:
        """``[va, va + nbytes)`` cut at the boundaries of this driver's mappings (one piece per
        mapped chunk it touches); a part outside every mapping is one piece of its own, so the
        runtime reports it instead of this driver hiding it."""
        with self._maps_lock:
            maps = sorted(self._mapped.items())
        out, pos, end = [], va, va + nbytes
        for m_va, m_size in maps:
            if m_va + m_size <= pos or m_va >= end:
                continue
            if m_va > pos:
                out.append((pos, m_va - pos))
                pos = m_va
            hi = min(end, m_va + m_size)
            out.append((pos, hi - pos))
            pos = hi
        if pos < end:
            out.append((pos, end - pos))
        return out

    def zero(self, va: int, nbytes: int) -> None:
        """Zero ``[va, va + nbytes)`` with one ``hipMemset`` per mapped chunk it covers (vLLM PR
        #52478 saw intermittent MI300 faults at one allocation-wide ``hipMemset`` right after a
        wake; whether per-chunk calls avoid them is not known).  Synchronised: zeroing is an
        explicit step."""
        self._set_device()
        for lo, n in self._mapping_pieces(va, nbytes):
            self.api.call("hipMemset", dst=lo, value=0, sizeBytes=n)
        self.synchronize()

    def synchronize(self) -> None:
        self._set_device()
        self.api.call("hipDeviceSynchronize")

    def queue_restore(self, job, store: BackupStore) -> int:
        """Map ``job``'s region again, zero only the bytes its backup does not cover (the copies
        overwrite the rest: zeroing them too would write the region twice), and queue the
        copies of its saved ranges; returns the bytes queued."""
        job.region.map(self)
        if self.fills_zeros(job):
            pos = 0
            for off, n in sorted(job.ranges) + [(job.region.size, 0)]:
                if off > pos:
                    self.zero(job.region.va + pos, off - pos)
                pos = max(pos, off + n)
        for off, n in job.ranges:
            store.load((job.key, off), self.view(job.region.va + off, n))
        return sum(n for _, n in job.ranges)

    def memory_info(self) -> tuple[int, int]:
        self._set_device()
        free, total = c_size_t(), c_size_t()
        self.api.call("hipMemGetInfo", free=byref(free), total=byref(total))
        return int(free.value), int(total.value)

    def device_count(self) -> int:
        n = c_int()
        self.api.call("hipGetDeviceCount", count=byref(n))
        return int(n.value)

    def new_file_store(self, budget_bytes, spill_dir, layout: str = "private") -> BackupStore:
        """Spill files under ``spill_dir``, written and read through a host staging buffer."""
        from unisleep.backends.host.staged_spill import StagedSpillStore

        return StagedSpillStore(budget_bytes, spill_dir, layout=layout)

    def new_backup_store(self, budget_bytes, spill_dir) -> BackupStore:
        return HipHostStore(self.api, budget_bytes, is_device=self.reservations.covers, bind=self._set_device)

    # ---- framework allocations ---------------------------------------------------------
    def pool_problem(self) -> Optional[str]:
        return self._pool_problem

    def _router(self):
        if self._pool_problem is not None:
            from unisleep.errors import UnsupportedError

            raise UnsupportedError(f"pool() on ROCm: {self._pool_problem}")
        if self._pools is None:
            from .pool import PoolRouter

            self._pools = PoolRouter(self)
        return self._pools

    @contextlib.contextmanager
    def pool(self, lifecycle, tag: str) -> Iterator[None]:
        """Route torch's own allocations made inside the block into ``tag`` (see ``pool.py``)."""
        with self._router().route(lifecycle, tag):
            yield

    def mempool(self, lifecycle, tag: str, detach: bool = False):
        """The torch ``MemPool`` behind :meth:`pool` for (lifecycle, tag); ``detach``: handed to
        the caller and forgotten (``PoolRouter.detach``)."""
        router = self._router()
        return router.detach(lifecycle, tag) if detach else router.mempool(lifecycle, tag).pool

    def graph_pool(self, lifecycle, tag: str = "cudagraph"):
        """A memory-pool handle for a graph capture (``torch.cuda.graph(..., pool=...)``) whose
        memory lives in ``tag``."""
        return self._router().mempool(lifecycle, tag).id

    def close(self) -> None:
        if self._pools is not None:
            self._pools.close()
            self._pools = None

    @property
    def torch_device(self):
        return self._tensor_device

    # ---- sleep: release, then give the address back and take it again ------------------
    def _keep_reservations(self, reason: str) -> None:
        self.kept_reason = reason
        msg = (f"ROCm sleep keeps device memory: {reason}. Sleeping regions keep their address reservation, "
               "so this ROCm (ROCm/ROCm#6021) holds their VRAM until the lifecycle is closed; the sleep's "
               "bytes_released counts only what was returned. A ROCm release with the fix "
               "(rocm-systems PR #4363) returns it.")
        log.warning("%s", msg)
        record_fallback(msg)

    def _probe_rereserve(self) -> None:
        """Before any region's address is given up: does this runtime re-reserve a freed address
        in place?  Checked on a throw-away range of one granule, under VA_LOCK."""
        self._probed = True
        with VA_LOCK:
            rc, va = self._reserve_raw(self._gran, 0, 0)
            if rc != hip.hipSuccess:
                self._keep_reservations(f"the re-reserve probe could not reserve {self._gran} bytes "
                                        f"({hip.ERROR_NAMES.get(rc, rc)})")
                return
            self.api.call("hipMemAddressFree", devPtr=va, size=self._gran)
            rc, got = self._reserve_raw(self._gran, 0, va)
            if rc == hip.hipSuccess and got:
                self.api.call("hipMemAddressFree", devPtr=got, size=self._gran)
            if rc != hip.hipSuccess or got != va:
                self._keep_reservations(
                    f"hipMemAddressReserve with the freed address {va:#x} as hint "
                    + (f"returned {got:#x}" if rc == hip.hipSuccess else f"failed ({hip.ERROR_NAMES.get(rc, rc)})")
                    + ", so a freed region could not be taken back in place")

    def _rereserve(self, region: Region) -> None:
        with VA_LOCK:
            self.api.call("hipMemAddressFree", devPtr=region.va, size=region.size, hint="freeing a sleeping region's address")
            rc, got = self._reserve_raw(region.size, 0, region.va)
            if rc != hip.hipSuccess or got != region.va:
                if rc == hip.hipSuccess and got:
                    self.api.rc("hipMemAddressFree", devPtr=got, size=region.size)  # never go on with a moved range
                self._lost.append((region.va, region.size))
                self.reservations.remove(region.va)
                what = f"returned {got:#x}" if rc == hip.hipSuccess else f"failed with {hip.ERROR_NAMES.get(rc, rc)}"
                self._keep_reservations(f"re-reserving {region.size} bytes at {region.va:#x} {what}")
                raise AddressMovedError(
                    f"re-reserving {region.size} bytes at {region.va:#x} after sleep {what}: another allocation "
                    "took the address between the free and the re-reserve. Tensors in this region are invalid; "
                    "close this MemoryLifecycle and create a new one. Later sleeps of this driver keep their "
                    "reservations instead (see last_sleep_kept)."
                )

    @property
    def last_sleep_kept(self) -> Optional[dict]:
        """The last sleep's memory kept held by a kept reservation (``{"bytes", "regions",
        "reason"}``), or None when every released byte went back to the device."""
        return self._last_kept

    def suspend(self, saves: list[SaveJob], discards: list[Region], store: BackupStore) -> tuple[int, int]:
        self._set_device()
        if self.rereserve_on_sleep and self.kept_reason is None and not self._probed:
            self._probe_rereserve()
        released, copied = super().suspend(saves, discards, store)
        kept = kept_regions = 0
        for region in [j.region for j in saves] + list(discards):
            if any(c.handle is not None for c in region.chunks):
                continue
            if not self.rereserve_on_sleep:
                continue  # the caller's choice (a ROCm with the fix): nothing to report
            if self.kept_reason is None:
                self._rereserve(region)
            else:
                kept += region.size
                kept_regions += 1
        self._last_kept = {"bytes": kept, "regions": kept_regions, "reason": self.kept_reason} if kept else None
        return released - min(kept, released), copied
