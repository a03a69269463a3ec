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
  ``python_unmap_and_release``).  ``aclrtGetDevice`` reports the thread's device, and
  ``ACL_ERROR_RT_CONTEXT_NULL`` on a thread without one (hicann/runtime v9.1.0
  ``src/runtime/api/api_c_device.cc`` ``rtGetDevice``).

Colocated IPC (``aclrtMemExportToShareableHandle`` and the rest) needs state that outlives one
process, as the kernel driver's does: ``driver_dir`` (one folder for all the simulated processes
of one machine) holds a record per shareable handle, and an import opens the exporter's memfd
through ``/proc/<pid>/fd`` so both processes map the same pages.  The rules are the Ascend
driver's (its open source, ``src/sdk_driver/svm/v2/master/comm/svm_master_mem_share.c`` and
``src/ascend_hal/svm/v2/devmm/devmm_svm.c``, read in the verylucky01/driver mirror of it; the
docs' pages of the three calls), with ACL's codes as the driver's errno table and the runtime's
map turn them into (``EACCES`` -> ``DRV_ERROR_IOCRL_FAIL`` -> ``ACL_ERROR_RT_DRV_INTERNAL_ERROR``,
``EFAULT`` -> ``DRV_ERROR_INVALID_HANDLE`` -> ``ACL_ERROR_RT_INVALID_HANDLE``):

* the handle is ``share_devid << 32 | share_id`` (``devmm_share_handle_pack``); a handle no live
  export of that device has (never exported, its exporter freed it, another device's bits) is
  ``ACL_ERROR_RT_INVALID_HANDLE`` ("Share handle doesn't exist");
* one export per physical handle (the export page: exporting again is an error); ``handleType``
  must be ``ACL_MEM_HANDLE_TYPE_NONE`` (``DRV_ERROR_NOT_SUPPORT`` otherwise);
* with the default flags the whitelist is on: an import by a pid that
  ``aclrtMemSetPidToShareableHandle`` did not list — or before any pid is set — is refused
  ("Current process not add in pid list"), and so is one by a process that started after its pid
  was listed ("Time check fail": a reused pid is not the process that was meant);
* only the exporting process may set pids ("Not export process"), not after the whitelist was
  switched off; ``pid`` NULL or ``pidNum`` 0 is ``ACL_ERROR_RT_PARAM_INVALID``, pid 0 is skipped;
* the exporting process cannot import its own handle on that device ("Export process can not
  import"); a process imports a handle once per device ("Can not import multi times") until it
  frees the import;
* the pid the driver checks is the process's pid on the host (``aclrtDeviceGetBareTgid``; in a
  container it differs from ``getpid()``): ``pid_offset`` simulates such a pid namespace;
* an import into another device than the exporter's is refused here (the export page requires
  ``aclrtDeviceEnablePeerAccess`` across devices, which unisleep does not bind): the simulator's
  rule and code, not read in the driver.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from ctypes import CFUNCTYPE

from unisleep.backends._native import callback_argtypes
from unisleep.backends.ascend import acl

from .vmm import SimDevice, SimError, check_parameter_names, out_ptr, out_size_t

