"""A SIMULATED HIP runtime (``libamdhip64.so`` stand-in) for tests — no ROCm hardware involved.

Every function is a ctypes ``CFUNCTYPE`` callback with the C prototype of the real call
(pointer arguments arrive as raw addresses; out-parameters and structs are read and written
through memory), so the driver marshals its arguments exactly as against the real library.
Contracts enforced, with HIP's integer error codes:

* sizes, addresses multiples of the granularity; ``hipMemMap`` offset must be 0 and the
  size the whole handle; ``hipMemUnmap`` exactly one whole mapping;
* memory is usable only after ``hipMemSetAccess`` over a fully mapped range;
* a handle's memory is freed only when it is unmapped AND released — and, with
  ``keeps_memory_while_reserved`` (ROCm 6.4 / 7.2.x, ROCm/ROCm#6021), only once the address
  range it was mapped into is freed as well;
* fresh memory holds stale bytes; ``hipMemset`` completes at ``hipDeviceSynchronize`` or a
  synchronous ``hipMemcpy``;
* one file descriptor per handle (EMFILE is reported as ``hipErrorOutOfMemory``);
* ``fail_aligned_reserve``: a reserve with non-zero alignment fails with
  ``hipErrorOutOfMemory`` (vLLM PR #43022);
* no fault at a ``hipMemset`` over several mappings: the intermittent MI300 fault at vLLM's
  allocator-wide wake memset (vLLM PR #52478) has no shown cause, so the simulator does not
  invent one (it used to fail such a memset, which made the per-chunk tests circular).
* ``hipMemAddressFree`` of a range the runtime does not hold (e.g. one given up after it moved)
  ends the process (``os.abort``): the 6.2-era ROCr looks the range up and dereferences the null
  it finds (``runtime.cpp``; ROCr's reserve tries ``FixedAddress`` and falls back).  No later
  runtime is known to answer with an error code instead, so every version crashes here;
* the current device is per thread, device 0 on a thread that never called ``hipSetDevice``
  (HIP's default), and CLR works on it whatever the arguments say: ``hipMemCreate`` allocates on
  the current device (``hip::getCurrentDevice()``, not ``prop.location.id``), ``hipMemcpy`` /
  ``hipMemset`` need the current device to have been granted access to the device memory they
  touch (``ihipMemcpy_validate``, ``hipamd/src/hip_memory.cpp``: ``hipErrorInvalidValue``),
  ``hipDeviceSynchronize`` waits for the current device's work only and ``hipMemGetInfo``
  reports the current device;
* colocated IPC: ``hipMemExportToShareableHandle`` writes a duplicate of the allocation's memfd
  to ``*shareableHandle`` only for the POSIX-fd type requested at ``hipMemCreate``
  (``hipErrorInvalidValue`` otherwise); ``hipMemImportFromShareableHandle`` takes the fd by
  value and maps the same pages in the importing process (real cross-process sharing);
* ``hipMemSetAccess`` by runtime version (``runtime_version``, HIP_VERSION):
  - before 7.2 (ROCr 6.x ``VMemorySetAccess``, ``runtime.cpp``): the range must start exactly
    at a mapped handle;
  - 7.2 and later: the range must start at the start of its reservation — ROCm 7.2.x rejects
    valid sub-buffer mappings at a non-zero offset (rocm-systems PR #9360, SWDEV-568260; PR
    #6977: 21 of 30 runs failed on gfx942; llama.cpp PR #23900: only a SetAccess from the base
    over the whole mapped range works); ``hipErrorInvalidValue`` otherwise.
"""


from __future__ import annotations

import ctypes
import os
import sys
import threading
from ctypes import CFUNCTYPE

from unisleep.backends._native import callback_argtypes
from unisleep.backends.rocm import hip

from .vmm import SimDevice, SimError, check_parameter_names, out_ptr, out_size_t

# the codes come from the bindings too (tests/test_hip_real.py checks them against the header)
hipSuccess, hipErrorInvalidValue, hipErrorOutOfMemory = hip.hipSuccess, hip.hipErrorInvalidValue, hip.hipErrorOutOfMemory
hipErrorNoDevice, hipErrorInvalidDevice, hipErrorUnknown = hip.hipErrorNoDevice, hip.hipErrorInvalidDevice, 999
hipErrorIllegalAddress = hip.hipErrorIllegalAddress

#: ONE declaration: the simulated functions take the bindings' own prototypes (pointers arrive as
#: raw addresses), so a prototype error in hip.py is not repeated here but caught against the real
#: library and header by tests/test_hip_real.py
#: HIP_VERSION from which hipMemSetAccess must start at the start of a reservation (the
#: simulator's own copy: a driver that read the version wrong would not be hidden)
ACCESS_FROM_BASE_SINCE = 70200000

SIGNATURES = {name: (restype, callback_argtypes(args)) for name, (restype, args) in hip.PROTOTYPES.items()}


