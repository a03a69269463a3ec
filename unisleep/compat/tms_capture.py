"""Whole-process capture behind the torch_memory_saver facade (:mod:`.torch_memory_saver`,
``TMS_INIT_ENABLE=1``): starting it, the tag each captured allocation goes to, the calling
thread's tms settings (what the capture reads) and its throwaway pool inside ``disable()`` — the
capture half of ``TorchMemorySaver``, as a base class beside :class:`.tms_lifecycles._SaverLifecycles`."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

from ..errors import UnsupportedError
from .tms_slots import CPU, DISK, NONE


class _SaverCapture:
    """``TorchMemorySaver``'s whole-process capture and per-thread tms settings (see the module)."""

    def _start_capture(self) -> None:
        """TMS_INIT_ENABLE=1: every allocation torch's allocator makes from a thread in an
        "interesting region" (every thread, from the start, unless it turns it off) goes into the
        thread's current tag — "default" outside ``region()`` — with the backup the environment
        asks for (TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_ENABLE_DISK_BACKUP)."""
        from ..backends._capture import ProcessCapture, active
        from ..registry import driver_class

        if self._impl is None:
            raise UnsupportedError(f"TMS_INIT_ENABLE=1 (whole-process capture) needs {self._native_problem}")
        spec = driver_class(self._platform.name).capture_spec
        if spec is None:
            raise UnsupportedError(
                f"TMS_INIT_ENABLE=1: the {self._platform.name} backend has no whole-process capture; unset it and wrap "
                "the allocations to pause in torch_memory_saver.region()")
        if active() is not None:
            raise UnsupportedError(
                "TMS_INIT_ENABLE=1: whole-process capture already runs in this process, for another TorchMemorySaver; "
                "use that one (the module's torch_memory_saver)")
        # the program may import torch_memory_saver before torch (tms's own training_engine example
        # does; tms hooks through LD_PRELOAD from the process's start): torch's allocator library
        # must be loaded before its slots can be rewritten
        import torch  # noqa: F401

        cap = ProcessCapture(spec, self._impl._binary_wrapper.cdll, self._capture_target)
        cap.install()
        self._capture = cap

    def _capture_target(self, size: int):
        """Called by the capture (inside torch's allocator): the lifecycle and tag of the calling
        thread's current settings; None (not captured) for unisleep's own threads and for what the
        facade itself allocates (backups read, copies made while pausing or resuming)."""
        if getattr(self._local, "busy", 0) or threading.current_thread().name.startswith("unisleep"):
            return None
        c = self._impl._binary_wrapper.cdll
        tag = c.tms_get_current_tag().decode("utf-8")
        kind = CPU if c.tms_get_enable_cpu_backup() else DISK if c.tms_get_enable_disk_backup() else NONE
        device = self._current_device()
        s = self._slots.get((kind, device, tag)) or self._slot(tag, kind, device, tag)
        return s.lc, s.ltag

    @contextlib.contextmanager
    def _own(self):
        """The facade's own work on this thread: what it allocates is never captured."""
        self._local.busy = getattr(self._local, "busy", 0) + 1
        try:
            yield
        finally:
            self._local.busy -= 1

    @contextlib.contextmanager
    def _thread_config(self, *, tag: Optional[str] = None, interesting: Optional[bool] = None,
                       cpu: Optional[bool] = None, backend: Optional[str] = None, disk: Optional[bool] = None):
        """The calling thread's tms settings changed inside (None: unchanged), restored after;
        the facade's own changes are not reported to its listener."""
        if self._impl is None:
            yield
            return
        bw, st = self._impl._binary_wrapper, self._state()
        old = bw.get_config()
        new = (old[0] if tag is None else tag, old[1] if interesting is None else interesting,
               old[2] if cpu is None else cpu, old[3] if backend is None else backend, old[4] if disk is None else disk)
        def apply(cfg) -> None:  # as get_config() orders them; the listener does not hear it
            st.quiet += 1
            try:
                bw.set_config(tag=cfg[0], interesting_region=cfg[1], enable_cpu_backup=cfg[2],
                              cpu_backup_backend=cfg[3], enable_disk_backup=cfg[4])
            finally:
                st.quiet -= 1

        apply(new)
        try:
            yield
        finally:
            apply(old)
            self._reroute(st)  # the routing follows the restored setting

    def _interesting_changed(self) -> None:
        """Someone else's code set this thread's interesting region (e.g. slime's DeepEP patch):
        a region's pool routing follows it (off: the thread's allocations are ordinary memory)."""
        st = self._state()
        if not st.quiet:
            self._reroute(st)

    @contextlib.contextmanager
    def _scratch_pool(self):
        """With whole-process capture on an accelerator: the calling thread allocates from a
        private pool inside, given back to the device at the end (tms's throwaway pool)."""
        if self._capture is None or not self._platform.is_accelerator:
            yield
            return
        scratch = self._lifecycle(self._current_device(), NONE).driver.digest_scratch()
        if scratch is None:
            yield
            return
        try:
            with scratch:
                yield
        finally:
            scratch.close()
