"""A SIMULATED AscendCL runtime (``libascendcl.so`` stand-in) for tests — no Ascend hardware.

Functions are ctypes ``CFUNCTYPE`` callbacks with the C prototypes of ``acl_rt.h`` (pointer
arguments arrive as raw addresses; structs are read from memory).  Contracts enforced, with
ACL's integer error codes:

* ``aclrtReserveMemAddress``: alignment must be 0 and expectPtr NULL (CANN 8);
* ``aclrtMallocPhysical`` / ``aclrtMapMem``: sizes multiples of the granularity; the map size
  equals the physical size, offset 0; ``aclrtPhysicalMemProp.location`` is ``{id, type}``;
* ``aclrtUnmapMem(ptr)`` takes the start of a mapping (no size);
* ``aclrtFreePhysical`` and ``aclrtReleaseMemAddress`` fail while still mapped;
* ``aclrtMemcpy(dst, destMax, src, count, kind)``: count > destMax is an error; kind is
  checked against where the pointers live; ``aclrtMemset(ptr, maxCount, value, count)`` idem;
* mapped memory is accessible at once (no SetAccess); fresh memory holds stale bytes and
  memset completes at ``aclrtSynchronizeDevice`` or a synchronous copy;
* the context is per thread: ``aclrtSetDevice`` binds the device's default context to the
  calling thread, and every other call needs the thread to hold one (``ACL_ERROR_RT_CONTEXT_NULL``)
  — of the device whose memory or ``prop.location`` it touches (``ACL_ERROR_RT_PARAM_INVALID``).
  vllm-ascend's allocator calls ``ensure_context(device)`` at every C entry point for this
  (``csrc/camem_allocator.cpp``: ``my_malloc``, ``my_free``, ``python_create_and_map``,
  ``python_unmap_and_release``).
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import CFUNCTYPE

from unisleep.backends._native import callback_argtypes
from unisleep.backends.ascend import acl

from .vmm import SimDevice, SimError, check_parameter_names, out_ptr, out_size_t

# the codes the bindings use come from the bindings; the rest are the simulator's own
ACL_SUCCESS = acl.ACL_SUCCESS
ACL_ERROR_INVALID_PARAM = acl.ACL_ERROR_INVALID_PARAM
ACL_ERROR_RT_PARAM_INVALID = acl.ACL_ERROR_RT_PARAM_INVALID
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_MEMORY_ALLOCATION = acl.ACL_ERROR_RT_MEMORY_ALLOCATION
ACL_ERROR_RT_MEMORY_FREE = acl.ACL_ERROR_RT_MEMORY_FREE
ACL_ERROR_INTERNAL = 500000

# SimError codes from the shared device model -> ACL codes
_CODE = {1: ACL_ERROR_RT_PARAM_INVALID, 2: ACL_ERROR_RT_MEMORY_ALLOCATION, 400: ACL_ERROR_RT_PARAM_INVALID}

#: ONE declaration: the simulated functions take the bindings' own prototypes (acl.PROTOTYPES,
#: pointers arriving as raw addresses) and read structs with the bindings' declarations, so the
#: simulator tests the driver's logic, not a second copy of the ABI (checked in docs/ascend.md)
SIGNATURES = {name: (restype, callback_argtypes(args)) for name, (restype, args) in acl.PROTOTYPES.items()}


class FakeAcl:
    """SIMULATED libascendcl: pass as ``AscendDriver(lib=FakeAcl(...))``."""

    SIMULATED = True

    def __init__(self, **device_kw):
        device_kw.setdefault("access_on_map", True)  # ACL grants access at map time
        device_kw.setdefault("keeps_memory_while_reserved", False)
        self.dev = SimDevice(**device_kw)
        self._cbs = {}
        for name, (restype, args) in SIGNATURES.items():
            check_parameter_names(name, getattr(self, "_" + name), acl.PARAM_NAMES[name])
            cb = CFUNCTYPE(restype, *args)(self._guard(name, getattr(self, "_" + name)))
            self._cbs[name] = cb
            setattr(self, name, cb)

    def _guard(self, name, impl):
        def call(*args):
            with self.dev.lock:
                self.dev.count(name, *args)
                try:
                    impl(*args)
                    return ACL_SUCCESS
                except SimError as e:
                    code = _CODE.get(e.code, e.code)
                    self.dev.log.append(("error", name, code, str(e)))
                    return code
                except BaseException as e:
                    self.dev.internal_errors.append(e)
                    return ACL_ERROR_INTERNAL

        return call

    def _need_device(self, device=None, va=None, n=0):
        """The calling thread must hold a context, of ``device`` / of the device owning the
        mapped memory at ``[va, va + n)`` when given."""
        cur = self.dev.thread_device()
        if cur is None:
            raise SimError(ACL_ERROR_RT_CONTEXT_NULL, "no context on this thread (aclrtSetDevice)")
        want = {device} if device is not None else (self.dev.devices_of(va, n) if va else set())
        if want - {cur}:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, f"this thread's context is device {cur}'s, the call is on "
                           f"device {sorted(want)}'s memory")

    def _aclrtSetDevice(self, deviceId):
        if not 0 <= deviceId < self.dev.device_count:
            raise SimError(ACL_ERROR_RT_INVALID_DEVICEID, f"no device {deviceId}")
        self.dev.current_device[threading.get_ident()] = deviceId

    def _aclrtSynchronizeDevice(self):
        self._need_device()
        self.dev.drain(device=self.dev.thread_device())

    def _aclrtGetMemInfo(self, attr, free, total):
        self._need_device()
        out_size_t(free, self.dev.total_bytes - self.dev.used_bytes)
        out_size_t(total, self.dev.total_bytes)

    def _check_prop(self, addr):
        prop = acl.aclrtPhysicalMemProp.from_address(addr)
        if prop.handleType != 0 or prop.allocationType != 0:
            raise SimError(ACL_ERROR_INVALID_PARAM, "handleType/allocationType")
        if prop.location.type != 1 or prop.location.id >= self.dev.device_count:
            raise SimError(ACL_ERROR_INVALID_PARAM, f"location {{id={prop.location.id}, type={prop.location.type}}}")
        if prop.memAttr not in (1, 4, 5, 10):
            raise SimError(ACL_ERROR_INVALID_PARAM, f"memAttr {prop.memAttr}")

    def _aclrtMemGetAllocationGranularity(self, prop, option, granularity):
        self._need_device()
        self._check_prop(prop)
        if option not in (0, 1):
            raise SimError(ACL_ERROR_INVALID_PARAM, "option")
        out_size_t(granularity, self.dev.granularity)

    def _aclrtReserveMemAddress(self, virPtr, size, alignment, expectPtr, flags):
        self._need_device()
        if alignment != 0:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, "alignment must be 0")
        if expectPtr:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, "expectPtr must be NULL (CANN 8)")
        out_ptr(virPtr, self.dev.reserve(size, 0, 0))

    def _aclrtReleaseMemAddress(self, virPtr):
        self._need_device()
        r = self.dev.reservations.get(virPtr or 0)
        if r is None:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, "not a reservation")
        self.dev.free_address(r.va, None)

    def _aclrtMallocPhysical(self, handle, size, prop, flags):
        self._need_device()
        if flags:
            raise SimError(ACL_ERROR_INVALID_PARAM, "flags must be 0")
        self._check_prop(prop)
        loc = acl.aclrtPhysicalMemProp.from_address(prop).location.id
        self._need_device(device=loc)
        out_ptr(handle, self.dev.create(size, device=loc).id)

    def _aclrtFreePhysical(self, handle):
        p = self.dev.handle(handle or 0)
        self._need_device(device=p.device)
        if p.mapped_at:
            raise SimError(ACL_ERROR_RT_MEMORY_FREE, "aclrtFreePhysical on a mapped handle: unmap first")
        self.dev.release(p)

    def _aclrtMapMem(self, virPtr, size, offset, handle, flags):
        if offset or flags:
            raise SimError(ACL_ERROR_INVALID_PARAM, "offset and flags must be 0")
        p = self.dev.handle(handle or 0)
        self._need_device(device=p.device)
        if size != p.size:
            raise SimError(ACL_ERROR_INVALID_PARAM, f"map size {size} != physical size {p.size}")
        self.dev.map(virPtr or 0, size, p)

    def _aclrtUnmapMem(self, virPtr):
        self._need_device(va=virPtr or 0, n=1)
        self.dev.unmap(virPtr or 0, None)

    def _aclrtMemcpy(self, dst, destMax, src, count, kind):
        self._need_device()
        for ptr in (dst or 0, src or 0):
            self._need_device(va=ptr, n=count)
        if count > destMax:
            raise SimError(ACL_ERROR_INVALID_PARAM, f"count {count} > destMax {destMax}")
        sides = {0: (False, False), 1: (True, False), 2: (False, True), 3: (True, True), 4: (None, None)}
        if kind not in sides:
            raise SimError(ACL_ERROR_INVALID_PARAM, f"kind {kind}")
        self.dev.memcpy(dst or 0, src or 0, count, *sides[kind])

    def _aclrtMemset(self, devPtr, maxCount, value, count):
        self._need_device(va=devPtr or 0, n=count)
        self._need_device()
        if count > maxCount:
            raise SimError(ACL_ERROR_INVALID_PARAM, f"count {count} > maxCount {maxCount}")
        self.dev.memset(devPtr or 0, value & 0xFF, count)

    def _aclrtMallocHost(self, hostPtr, size):
        self._need_device()
        out_ptr(hostPtr, self.dev.host_malloc(size))

    def _aclrtFreeHost(self, hostPtr):
        self._need_device()
        self.dev.host_free(hostPtr or 0)

    def close(self):
        self.dev.close()