class FakeHip:
    """SIMULATED libamdhip64: pass as ``RocmDriver(lib=FakeHip(...))``."""

    SIMULATED = True

    def __init__(self, *, fail_aligned_reserve: bool = False, unaligned_fallback: bool = False,
                 ignore_address_hint: bool = False, runtime_version: int = 60200000,
                 **device_kw):
        device_kw.setdefault("keeps_memory_while_reserved", True)
        self.dev = SimDevice(**device_kw)
        self.fail_aligned_reserve = fail_aligned_reserve
        self.unaligned_fallback = unaligned_fallback
        self.ignore_address_hint = ignore_address_hint  # a runtime that never re-reserves in place
        self.runtime_version = runtime_version  # HIP_VERSION; < 5.3 selects the 5.2 struct layout
        self.Prop = hip.alloc_prop_type(runtime_version)
        self._cbs = {}
        for name, (restype, args) in SIGNATURES.items():
            impl = getattr(self, "_" + name)
            check_parameter_names(name, impl, hip.PARAM_NAMES[name])
            cb = CFUNCTYPE(restype, *args)(self._guard(name, impl))
            self._cbs[name] = cb
            setattr(self, name, cb)

    def _guard(self, name, impl):
        def call(*args):
            with self.dev.lock:
                self.dev.count(name, *args)
                try:
                    impl(*args)
                    return hipSuccess
                except SimError as e:
                    self.dev.log.append(("error", name, e.code, str(e)))
                    return e.code
                except BaseException as e:  # a bug in the simulator must not read as success
                    self.dev.internal_errors.append(e)
                    return hipErrorUnknown

        return call

    # ---- device ------------------------------------------------------------------------
    def _hipRuntimeGetVersion(self, runtimeVersion):
        ctypes.c_int.from_address(runtimeVersion).value = self.runtime_version

    def _hipSetDevice(self, deviceId):
        if not 0 <= deviceId < self.dev.device_count:
            raise SimError(hipErrorInvalidDevice, f"no device {deviceId}")
        self.dev.current_device[threading.get_ident()] = deviceId

    def _hipGetDevice(self, deviceId):
        ctypes.c_int.from_address(deviceId).value = self._current()

    def _current(self) -> int:
        cur = self.dev.thread_device()
        return 0 if cur is None else cur  # HIP: device 0 until the thread sets one

    def _check_access(self, va: int, n: int) -> None:
        """The current device must hold access to every mapping of ``[va, va + n)`` it touches."""
        cur = self._current()
        for m in self.dev.mappings.values():
            if m.va < va + max(n, 1) and va < m.va + m.size and cur not in getattr(m, "access_devices", ()):
                raise SimError(hipErrorInvalidValue, f"device memory at {m.va:#x} (device {m.phys.device}) is not "
                               f"accessible from the current device {cur} (simulated ihipMemcpy_validate)")

    def _hipGetDeviceCount(self, count):
        ctypes.c_int.from_address(count).value = self.dev.device_count
        if not self.dev.device_count:  # what libamdhip64 5.2.3 returns on a machine without a GPU
            raise SimError(hipErrorNoDevice, "no device")

    def _hipDeviceSynchronize(self):
        self.dev.drain(device=self._current())

    def _hipMemGetInfo(self, free, total):
        cur = self._current()
        used = sum(p.size for p in self.dev.phys.values() if not p.freed and p.device == cur)
        out_size_t(free, self.dev.total_bytes - used)
        out_size_t(total, self.dev.total_bytes)

    def _check_prop(self, prop_addr):
        prop = self.Prop.from_address(prop_addr)
        if prop.type != 1 or prop.location.type != 1:  # Pinned, Device
            raise SimError(hipErrorInvalidValue, f"prop type {prop.type} / location type {prop.location.type}")
        if not 0 <= prop.location.id < self.dev.device_count:
            raise SimError(hipErrorInvalidDevice, f"prop device {prop.location.id}")

    def _hipMemGetAllocationGranularity(self, granularity, prop, option):
        self._check_prop(prop)
        if option not in (0, 1):
            raise SimError(hipErrorInvalidValue, "granularity option")
        out_size_t(granularity, self.dev.granularity)

    # ---- address space -------------------------------------------------------------------
    def _hipMemAddressReserve(self, ptr, size, alignment, addr, flags):
        if flags:
            raise SimError(hipErrorInvalidValue, "flags must be 0")
        if alignment and self.fail_aligned_reserve:
            raise SimError(hipErrorOutOfMemory, "aligned reservation failed (simulated ROCm behaviour)")
        if self.ignore_address_hint and addr:
            # a runtime that places it elsewhere (every time, not by the kernel's chance)
            va = self.dev.reserve(size, alignment, 0)
            if va == addr:
                other = self.dev.reserve(size, alignment, 0)
                from unisleep.backends.host import libc

                del self.dev.reservations[va]
                libc.munmap(va, size)
                va = other
        else:
            va = self.dev.reserve(size, alignment, addr or 0)
        if self.unaligned_fallback and not alignment and not addr:
            # a reservation that is only page-aligned: move it by one page
            r = self.dev.reservations.pop(va)
            from unisleep.backends.host import libc

            libc.munmap(va, r.size)
            va = libc.mmap(va + 4096, r.size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE | libc.MAP_FIXED)
            r.va = va
            self.dev.reservations[va] = r
        out_ptr(ptr, va)

    def _hipMemAddressFree(self, devPtr, size):
        if (devPtr or 0) not in self.dev.reservations:
            # the 6.2-era runtime looks the range up and dereferences the null it gets back
            sys.stderr.write(f"SIMULATED HIP {self.runtime_version}: hipMemAddressFree({devPtr or 0:#x}) of a range "
                             "the runtime does not hold: null dereference, the process ends\n")
            sys.stderr.flush()
            os.abort()
        self.dev.free_address(devPtr or 0, size)

    # ---- physical memory -----------------------------------------------------------------
    def _hipMemCreate(self, handle, size, prop, flags):
        if flags:
            raise SimError(hipErrorInvalidValue, "flags must be 0")
        self._check_prop(prop)
        p = self.dev.create(size, device=self._current())
        p.handle_types = self.Prop.from_address(prop).requestedHandleType
        out_ptr(handle, p.id)

    def _hipMemExportToShareableHandle(self, shareableHandle, handle, handleType, flags):
        p = self.dev.handle(handle or 0)
        if handleType != hip.hipMemHandleTypePosixFileDescriptor or not p.handle_types & handleType or flags:
            raise SimError(hipErrorInvalidValue, f"export as handle type {handleType}: the allocation was created "
                           f"with requestedHandleType {p.handle_types} (simulated: only the type requested at "
                           "hipMemCreate exports)")
        if not shareableHandle:
            raise SimError(hipErrorInvalidValue, "shareableHandle is NULL")
        ctypes.c_int.from_address(shareableHandle).value = os.dup(p.fd)

    def _hipMemImportFromShareableHandle(self, handle, osHandle, shHandleType):
        if not handle or not osHandle or shHandleType != hip.hipMemHandleTypePosixFileDescriptor:
            raise SimError(hipErrorInvalidValue, f"import of handle type {shHandleType} from {osHandle}")
        try:
            p = self.dev.import_fd(int(osHandle), self._current())
        except OSError as e:
            raise SimError(hipErrorInvalidValue, f"fd {osHandle}: {e}") from e
        out_ptr(handle, p.id)

    def _hipMemMap(self, ptr, size, offset, handle, flags):
        if offset != 0:
            raise SimError(hipErrorInvalidValue, "hipMemMap: offset must be 0")
        if flags:
            raise SimError(hipErrorInvalidValue, "flags must be 0")
        p = self.dev.handle(handle or 0)
        if size != p.size:
            raise SimError(hipErrorInvalidValue, f"hipMemMap maps whole handles: size {size} != {p.size}")
        self.dev.map(ptr or 0, size, p)

    def _hipMemSetAccess(self, ptr, size, desc, count):
        if count < 1:
            raise SimError(hipErrorInvalidValue, "no access descriptor")
        d = hip.hipMemAccessDesc.from_address(desc)
        if d.flags != 3 or d.location.type != 1:
            raise SimError(hipErrorInvalidValue, f"access flags {d.flags}")
        va = ptr or 0
        if self.runtime_version >= ACCESS_FROM_BASE_SINCE:
            r = self.dev.reservation_of(va, max(size, 1))
            if r is not None and va != r.va:
                raise SimError(hipErrorInvalidValue, f"hipMemSetAccess at offset {va - r.va:#x} of a reservation: "
                               "ROCm 7.2 rejects a non-zero offset (simulated, rocm-systems PR #9360)")
        elif va not in self.dev.mappings:
            raise SimError(hipErrorInvalidValue, f"hipMemSetAccess at {va:#x}, not the start of a mapped handle "
                           "(simulated ROCr 6.x VMemorySetAccess)")
        self.dev.set_access(ptr or 0, size)
        for m in self.dev._covering(ptr or 0, size) or ():
            m.access_devices = getattr(m, "access_devices", set()) | {d.location.id}

    def _hipMemUnmap(self, ptr, size):
        self.dev.unmap(ptr or 0, size)

    def _hipMemRelease(self, handle):
        self.dev.release(self.dev.handle(handle or 0))

    # ---- data ----------------------------------------------------------------------------
    def _hipMemcpy(self, dst, src, sizeBytes, kind):
        sides = {0: (False, False), 1: (True, False), 2: (False, True), 3: (True, True), 4: (None, None)}
        if kind not in sides:
            raise SimError(hipErrorInvalidValue, f"memcpy kind {kind}")
        for ptr in (dst or 0, src or 0):
            if self.dev.is_device(ptr, sizeBytes):
                self._check_access(ptr, sizeBytes)
        self.dev.memcpy(dst or 0, src or 0, sizeBytes, *sides[kind])

    def _hipMemset(self, dst, value, sizeBytes):
        self._check_access(dst or 0, sizeBytes)
        self.dev.memset(dst or 0, value & 0xFF, sizeBytes)

    def _hipHostMalloc(self, ptr, size, flags):
        out_ptr(ptr, self.dev.host_malloc(size))

    def _hipHostFree(self, ptr):
        self.dev.host_free(ptr or 0)

    def close(self):
        self.dev.close()