# the codes the bindings use come from the bindings; the rest are the simulator's own
ACL_SUCCESS = acl.ACL_SUCCESS
ACL_ERROR_INVALID_PARAM = acl.ACL_ERROR_INVALID_PARAM
ACL_ERROR_RT_PARAM_INVALID = acl.ACL_ERROR_RT_PARAM_INVALID
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = acl.ACL_ERROR_RT_CONTEXT_NULL
ACL_ERROR_RT_INVALID_HANDLE = acl.ACL_ERROR_RT_INVALID_HANDLE
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = acl.ACL_ERROR_RT_MEMORY_ALLOCATION
ACL_ERROR_RT_MEMORY_FREE = acl.ACL_ERROR_RT_MEMORY_FREE
ACL_ERROR_RT_NO_PERMISSION = acl.ACL_ERROR_RT_NO_PERMISSION
ACL_ERROR_RT_DRV_INTERNAL_ERROR = acl.ACL_ERROR_RT_DRV_INTERNAL_ERROR
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

    def __init__(self, driver_dir: str = None, pid_offset: int = 0, **device_kw):
        device_kw.setdefault("access_on_map", True)  # ACL grants access at map time
        device_kw.setdefault("keeps_memory_while_reserved", False)
        self.dev = SimDevice(**device_kw)
        self._own_driver_dir = driver_dir is None
        self.driver_dir = driver_dir or tempfile.mkdtemp(prefix="fake-acl-driver-")
        self.pid_offset = pid_offset
        self._exported: dict[int, int] = {}  # physical handle id -> shareable handle
        self._imported: dict[int, int] = {}  # physical handle id (an import) -> shareable handle
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

    def _aclrtGetDevice(self, deviceId):
        cur = self.dev.thread_device()
        if cur is None:
            raise SimError(ACL_ERROR_RT_CONTEXT_NULL, "no context on this thread")
        ctypes.c_int32.from_address(deviceId).value = cur

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
        with self._driver():
            if p.id in self._exported:  # the exporter's free destroys the shareable handle
                try:
                    os.unlink(self._record_path(self._exported.pop(p.id)))
                except FileNotFoundError:
                    pass
            if p.id in self._imported:  # this process may import that handle again
                h = self._imported.pop(p.id)
                rec = self._load(h)
                if rec is not None:
                    rec["imported"] = [k for k in rec["imported"] if k != f"{self._bare_tgid()}:{p.device}"]
                    self._save(h, rec)

    # ---- colocated IPC: the driver's state, shared by the simulated processes of one machine
    def _bare_tgid(self) -> int:
        return os.getpid() + self.pid_offset

    def _driver(self):
        """The simulated driver's lock (one for the whole machine)."""
        lib = self

        class _Lock:
            def __enter__(self):
                self.fd = os.open(os.path.join(lib.driver_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self.fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)

        return _Lock()

    def _record_path(self, h: int) -> str:
        return os.path.join(self.driver_dir, f"share-{h:016x}.json")

    def _load(self, h: int):
        try:
            with open(self._record_path(h)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _save(self, h: int, rec: dict) -> None:
        tmp = self._record_path(h) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, self._record_path(h))

    @staticmethod
    def _now_ns() -> int:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME)

    @staticmethod
    def _start_ns() -> int:
        """When this process started, on the boot clock (``/proc/self/stat`` field 22, in clock
        ticks: 10 ms coarser than the driver's, rounded down, so a pid listed less than a tick
        before its process started passes here)."""
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")

    def _aclrtMemExportToShareableHandle(self, handle, handleType, flags, shareableHandle):
        self._need_device()
        p = self.dev.handle(handle or 0)
        if handleType != acl.ACL_MEM_HANDLE_TYPE_NONE:
            raise SimError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, f"handleType {handleType}: only ACL_MEM_HANDLE_TYPE_NONE")
        if flags not in (acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION):
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, f"flags {flags}")
        if p.id in self._exported or p.id in self._imported:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, "a physical handle is exported once, by the process that "
                           "allocated it (one handle, one shareable handle)")
        with self._driver():
            counter = os.path.join(self.driver_dir, "next-share-id")
            try:
                with open(counter) as f:
                    sid = int(f.read())
            except FileNotFoundError:
                sid = 1
            with open(counter, "w") as f:
                f.write(str(sid + 1))
            h = (p.device << 32) | sid
            self._save(h, {"device": p.device, "exporter": self._bare_tgid(), "exporter_pid": os.getpid(),
                           "fd": p.fd, "whitelist": flags == acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, "pids": {},
                           "imported": []})
        p.imported = True  # shared pages: never handed out again as fresh memory
        self._exported[p.id] = h
        ctypes.c_uint64.from_address(shareableHandle).value = h

    def _aclrtMemSetPidToShareableHandle(self, shareableHandle, pid, pidNum):
        if not pid or pidNum == 0:
            raise SimError(ACL_ERROR_RT_PARAM_INVALID, "pid NULL or pidNum 0")
        pids = list((ctypes.c_int32 * pidNum).from_address(pid))
        with self._driver():
            rec = self._load(shareableHandle)
            if rec is None:
                raise SimError(ACL_ERROR_RT_INVALID_HANDLE, f"Share handle doesn't exist ({shareableHandle:#x})")
            if rec["exporter"] != self._bare_tgid():
                raise SimError(ACL_ERROR_RT_DRV_INTERNAL_ERROR, "Not export process, can not set pid")
            if not rec["whitelist"]:
                raise SimError(ACL_ERROR_RT_NO_PERMISSION, "Had set no need wlist, operation not permitted")
            now = self._now_ns()
            listed = [x for x in pids if x != 0]
            if not listed:
                raise SimError(ACL_ERROR_RT_PARAM_INVALID, "no valid pid (pid 0 is skipped)")
            for x in listed:
                rec["pids"][str(x)] = now
            self._save(shareableHandle, rec)

    def _aclrtMemImportFromShareableHandle(self, shareableHandle, deviceId, handle):
        self._need_device()
        if not 0 <= deviceId < self.dev.device_count:
            raise SimError(ACL_ERROR_RT_INVALID_DEVICEID, f"no device {deviceId}")
        me = self._bare_tgid()
        with self._driver():
            rec = self._load(shareableHandle)
            if rec is None:
                raise SimError(ACL_ERROR_RT_INVALID_HANDLE, f"Share handle doesn't exist ({shareableHandle:#x})")
            if rec["exporter"] == me and rec["device"] == deviceId:
                raise SimError(ACL_ERROR_RT_DRV_INTERNAL_ERROR, "Export process can not import")
            if deviceId != rec["device"]:
                raise SimError(ACL_ERROR_RT_PARAM_INVALID, f"the handle is device {rec['device']}'s, imported into "
                               f"device {deviceId} (across devices needs aclrtDeviceEnablePeerAccess)")
            if rec["whitelist"]:
                t = rec["pids"].get(str(me))
                if t is None:
                    raise SimError(ACL_ERROR_RT_DRV_INTERNAL_ERROR, f"Current process not add in pid list (pid={me})")
                if t < self._start_ns():
                    raise SimError(ACL_ERROR_RT_DRV_INTERNAL_ERROR, f"Time check fail (pid={me} was listed before "
                                   "this process started)")
            key = f"{me}:{deviceId}"
            if key in rec["imported"]:
                raise SimError(ACL_ERROR_RT_INVALID_HANDLE, f"Can not import multi times (pid={me}; devid={deviceId})")
            fd = os.open(f"/proc/{rec['exporter_pid']}/fd/{rec['fd']}", os.O_RDWR | os.O_CLOEXEC)
            try:
                p = self.dev.import_fd(fd, deviceId)
            finally:
                os.close(fd)
            rec["imported"].append(key)
            self._save(shareableHandle, rec)
        self._imported[p.id] = shareableHandle
        out_ptr(handle, p.id)

    def _aclrtDeviceGetBareTgid(self, pid):
        ctypes.c_int32.from_address(pid).value = self._bare_tgid()

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
        if self._own_driver_dir:
            shutil.rmtree(self.driver_dir, ignore_errors=True)
