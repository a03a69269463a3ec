"""vLLM general plugin: registers unisleep's weight-transfer engine and sleep-mode backend.

Declared in pyproject as ``[project.entry-points."vllm.general_plugins"] unisleep =
"unisleep.vllm_plugin:register"``; vLLM calls :func:`register` in the API server, the engine core
and every worker before it builds either factory's product.  Select them with::

    --weight-transfer-config '{"backend": "unisleep"}'     # weight transfer over unisleep.transfer
    --sleep-mode-backend unisleep --enable-sleep-mode      # accelerators only; vLLM refuses
                                                           # sleep mode on CPU

``VLLM_PLUGINS`` is an allow-list: when it is set, it must name ``unisleep``.  :func:`register`
is idempotent (vLLM may call it several times per process, and it raises on duplicate names).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

NAME = "unisleep"
WEIGHT_TRANSFER_TARGET = ("unisleep.engines.vllm_weight_transfer", "UnisleepWeightTransferEngine")
SLEEP_BACKEND_TARGET = ("unisleep.engines.vllm_sleep_backend", "UnisleepSleepBackend")

_lock = threading.Lock()
_status: dict[str, str] = {}


def _register_weight_transfer() -> str:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except Exception as e:  # vLLM too old or absent
        return f"unavailable ({type(e).__name__}: {e})"
    try:
        WeightTransferEngineFactory.register_engine(NAME, *WEIGHT_TRANSFER_TARGET)
    except ValueError:  # already registered (by us, in an earlier call)
        return "registered (already)"
    return "registered"


def _register_sleep_backend() -> str:
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except Exception:
        log.info("unisleep: this vLLM has no SleepModeBackendFactory (needs the pluggable "
                 "sleep-mode backends, vLLM >= 0.32); the 'unisleep' sleep backend is skipped")
        return "unavailable (no SleepModeBackendFactory in this vLLM)"
    try:
        SleepModeBackendFactory.register_backend(NAME, *SLEEP_BACKEND_TARGET)
    except ValueError:
        return "registered (already)"
    return "registered"


def register() -> dict[str, str]:
    """Register both extensions with vLLM (safe to call any number of times).

    Returns what happened: ``{"weight_transfer": ..., "sleep_backend": ...}``.
    """
    with _lock:
        if not _status:
            _status["weight_transfer"] = _register_weight_transfer()
            _status["sleep_backend"] = _register_sleep_backend()
            log.debug("unisleep vLLM plugin: %s", _status)
        return dict(_status)


def status() -> dict[str, str]:
    """What :func:`register` did in this process (empty before it ran)."""
    with _lock:
        return dict(_status)


__all__ = ["register", "status", "NAME"]
