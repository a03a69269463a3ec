"""Whole-process capture: every allocation torch's allocator library makes from a thread in an
"interesting region" becomes a lifecycle region, without ``LD_PRELOAD``.

How: the allocator library's import table (its GOT slots for the two functions named by the
driver's :class:`CaptureSpec`, e.g. the device runtime's malloc/free, or ``posix_memalign``/
``free`` for torch's CPU allocator) is rewritten in this process to point at the hooks of
unisleep's native library (``unisleep/compat/csrc/tms_preload.c``).  That is what an
``LD_PRELOAD`` interposer achieves, done in-process for that one library, so torch's own caching
allocator stays in charge above it: its cache, its release of cached segments on out-of-memory
and ``empty_cache()``, its cross-stream frees and graph pools all behave as without capture.
Only the segments it asks the runtime for are captured.

Why not a process-wide ``MemPool`` routing (``_cuda_beginAllocateToPool`` with an always-true
filter): torch treats any routing as a graph capture in progress — it then never processes the
events of cross-stream frees (``record_stream``; they are deferred until no capture is under way,
i.e. forever), never releases cached blocks on out-of-memory, and ``empty_cache()`` skips the
routed pool.  A trainer would leak every collective's buffers and hit out-of-memory errors that
torch's cache release would have avoided.

Limits: only the named library's calls are redirected (torch's allocator; not NCCL's or an
extension's own direct calls); a library whose runtime is linked statically has no slot to
rewrite, which :meth:`ProcessCapture.install` reports by name.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from unisleep.errors import UnsupportedError
from unisleep.region import Region

log = logging.getLogger("unisleep.capture")


@dataclass(frozen=True)
class CaptureSpec:
    """What whole-process capture rewrites on one platform (a driver's ``capture_spec``)."""

    library: str  # file stem of torch's allocator library, e.g. "libc10"
    alloc: str  # the allocation function it imports
    free: str  # the matching free function
    kind: str  # "device": int f(void**, size_t) / int f(void*); "host": posix_memalign / free
    runtime: Optional[str] = None  # file stem of the library defining them (None: the process's default)


# ---------------------------------------------------------------------------- ELF
_EM_X86_64, _EM_AARCH64 = 62, 183
# relocation types that store a symbol's address in a slot: JUMP_SLOT, GLOB_DAT, 64-bit absolute
_SLOT_TYPES = {_EM_X86_64: {7, 6, 1}, _EM_AARCH64: {1026, 1025, 257}}
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_PLTRELSZ, _DT_STRTAB, _DT_SYMTAB, _DT_RELA, _DT_RELASZ, _DT_JMPREL = 0, 2, 5, 6, 7, 8, 23


def import_slots(path: str, names: set[str]) -> dict[str, list[int]]:
    """Offsets (from the load base) of the slots through which the ELF shared object ``path``
    reaches each of ``names``: its PLT/GOT relocations that name them."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise UnsupportedError(f"{path} is not a 64-bit little-endian ELF shared object")
        machine = struct.unpack_from("<H", data, 18)[0]
        if machine not in _SLOT_TYPES:
            raise UnsupportedError(f"{path}: machine type {machine} is not supported (x86-64 and AArch64 are)")
        phoff, = struct.unpack_from("<Q", data, 32)
        phentsize, phnum = struct.unpack_from("<HH", data, 54)
        loads, dyn = [], None
        for i in range(phnum):
            p_type, _flags, p_off, p_vaddr, _pa, p_filesz, _memsz, _al = struct.unpack_from(
                "<IIQQQQQQ", data, phoff + i * phentsize)
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_off, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dyn = (p_off, p_filesz)
        if dyn is None:
            raise UnsupportedError(f"{path} has no dynamic section")

        def off(vaddr: int) -> int:
            for v, o, n in loads:
                if v <= vaddr < v + n:
                    return o + vaddr - v
            raise UnsupportedError(f"{path}: address {vaddr:#x} is outside its loaded segments")

        tags: dict[int, int] = {}
        for pos in range(dyn[0], dyn[0] + dyn[1], 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == _DT_NULL:
                break
            tags.setdefault(tag, val)
        if _DT_SYMTAB not in tags or _DT_STRTAB not in tags:
            raise UnsupportedError(f"{path} has no dynamic symbol table")
        symtab, strtab = off(tags[_DT_SYMTAB]), off(tags[_DT_STRTAB])

        def name_of(sym: int) -> str:
            st_name, = struct.unpack_from("<I", data, symtab + sym * 24)
            end = data.find(b"\0", strtab + st_name)
            return data[strtab + st_name:end].decode("ascii", "replace")

        found: dict[str, list[int]] = {n: [] for n in names}
        types = _SLOT_TYPES[machine]
        for start_tag, size_tag in ((_DT_JMPREL, _DT_PLTRELSZ), (_DT_RELA, _DT_RELASZ)):
            if start_tag not in tags:
                continue
            start, size = off(tags[start_tag]), tags.get(size_tag, 0)
            for pos in range(start, start + size, 24):
                r_offset, r_info, _addend = struct.unpack_from("<QQq", data, pos)
                sym, typ = r_info >> 32, r_info & 0xFFFFFFFF
                if sym and typ in types:
                    n = name_of(sym)
                    if n in found:
                        found[n].append(r_offset)
        return found
    finally:
        data.close()


class _DlPhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_uint64), ("dlpi_name", ctypes.c_char_p),
                ("dlpi_phdr", ctypes.c_void_p), ("dlpi_phnum", ctypes.c_uint16)]


_libc = ctypes.CDLL(None, use_errno=True)
_ITER_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t, ctypes.c_void_p)


def loaded_objects() -> list[tuple[str, int]]:
    """(path, load base) of every shared object loaded in this process (``dl_iterate_phdr``)."""
    out: list[tuple[str, int]] = []

    def each(info, _size, _data):
        name = info.contents.dlpi_name
        if name:
            out.append((name.decode(errors="replace"), int(info.contents.dlpi_addr)))
        return 0

    cb = _ITER_CB(each)
    _libc.dl_iterate_phdr(cb, None)
    return out


def find_loaded(stem: str) -> Optional[tuple[str, int]]:
    """(real path, load base) of the loaded object whose file is ``stem.so`` or ``stem.so.*``."""
    for path, base in loaded_objects():
        b = os.path.basename(path)
        if b == stem + ".so" or b.startswith(stem + ".so."):
            return os.path.realpath(path), base
    return None


def _mapping_of(addr: int) -> tuple[int, int, str]:
    """(start, end, permissions) of the mapping holding ``addr`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if lo <= addr < hi:
                return lo, hi, perms
    raise UnsupportedError(f"address {addr:#x} is not mapped")


_PROT = {"r": mmap.PROT_READ, "w": mmap.PROT_WRITE, "x": mmap.PROT_EXEC}
_mprotect = _libc.mprotect
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def write_slot(addr: int, value: int) -> int:
    """Store the pointer ``value`` at ``addr`` (a GOT slot, read-only after relocation where the
    object has RELRO: made writable for the store, then given its protection back); returns
    the previous value."""
    page = mmap.PAGESIZE
    lo = addr & ~(page - 1)
    _start, _end, perms = _mapping_of(addr)
    was = sum(v for k, v in _PROT.items() if k in perms)
    slot = ctypes.c_void_p.from_address(addr)
    if "w" not in perms and _mprotect(lo, page, was | mmap.PROT_WRITE) != 0:
        e = ctypes.get_errno()
        raise UnsupportedError(f"cannot make the import slot at {addr:#x} writable: {os.strerror(e)}")
    try:
        old = slot.value or 0
        slot.value = value
    finally:
        if "w" not in perms:
            _mprotect(lo, page, was)
    return old


# ---------------------------------------------------------------------------- capture
_ALLOC_CB = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t)
_FREE_CB = ctypes.CFUNCTYPE(None, ctypes.c_uint64)

#: (lifecycle, tag) for an allocation of ``size`` bytes made now by the calling thread, or None
#: when this one is not captured (the real function serves it)
Resolver = Callable[[int], Optional[tuple]]
_DECLINED, _FAILED = 0, 1  # what the allocation callback returns besides an address


class ProcessCapture:
    """Redirects the allocator library's imports of ``spec.alloc``/``spec.free`` to the hooks of
    ``native`` (the loaded compatibility library) and serves them: each allocation the hook
    passes on becomes a region of the lifecycle and tag ``resolve(size)`` names, registered with
    that lifecycle (it sleeps and wakes with the tag); its free forgets and frees the region.
    One per process: the import table is process-wide."""

    _active: Optional["ProcessCapture"] = None
    _lock = threading.Lock()

    def __init__(self, spec: CaptureSpec, native: ctypes.CDLL, resolve: Resolver):
        self.spec, self.native, self.resolve = spec, native, resolve
        self.library: Optional[str] = None
        self.slots: list[tuple[int, int]] = []  # (address, original value)
        self._owner: dict[int, tuple] = {}  # va -> (lifecycle, region)
        self._mu = threading.Lock()
        self._alloc_cb = _ALLOC_CB(self._on_alloc)
        self._free_cb = _FREE_CB(self._on_free)
        self.failures = 0

    # -- set-up
    def install(self) -> None:
        """Resolve the real functions, register the callbacks, rewrite the slots.  Raises
        :class:`~unisleep.errors.UnsupportedError` (nothing changed) when the library is not
        loaded or imports neither function."""
        with ProcessCapture._lock:
            if ProcessCapture._active is not None:
                raise UnsupportedError("whole-process capture is already installed in this process")
            found = find_loaded(self.spec.library)
            if found is None:
                raise UnsupportedError(
                    f"{self.spec.library}.so (torch's allocator library) is not loaded in this process; "
                    "import torch before starting whole-process capture")
            path, base = found
            offsets = import_slots(path, {self.spec.alloc, self.spec.free})
            if not offsets[self.spec.alloc] or not offsets[self.spec.free]:
                raise UnsupportedError(
                    f"{path} does not import {self.spec.alloc}/{self.spec.free} through its import table (a "
                    "statically linked runtime?), so its allocations cannot be captured without LD_PRELOAD; "
                    "wrap the allocations to pause in torch_memory_saver.region() instead")
            real_alloc, real_free = self._real(path, base, offsets)
            n = self.native
            if self.spec.kind == "host":
                n.unisleep_capture_set_real_host(ctypes.c_void_p(real_alloc), ctypes.c_void_p(real_free))
                hooks = (n.unisleep_hook_posix_memalign, n.unisleep_hook_free)
            else:
                n.unisleep_capture_set_real_device(ctypes.c_void_p(real_alloc), ctypes.c_void_p(real_free))
                hooks = (n.unisleep_hook_device_malloc, n.unisleep_hook_device_free)
            n.unisleep_capture_set_callbacks(self._alloc_cb, self._free_cb)
            targets = {self.spec.alloc: _addr(hooks[0]), self.spec.free: _addr(hooks[1])}
            for name, hook in targets.items():
                for off in offsets[name]:
                    self.slots.append((base + off, write_slot(base + off, hook)))
            self.library = path
            ProcessCapture._active = self
            atexit.register(self._at_exit)
            log.info("whole-process capture: %s's %s/%s go through unisleep (%d slots)", os.path.basename(path),
                     self.spec.alloc, self.spec.free, len(self.slots))

    def _real(self, path: str, base: int, offsets: dict) -> tuple[int, int]:
        """The functions the library reaches now: a bound slot holds its target; an unbound
        (lazy) one points back into the library, so the symbol is looked up as the linker would."""
        own = _maps_of(path)
        rt = None
        if self.spec.runtime:
            hit = find_loaded(self.spec.runtime)
            if hit is not None:
                rt = ctypes.CDLL(hit[0], mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        default = ctypes.CDLL(None)
        out = []
        for name in (self.spec.alloc, self.spec.free):
            cur = ctypes.c_void_p.from_address(base + offsets[name][0]).value or 0
            if cur and not any(lo <= cur < hi for lo, hi in own):
                out.append(cur)
                continue
            for lib in (rt, default):
                if lib is None:
                    continue
                try:
                    out.append(_addr(getattr(lib, name)))
                    break
                except AttributeError:
                    continue
            else:
                raise UnsupportedError(f"cannot find {name} (needed by {path}) in this process")
        return out[0], out[1]

    def stop(self) -> None:
        """Capture nothing more.  The rewritten slots stay: what was captured is still freed
        through the free callback."""
        self.native.unisleep_capture_set_callbacks(None, self._free_cb)

    def _at_exit(self) -> None:
        # frees after this point (interpreter teardown) leave captured memory to the exit
        self.native.unisleep_capture_set_callbacks(None, None)

    @property
    def owned(self) -> int:
        """Captured allocations still alive."""
        return int(self.native.unisleep_capture_owned())

    # -- the callbacks (never raise through C)
    def _on_alloc(self, size: int, align: int) -> int:
        if sys.is_finalizing():
            return _DECLINED
        try:
            target = self.resolve(int(size))
            if target is None:
                return _DECLINED
            lc, tag = target
            drv = lc.driver
            if align and align > drv.granularity():
                raise ValueError(f"alignment {align} is larger than the {drv.name} granularity {drv.granularity()}")
            drv.prepare_thread()
            region = Region.allocate(drv, int(size), lc.chunk_bytes)
            try:
                lc.register_region(tag, region, int(size))
            except BaseException:
                region.free(drv)
                raise
            with self._mu:
                self._owner[region.va] = (lc, region)
            return region.va
        except BaseException as e:  # inside torch's allocator callback: counted, logged, and torch told it failed
            self.failures += 1
            log.error("whole-process capture could not allocate %d bytes: %s", size, e)
            return _FAILED

    def _on_free(self, ptr: int) -> None:
        if sys.is_finalizing():
            return
        try:
            with self._mu:
                hit = self._owner.pop(int(ptr), None)
            if hit is None:
                return
            lc, region = hit
            drv = lc.driver
            drv.prepare_thread()
            if lc.forget_region(int(ptr)) is None:  # the lifecycle is closed: it released the memory, left the address
                region.free(drv)
                return
            if region.mapped:
                drv.synchronize()  # in-flight work may still use it
            region.free(drv)
        except BaseException as e:  # inside torch's free callback, which cannot raise: logged
            log.error("whole-process capture could not free %#x: %s", int(ptr or 0), e)


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _maps_of(path: str) -> list[tuple[int, int]]:
    out = []
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and os.path.realpath(parts[5].strip()) == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def active() -> Optional[ProcessCapture]:
    """The capture installed in this process, if any."""
    return ProcessCapture._active
