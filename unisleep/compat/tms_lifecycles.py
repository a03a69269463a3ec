"""The lifecycles behind the torch_memory_saver facade (:mod:`.torch_memory_saver`): one per
device and backup kind, a slot per tag in them, the routing of a thread's allocations into the
current slot's pool, and the margin and backup-room checks — the private half of
``TorchMemorySaver``, as a base class."""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Optional

from ..errors import InsufficientMemoryError, InvalidArgumentError, InvalidTransitionError
from ..platform import env_flag
from ..units import human_bytes
from .tms_slots import DISK, NONE, _Slot

log = logging.getLogger("unisleep.compat")

_BACKENDS = ("mmap", "pinned")


class _SaverLifecycles:
    """``TorchMemorySaver``'s lifecycles, slots and allocation routing (see the module)."""

    def _check_backend(self, enable_cpu_backup, cpu_backup_backend) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in _BACKENDS:
            raise InvalidArgumentError(f"cpu_backup_backend must be 'pinned' or 'mmap', got {cpu_backup_backend!r}")

    def _current_device(self) -> int:
        if not self._platform.is_accelerator:
            return 0
        import torch

        return int(torch.get_device_module(self._platform.torch_device_type).current_device())

    def _lifecycle(self, device: int, kind: str):
        """The lifecycle of ``device`` for a backup kind: one for CPU-backed and unbacked tags,
        one per disk backup directory for disk-backed tags (its spill directory), so a
        directory set later applies to the tags first used after it."""
        key = (device, (self._disk_dir or "") if kind == DISK else None)
        lc = self._lcs.get(key)
        if lc is None:
            lc = self._lcs[key] = self._new_lifecycle(device, key[1])
        return lc

    def _new_lifecycle(self, device: int, disk_dir: Optional[str]):
        """``disk_dir``: None for the lifecycle of CPU-backed and unbacked tags, else the disk
        backup directory ("" for the lifecycle's default spill directory)."""
        from ..lifecycle import MemoryLifecycle

        if disk_dir is None:  # CPU backups (and none): freed at resume unless retained, as tms does
            lc = MemoryLifecycle(self._platform, device=device, host_backups="keep" if self._retain else "release")
            lc.on_free(_forget_zero_copy(self))
            return lc
        # tms's layout: one file per disk-backed allocation directly in the directory, on every
        # platform (accelerators write through a host staging buffer), removed at resume
        return MemoryLifecycle(self._platform, device=device, spill_dir=disk_dir or None, backup_to="disk",
                               spill_layout="flat", host_backups="release")

    def _slot(self, tag: str, kind: str, device: int, ltag: str) -> _Slot:
        key = (kind, device, ltag)
        with self._lock:
            s = self._slots.get(key)
            if s is None:
                lc = self._lifecycle(device, kind)
                name = ltag
                if any(o.lc is lc and o.ltag == name for o in self._slots.values()):
                    name = f"{ltag}/{kind}-backup"  # tms lets one tag mix regions with and without backup
                s = self._slots[key] = _Slot(tag, kind, device, name, lc)
            return s

    def _prepare_backup(self, slot: _Slot) -> None:
        """With ``UNISLEEP_TMS_PREPARE_BACKUP=1``, at the end of a backed-up region: take the
        host room of every backed-up tag of its lifecycle now, so the first pause only copies
        (tms pins its host buffer inside the first pause, which is the default here too).  It
        is done before the region returns, never in a background thread: a graph capture in the
        default (global) mode forbids "potentially unsafe" driver calls from every thread, and a
        host-memory registration beside a capture is the likely cause of a failed one seen on
        an H200."""
        if slot.kind == NONE or env_flag("UNISLEEP_TMS_PREPARE_BACKUP") is not True:
            return
        lc = slot.lc
        with self._lock:
            backed = sum(lc.allocated_bytes(s.ltag) for s in self._slots.values()
                         if s.lc is lc and s.kind != NONE and s.ltag in lc.tags)
        need = backed - lc.backup_bytes() if backed else 0
        if need <= 0:
            return
        try:
            lc.prepare_backup(need, background=False)
        except Exception as e:  # the first pause then takes the room itself (or says why it cannot)
            self._say_once("prepare", f"could not prepare the host backup of tag {slot.tag!r} ahead: {e}")

    def _targets(self, tag: Optional[str]) -> list[_Slot]:
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgumentError(f"tag must be a string or None, got {tag!r}")
        # slots without allocations yet are not tags of their lifecycle: nothing to do (as in tms)
        return [s for s in self._slots.values() if (tag is None or s.tag == tag) and s.ltag in s.lc.tags]

    def _state(self):
        st = self._local
        if not hasattr(st, "stack"):
            st.stack, st.active = [], None  # stack of (slot, routes) and (None, False) for disable()
            st.quiet = 0  # > 0 while the facade itself changes the thread's tms settings
        return st

    # At most one pool routing is active per thread: the innermost region's.  Entering a nested
    # region, a graph capture or disable() switches the outer routing off, leaving switches it
    # back on, so pool contexts are never nested (torch's allocator picks the first matching
    # pool when several are active, and a nested pool's exit aborted under torch 2.11).
    def _route_off(self, st) -> None:
        ctx, st.active = st.active, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _wanted_route(self, st) -> bool:
        """Whether the innermost entry of this thread's stack routes into its tag now: a region
        on a backend with a pool, while the thread's interesting region is on."""
        if not st.stack or not st.stack[-1][1]:
            return False
        # turned off inside the region (e.g. by slime's DeepEP patch): not captured, as in tms
        return self._impl is None or bool(self._impl._binary_wrapper.cdll.tms_get_interesting_region())

    def _route_on(self, st) -> None:
        if st.active is not None or not self._wanted_route(st):
            return
        slot = st.stack[-1][0]
        ctx = slot.lc.pool(slot.ltag)
        ctx.__enter__()
        st.active = ctx

    def _reroute(self, st) -> None:
        """Make the routing match the stack and the thread's setting (no change when it does)."""
        if (st.active is not None) != self._wanted_route(st):
            self._route_off(st)
            self._route_on(st)

    @contextlib.contextmanager
    def _pushed(self, slot: Optional[_Slot], route: bool):
        st = self._state()
        self._route_off(st)
        st.stack.append((slot, route))
        try:
            self._route_on(st)
        except BaseException:
            st.stack.pop()
            self._route_on(st)
            raise
        try:
            yield
        finally:
            self._route_off(st)
            st.stack.pop()
            self._route_on(st)

    def _current_slot(self, what: str) -> Optional[_Slot]:
        self._ensure_initialized()
        st = self._state()
        if not st.stack:
            raise InvalidTransitionError(
                f"torch_memory_saver.{what}() is called outside a region; call it inside "
                f"`with torch_memory_saver.region(tag=...):`"
            )
        return st.stack[-1][0]  # None inside disable()

    def _check_margin(self, lc, nbytes: int) -> None:
        if self._margin <= 0:
            return
        free, _ = lc.driver.memory_info()
        if self._margin + nbytes > free:
            raise InsufficientMemoryError(
                f"{human_bytes(nbytes)} asked for, but only {human_bytes(free)} is free and memory_margin_bytes keeps "
                f"{human_bytes(self._margin)} free; lower memory_margin_bytes or free memory first. Nothing was allocated."
            )

    def _empty(self, slot: Optional[_Slot], shape, dtype):
        import torch

        if slot is None:  # inside disable(): ordinary memory
            dev = self._platform.torch_device(self._current_device())
            return torch.zeros(shape, dtype=dtype, device=dev)
        elem = torch.empty((), dtype=dtype if dtype is not None else torch.float32).element_size()
        numel = 1
        for s in (tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
            numel *= int(s)
        self._check_margin(slot.lc, numel * elem)
        return slot.lc.empty(shape, dtype, tag=slot.ltag)

    def _adopt(self, slot: Optional[_Slot], obj):
        if slot is None:
            return obj  # disable(): nothing moves into a tag
        return slot.lc.adopt(obj, tag=slot.ltag)

    def _say_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", msg)


def _forget_zero_copy(saver):
    """The lifecycle's free listener: when an allocation is freed (e.g. torch gave a pool's
    segment back), the host tensors ``get_cpu_backup(zero_copy=True)`` handed out for it are
    forgotten, so their host memory goes back to the system once the caller holds none (tms
    frees an allocation's CPU backup with the allocation).  Lock-free: it runs inside the
    allocator's free callback."""
    ref = weakref.ref(saver)

    def freed(va: int, size: int) -> None:
        s = ref()
        if s is not None:
            for key in [k for k in list(s._zero_copy) if va <= k[0] < va + size]:
                s._zero_copy.pop(key, None)

    return freed

