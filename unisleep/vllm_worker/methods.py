"""The methods unisleep gives vLLM's workers, called by name over ``collective_rpc`` (no callable
crosses vLLM's link, so ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is never needed), and what they
read in the worker's process."""

from __future__ import annotations

from typing import Optional

#: a method every vLLM worker gets: its sleep-mode allocator's awake bytes
WORKER_RESIDENT_BYTES = "unisleep_resident_bytes"
#: ... and the parameter names vLLM's level-2 retention matches its patterns against
WORKER_SLEEP_PARAMETER_NAMES = "unisleep_sleep_parameter_names"


def allocator_resident_bytes() -> Optional[int]:
    """Bytes vLLM's sleep-mode allocator holds awake in *this* process (all its pools and tags);
    None when the allocator cannot be read — also when its allocation records keep no sleep state
    (vllm-ascend's ``CaMemAllocator`` has no ``is_asleep``: counting them all as awake would
    overstate what is held)."""
    try:
        from vllm.device_allocator import get_mem_allocator_instance

        data = list(get_mem_allocator_instance().pointer_to_data.values())
    except Exception:  # no readable allocator in this worker: None, as documented
        return None
    if not all(hasattr(d, "is_asleep") for d in data):
        return None
    return sum(int(d.handle[1]) for d in data if not d.is_asleep)


def _worker_resident_bytes(self) -> Optional[int]:
    """Runs in a vLLM worker (``collective_rpc("unisleep_resident_bytes")``)."""
    return allocator_resident_bytes()


def _worker_sleep_parameter_names(self) -> Optional[list[str]]:
    """Runs in a vLLM worker (``collective_rpc("unisleep_sleep_parameter_names")``): the names
    vLLM's own ``Worker._get_sleep_parameters`` gives the model's parameters — the target's
    ``named_parameters()`` and ``draft.<name>`` for each draft parameter the target does not share
    — which ``sleep_preserve_parameter_names`` globs are matched against (vLLM >= 0.32).  None
    where the worker has no such method (older vLLM) or no model yet."""
    names = getattr(self, "_get_sleep_parameters", None)
    model = getattr(getattr(self, "model_runner", None), "model", None)
    if names is None or model is None:
        return None
    return sorted(names(model))


def register_worker_methods() -> str:
    """Give vLLM's workers the methods unisleep calls by name (idempotent; runs in each worker,
    from the unisleep vLLM plugin and the unisleep weight-transfer engine)."""
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except Exception as e:  # vLLM too old or absent
        return f"unavailable ({type(e).__name__}: {e})"
    for name, fn in ((WORKER_RESIDENT_BYTES, _worker_resident_bytes),
                     (WORKER_SLEEP_PARAMETER_NAMES, _worker_sleep_parameter_names)):
        if getattr(WorkerBase, name, None) is None:
            setattr(WorkerBase, name, fn)
    return "registered"


__all__ = ["WORKER_RESIDENT_BYTES", "WORKER_SLEEP_PARAMETER_NAMES", "allocator_resident_bytes",
           "register_worker_methods"]
