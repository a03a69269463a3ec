"""unisleep's extra cleanup inside vllm-ascend's worker: it drives vllm-ascend's own.

vllm-ascend's ``NPUWorker`` builds a ``SleepWakeupManager`` (``device_allocator/
sleep_mem_optimized.py``) and runs it only when asked: ``additional_config.
enable_sleep_mode_extra_cleanup`` in vllm-ascend 0.23.0, ``additional_config.rl_config`` with both
``enabled`` and ``sleep_mode_extra_cleanup`` in later code.  On sleep, before ``CaMemAllocator.sleep``, it
waits for pending pipeline-parallel sends, synchronises, clears the ACL-graph attention
workspaces and graph state and destroys HCCL *in place* inside each ``GroupCoordinator``
(shared groups reference-counted, the gloo group kept); on wake, after the allocator's wake,
the saved buffers (and ``post_kv_cache_wake_up`` where it exists), it restores HCCL in the same coordinators,
refreshes the MoE communication groups and recaptures the graphs when the KV cache wakes.
unisleep's own policy (:mod:`unisleep.extra_cleanup`) creates new group objects and needs the
worker to register them — which ``NPUWorker`` never does.

So with ``UNISLEEP_EXTRA_CLEANUP=1`` and unisleep's allocator in the worker, the plugin wraps
``NPUWorker.sleep`` / ``wake_up`` to run the worker's own ``sleep_wakeup_manager`` in exactly
the places vllm-ascend runs it — unless vllm-ascend's own setting already makes it run (never
twice).  ``rl_config.enabled`` has other effects (FRACTAL_NZ off, expandable segments off,
``VLLM_SERVER_DEV_MODE``); this needs none of them.  Tested against vllm-ascend's released
source (tests/test_vllm_ascend_source.py); not run on an NPU.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("unisleep.ascend")

#: the platform plugin package (vLLM's current platform) this applies to
PLATFORM_PLUGIN = "vllm_ascend"
#: its worker module (under the package) and class
WORKER_MODULE = "worker.worker"
WORKER_CLASS = "NPUWorker"


def native_cleanup_on(module) -> bool:
    """Whether vllm-ascend itself runs its SleepWakeupManager, read through the worker module's
    own config getter as its worker reads it: ``rl_config.enabled and
    rl_config.sleep_mode_extra_cleanup`` where the config has ``rl_config`` (after the 0.23
    releases), else ``enable_sleep_mode_extra_cleanup`` (0.23.0)."""
    get_config = getattr(module, "get_ascend_config", None)
    try:
        cfg = get_config()
    except Exception:  # a vllm-ascend without this config: not an RL config
        return False
    rl = getattr(cfg, "rl_config", None)
    if rl is not None and hasattr(rl, "sleep_mode_extra_cleanup"):
        return bool(getattr(rl, "enabled", False) and rl.sleep_mode_extra_cleanup)
    return bool(getattr(cfg, "enable_sleep_mode_extra_cleanup", False))


def patch_worker(module, wanted: Callable[[object], bool]) -> bool:
    """Wrap ``NPUWorker.sleep`` / ``wake_up`` in ``module`` (idempotent): when ``wanted(worker)``
    and vllm-ascend does not run it already, the worker's ``sleep_wakeup_manager.sleep()`` runs
    before its sleep and ``.wakeup(tags)`` after its wake.  Returns whether it patched."""
    cls = getattr(module, WORKER_CLASS, None)
    if cls is None or getattr(cls.sleep, "_unisleep", False):
        return False
    sleep, wake_up = cls.sleep, cls.wake_up

    def patched_sleep(self, level: int = 1):
        drive = bool(wanted(self)) and not native_cleanup_on(module)
        manager = getattr(self, "sleep_wakeup_manager", None)
        if drive and manager is None:
            log.warning("UNISLEEP_EXTRA_CLEANUP=1: this %s has no sleep_wakeup_manager; nothing extra is freed",
                        WORKER_CLASS)
            drive = False
        if drive:
            manager.sleep()
        self._unisleep_cleanup_driven = drive
        return sleep(self, level)

    def patched_wake_up(self, tags=None):
        out = wake_up(self, tags)
        if getattr(self, "_unisleep_cleanup_driven", False):
            # every wake after a driven sleep, as vllm-ascend does: HCCL comes back at the first
            # (a no-op after that), graphs are recaptured by the wake that covers the KV cache
            self.sleep_wakeup_manager.wakeup(tags)
            if tags is None or "kv_cache" in tags:
                self._unisleep_cleanup_driven = False
        return out

    patched_sleep._unisleep = True  # type: ignore[attr-defined]
    patched_wake_up._unisleep = True  # type: ignore[attr-defined]
    cls.sleep, cls.wake_up = patched_sleep, patched_wake_up
    return True
