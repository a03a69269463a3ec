"""vLLM general plugin: registers unisleep's weight-transfer engine and sleep-mode backend, and
puts vLLM's sleep-mode memory into a :class:`~unisleep.MemoryLifecycle` when asked to.

Declared in pyproject as ``[project.entry-points."vllm.general_plugins"] unisleep =
"unisleep.vllm_worker.plugin:register"``; vLLM calls :func:`register` in the API server, the engine core
and every worker before it builds either factory's product.  Select them with::

    --weight-transfer-config '{"backend": "unisleep"}'     # weight transfer over unisleep.transfer
    --enable-sleep-mode --sleep-mode-backend unisleep      # vLLM >= 0.33 (the flag); accelerators
                                                           # only: vLLM refuses sleep mode on CPU

**The allocator.**  With ``--sleep-mode-backend unisleep``, vLLM's ``get_mem_allocator_instance()``
(and ``CuMemAllocator.get_instance()``, which the worker and the graph-capture code reach through
it) returns :class:`~unisleep.vllm_worker.allocator.UnisleepAllocator`: weights, KV cache,
runtime, workspace and graph memory live in one ``MemoryLifecycle`` per worker process.  The
choice is read from the worker's ``VllmConfig`` (``model_config.sleep_mode_backend``) the first
time the worker asks for a memory pool (a post-import hook wraps
``Worker._maybe_get_memory_pool_context``, which runs before vLLM sets its current config for
the weights) and then stays fixed for the process: memory never straddles two allocators.
``UNISLEEP_VLLM_ALLOCATOR=1`` forces it on (``0`` off) — the only way on vllm-ascend, whose
``NPUWorker`` calls ``CaMemAllocator`` directly (no sleep-mode backend there); there the plugin
makes ``CaMemAllocator.get_instance()`` return the same allocator on unisleep's Ascend driver, and
``UNISLEEP_EXTRA_CLEANUP=1`` adds the extra-cleanup policy (:mod:`unisleep.extra_cleanup`).

vLLM 0.33 keeps CUDA graphs out of the sleeping pool unless the backend is ``"cumem"``
(``VllmConfig.use_cumem_cudagraph_pool``); the plugin extends that property so that
``--sleep-mode-offload-cudagraph`` with the unisleep backend captures into the lifecycle's
graph pool (tag ``"cudagraph"``), offloaded at every level like vLLM's.

OpenRLHF's worker methods come through a vLLM general plugin of their own
(:func:`unisleep.integrations.openrlhf.vllm_plugin`, which uses :func:`patch_on_import`).

``VLLM_PLUGINS`` is an allow-list: when it is set, it must name ``unisleep``.  :func:`register`
is idempotent (vLLM may call it several times per process, and it raises on duplicate names).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Optional

from ..errors import UnsupportedError
from . import host_worker
from .allocator import ALLOCATOR_CLASSES, CUMEM_MODULES, DEVICE_ALLOCATOR_MODULES, PLUGIN_ALLOCATOR

log = logging.getLogger(__name__)

NAME = "unisleep"
WEIGHT_TRANSFER_TARGET = ("unisleep.vllm_worker.transfer_engine", "UnisleepWeightTransferEngine")
SLEEP_BACKEND_TARGET = ("unisleep.vllm_worker.sleep_backend", "UnisleepSleepBackend")
ALLOCATOR_ENV = "UNISLEEP_VLLM_ALLOCATOR"

SLEEP_BACKEND_MODULES = tuple(f"{m}.sleep_mode_backend" for m in DEVICE_ALLOCATOR_MODULES)
WEIGHT_TRANSFER_FACTORY_MODULES = ("vllm.backends.distributed.weight_transfer.factory",
                                   "vllm.distributed.weight_transfer.factory")
CONFIG_MODULES = ("vllm.foundation.config.vllm", "vllm.config.vllm")

_WORKER_MODULES = ("vllm.v1.worker.gpu_worker",)

_lock = threading.RLock()
_status: dict[str, str] = {}
_choice: Optional[bool] = None  # the process's allocator choice, once made
_patched: set[str] = set()


# ---------------------------------------------------------------------- the allocator choice
def _env_choice() -> Optional[bool]:
    from ..platform import env_flag

    return env_flag(ALLOCATOR_ENV)


def _config_choice(vllm_config) -> Optional[bool]:
    mc = getattr(vllm_config, "model_config", None)
    name = getattr(mc, "sleep_mode_backend", None)
    return None if name is None else name == NAME


def decide(vllm_config=None) -> Optional[bool]:
    """Make (once) and return the process's choice: True = unisleep's allocator.  The
    environment variable wins, then ``vllm_config`` (or vLLM's current config); None while
    neither says anything (nothing is decided then)."""
    global _choice
    with _lock:
        if _choice is not None:
            return _choice
        choice = _env_choice()
        if choice is None:
            if vllm_config is None:
                try:
                    from vllm.config import get_current_vllm_config_or_none

                    vllm_config = get_current_vllm_config_or_none()
                except Exception:  # vLLM versions without it, or outside a config context
                    vllm_config = None
            choice = _config_choice(vllm_config) if vllm_config is not None else None
        if choice is not None:
            _choice = choice
            log.info("unisleep: vLLM's sleep-mode memory %s", "lives in a unisleep MemoryLifecycle"
                     if choice else "stays in vLLM's allocator")
        return _choice


def select_allocator(enabled: Optional[bool]) -> None:
    """Set the process's choice explicitly (a harness or a test; ``None`` = undecided)."""
    global _choice
    with _lock:
        _choice = enabled


class PoolRoutingError(UnsupportedError):
    """vLLM's sleep-mode memory was to live in unisleep, but this process's driver cannot route
    torch's allocations into it (e.g. ROCm without a ROCm build of torch): every sleep would free
    nothing.  Raised when vLLM first asks for the allocator, before any memory is placed."""


def _allocator(**options):
    """The process's :class:`~unisleep.vllm_worker.allocator.UnisleepAllocator`, refused (fail
    closed) on an accelerator whose driver cannot route the framework's allocations: vLLM
    would place its weights and KV cache outside every tag and its sleeps would free 0 bytes."""
    from .allocator import UnisleepAllocator

    alloc = UnisleepAllocator.get_instance(**options)
    lc = alloc.lifecycle
    if lc.platform_name != "host" and not lc.driver.capabilities.supports_pool:
        raise PoolRoutingError(
            f"vLLM's sleep-mode memory cannot live in unisleep in this process: {lc.driver.pool_problem()}. "
            f"vLLM's allocations would stay outside every tag and each sleep would free nothing. Fix the "
            f"cause above, or run vLLM with its own sleep-mode allocator (unset {ALLOCATOR_ENV}, no "
            f"--sleep-mode-backend {NAME}).")
    return alloc


def _patch_allocator_class(module) -> None:
    cls_name = ALLOCATOR_CLASSES[module.__name__]
    cls = vars(module).get(cls_name)  # a shim module defines none: its canonical module is patched
    if cls is None or getattr(cls.get_instance, "_unisleep", False):
        return
    original = cls.get_instance
    # vLLM's CuMemAllocator wakes the deferrable tags it is asked for and every other tag;
    # a platform plugin's CaMemAllocator wakes exactly the tags named
    options = {} if module.__name__ in CUMEM_MODULES else {"deferrable_tags": None}

    def get_instance():
        if decide():
            return _allocator(**options)
        return original()

    get_instance._unisleep = True  # type: ignore[attr-defined]
    get_instance._original = original  # type: ignore[attr-defined]
    cls.get_instance = staticmethod(get_instance)
    _patched.add(module.__name__)


def _patch_worker(module) -> None:
    worker = getattr(module, "Worker", None)
    meth = getattr(worker, "_maybe_get_memory_pool_context", None)
    if meth is None or getattr(meth, "_unisleep", False):
        return

    def _maybe_get_memory_pool_context(self, tag):
        decide(getattr(self, "vllm_config", None))
        return meth(self, tag)

    _maybe_get_memory_pool_context._unisleep = True  # type: ignore[attr-defined]
    worker._maybe_get_memory_pool_context = _maybe_get_memory_pool_context
    _patched.add(module.__name__)


def _patch_device_allocator(module) -> None:
    """``vllm.device_allocator.get_mem_allocator_instance`` (looked up at call time by the
    sleep-mode backend): ours when chosen, also on platforms where vLLM has no allocator.  A
    shim module (vLLM main) is left alone: it forwards to the canonical module, patched itself."""
    if "get_mem_allocator_instance" not in vars(module):
        return
    fn = getattr(module, "get_mem_allocator_instance", None)
    if fn is None or getattr(fn, "_unisleep", False):
        return

    def get_mem_allocator_instance():
        if decide():
            return _allocator()
        return fn()

    get_mem_allocator_instance._unisleep = True  # type: ignore[attr-defined]
    get_mem_allocator_instance._original = fn  # type: ignore[attr-defined]
    module.get_mem_allocator_instance = get_mem_allocator_instance
    _patched.add(module.__name__)


def graph_pool_wanted(vllm_config) -> bool:
    """vLLM's ``use_cumem_cudagraph_pool`` test with the unisleep backend in place of cumem."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "sleep_mode_backend", None) != NAME:
        return False
    if not (getattr(mc, "sleep_mode_offload_cudagraph", False) and getattr(mc, "enable_sleep_mode", False)):
        return False
    try:
        CUDAGraphMode = _import_first(("vllm.foundation.config", "vllm.config")).CUDAGraphMode
        current_platform = _import_first(("vllm.backends.platform", "vllm.platforms")).current_platform

        mode = vllm_config.compilation_config.cudagraph_mode
        return mode != CUDAGraphMode.NONE and bool(current_platform.is_cuda_alike())
    except Exception:  # vLLM's config and platform differ by version: no graph pool
        return False


def _patch_config(module) -> None:
    cls = vars(module).get("VllmConfig")
    prop = getattr(cls, "use_cumem_cudagraph_pool", None) if cls is not None else None
    if not isinstance(prop, property) or getattr(prop.fget, "_unisleep", False):
        return
    original = prop.fget

    def use_cumem_cudagraph_pool(self) -> bool:
        return bool(original(self)) or graph_pool_wanted(self)

    use_cumem_cudagraph_pool._unisleep = True  # type: ignore[attr-defined]
    cls.use_cumem_cudagraph_pool = property(use_cumem_cudagraph_pool, doc=prop.__doc__)
    _patched.add(module.__name__)


_PATCHERS = {
    **{m: _patch_device_allocator for m in DEVICE_ALLOCATOR_MODULES},
    **{m: _patch_config for m in CONFIG_MODULES},
    **{m: _patch_allocator_class for m in ALLOCATOR_CLASSES},
    **{m: _patch_worker for m in _WORKER_MODULES},
    # vLLM's CPU worker: sleep mode on host memory (host_worker's docstring)
    **host_worker.patchers(decide, lambda: _allocator()),
}


class _PostImport(importlib.abc.MetaPathFinder):
    """Patches a module of :data:`_PATCHERS` right after it is imported (lazily: the plugin
    imports nothing of vLLM's worker or allocator itself)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHERS or fullname in _patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec):
                        return loader.create_module(spec)

                    def __getattr__(self, name):  # get_source, get_filename, ...
                        return getattr(loader, name)

                    def exec_module(self, module):
                        loader.exec_module(module)
                        try:
                            _PATCHERS[fullname](module)
                        except Exception as e:  # never break vLLM's import
                            log.warning("unisleep: could not patch %s: %s", fullname, e)

                spec.loader = _Loader()
                return spec
            if spec is not None:
                return None
        return None


_finder = _PostImport()


def _platform_plugin_package() -> Optional[str]:
    """The package of vLLM's current platform when it comes from an out-of-tree plugin."""
    try:
        from vllm.platforms import current_platform

        pkg = type(current_platform).__module__.split(".")[0]
    except Exception:  # a vLLM without this attribute: no platform plugin
        return None
    return None if pkg == "vllm" else pkg


def extra_cleanup_wanted(worker) -> bool:
    """``UNISLEEP_EXTRA_CLEANUP=1`` and unisleep's allocator chosen for this worker's process."""
    from .allocator import EXTRA_CLEANUP_ENV
    from ..platform import env_flag

    return bool(env_flag(EXTRA_CLEANUP_ENV)) and bool(decide(getattr(worker, "vllm_config", None)))


def _platform_worker_patchers(pkg: str) -> dict:
    """module -> patcher for a platform plugin's worker, from the backend that knows it (a
    backend descriptor's ``vllm_worker`` module naming ``PLATFORM_PLUGIN``): e.g. the extra
    cleanup inside vllm-ascend's worker drives vllm-ascend's own (backends/ascend/vllm_worker.py).
    Only the modules that exist are imported (their backends' vendor modules are not)."""
    from ..registry import backends

    out = {}
    for b in backends():
        if not b.has_module(b.vllm_worker):
            continue
        m = b.load(b.vllm_worker)
        if getattr(m, "PLATFORM_PLUGIN", None) == pkg:
            out[f"{pkg}.{m.WORKER_MODULE}"] = lambda module, m=m: m.patch_worker(module, extra_cleanup_wanted)
    return out


def install_allocator_hooks(plugin_package: Optional[str] = None) -> str:
    """Patch what is imported already and hook what is not.  Idempotent.  ``plugin_package``
    (default: the current platform's, when out of tree) adds that plugin's allocator class and,
    where a backend knows the plugin's worker, its worker patch."""
    with _lock:
        pkg = plugin_package or _platform_plugin_package()
        if pkg:
            mod = f"{pkg}.{PLUGIN_ALLOCATOR[0]}"
            ALLOCATOR_CLASSES[mod] = PLUGIN_ALLOCATOR[1]
            _PATCHERS[mod] = _patch_allocator_class
            _PATCHERS.update(_platform_worker_patchers(pkg))
        for name, patch in _PATCHERS.items():
            mod = sys.modules.get(name)
            if mod is not None:
                try:
                    patch(mod)
                except Exception as e:  # a failed patch is logged; vLLM then runs unpatched
                    log.warning("unisleep: could not patch %s: %s", name, e)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return "hooked"


def patch_on_import(name: str, patch) -> None:
    """Run ``patch(module)`` once on module ``name``: now when it is imported already, else right
    after its import (the same post-import hook as the allocator's; used by
    :func:`unisleep.integrations.openrlhf.install`)."""

    def once(module, patch=patch):
        _patched.add(module.__name__)
        patch(module)

    with _lock:
        _PATCHERS[name] = once
        mod = sys.modules.get(name)
        if mod is not None and name not in _patched:
            once(mod)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


# ---------------------------------------------------------------------- registration
def _import_first(names):
    """The first of ``names`` that imports (vLLM main's canonical path, then the released one);
    raises the last error when none does."""
    import importlib

    err: Optional[BaseException] = None
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            err = e
    raise err if err is not None else ImportError(names)


def _engine_session_api() -> Optional[bool]:
    """Whether this vLLM's weight-transfer engine base class owns the update session (>= 0.25)."""
    try:
        base = _import_first(("vllm.backends.distributed.weight_transfer.base",
                              "vllm.distributed.weight_transfer.base"))
    except Exception:  # any vLLM that cannot import it has no session API
        return None
    return hasattr(base.WeightTransferEngine, "start_weight_update")


def _register_weight_transfer() -> str:
    try:
        factory = _import_first(WEIGHT_TRANSFER_FACTORY_MODULES)
    except Exception as e:  # vLLM too old or absent
        return f"unavailable ({type(e).__name__}: {e})"
    legacy = _engine_session_api() is False
    try:
        factory.WeightTransferEngineFactory.register_engine(NAME, *WEIGHT_TRANSFER_TARGET)
        state = "registered"
    except ValueError:  # already registered (by us, in an earlier call)
        state = "registered (already)"
    if legacy:
        # registered all the same, so that selecting it fails with the error naming the fix
        # (transfer_engine.LEGACY_API_REFUSAL) rather than "invalid backend"
        log.info("unisleep: this vLLM's weight-transfer engine API has no update session (vLLM "
                 "0.24): the 'unisleep' engine refuses to load; use the worker extension "
                 "(worker_extension_cls=%s, VLLMWeightPusher(engine, route='extension'))",
                 "unisleep.vllm_worker.extension.UnisleepWorkerExtension")
        return f"{state}; refuses to load on this vLLM (engine API without update session, "\
               "vLLM < 0.25): use route='extension'"
    return state


def _register_sleep_backend() -> str:
    try:
        mod = _import_first(SLEEP_BACKEND_MODULES)
        factory = mod.SleepModeBackendFactory
    except Exception:  # vLLM < 0.25 (or a broken module): logged, the backend skipped
        log.info("unisleep: this vLLM has no SleepModeBackendFactory (pluggable sleep-mode "
                 "backends arrived in vLLM 0.25); the 'unisleep' sleep backend is skipped, the "
                 "allocator hooks (UNISLEEP_VLLM_ALLOCATOR=1) still apply")
        return "unavailable (no SleepModeBackendFactory in this vLLM: it arrived in 0.25)"
    try:
        factory.register_backend(NAME, *SLEEP_BACKEND_TARGET)
    except ValueError:
        return "registered (already)"
    return "registered"


def register() -> dict[str, str]:
    """Register both extensions with vLLM (safe to call any number of times).

    Returns what happened: ``{"weight_transfer": ..., "sleep_backend": ..., "allocator": ...}``.
    """
    with _lock:
        if not _status:
            _status["weight_transfer"] = _register_weight_transfer()
            _status["sleep_backend"] = _register_sleep_backend()
            _status["allocator"] = install_allocator_hooks()
            from .methods import register_worker_methods

            _status["worker_methods"] = register_worker_methods()  # memory figures by method name
            _log_summary()
            log.debug("unisleep vLLM plugin: %s", _status)
        return dict(_status)


def _log_summary() -> None:
    """One line, once per process: what of the integration this vLLM offers (the same facts
    ``unisleep doctor`` prints, from :func:`unisleep.vllm_worker.versions.feature_lines`)."""
    try:
        from .versions import feature_lines, installed_vllm_version

        version = installed_vllm_version()
        if version is None:
            return
        log.info("unisleep vLLM plugin on vLLM %s: %s", version,
                 "; ".join(line.strip() for line in feature_lines(version)))
    except Exception as e:  # never break vLLM's start for a log line
        log.debug("unisleep: no feature summary (%s)", e)


def status() -> dict[str, str]:
    """What :func:`register` did in this process (empty before it ran)."""
    with _lock:
        return dict(_status)


__all__ = ["register", "status", "NAME", "decide", "select_allocator", "PoolRoutingError", "extra_cleanup_wanted",
           "install_allocator_hooks", "graph_pool_wanted", "ALLOCATOR_ENV", "patch_on_import"]
