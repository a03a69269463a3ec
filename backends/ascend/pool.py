"""``pool(tag)`` on Ascend: torch_npu's pluggable allocator and ``MemPool`` route the
framework's own ``torch.empty(..., device="npu")`` calls into lifecycle regions.

The calls used, read in torch_npu's source (Ascend/pytorch, the 2.10 releases vllm-ascend pins):
``torch_npu._C._npu_customAllocator(alloc_fn_ptr, free_fn_ptr)`` (what ``NPUPluggableAllocator``
does after loading a .so; the callbacks are ``void* alloc(size_t, int device, aclrtStream)`` and
``void free(void*, size_t, int device, aclrtStream)``, ``NPUPluggableAllocator.h``),
``torch_npu.npu.memory.MemPool(allocator)``, ``torch_npu.npu.memory.use_mem_pool(pool)`` and
``torch_npu.npu.memory._set_allocator_settings`` ("Only support expandable_segments:True or False").

The callbacks are the shared :class:`~unisleep.backends._pool.TagAllocator`: they bind their
thread to the device with ``aclrtSetDevice`` and refuse a segment for another device than the
driver's.

**Expandable segments** — vllm-ascend turns ``expandable_segments:True`` on in
``PYTORCH_NPU_ALLOC_CONF`` unless vLLM runs with sleep mode, and its FAQ recommends it against
OOM — do not work in a pluggable pool, so inside ``pool(tag)`` they are switched off.  torch_npu's
``_set_allocator_settings`` accepts ONLY the ``expandable_segments`` key (any other raises
"unsupported setting", ``NPUCachingAllocator.cpp`` / ``NPUAllocatorConfig.cpp``) and every call
resets ``max_split_size_mb``, ``garbage_collection_threshold`` and ``roundup_power2_divisions``
to their defaults: unisleep sends exactly ``expandable_segments:False`` and, afterwards,
``expandable_segments:True`` — never the user's whole string — and refuses (before anything
changes) a setting string holding one of the three that a call would reset.  A torch_npu without
``_set_allocator_settings`` is refused with the fix.

**Nested pools** — vllm-ascend enters ``use_allocation_tag("sleep_persistent")`` inside the KV
cache's pool (DSA models).  torch_npu serves cached blocks from the pool begun first and asks
the innermost pool's allocator for new segments (``NPUCachingAllocator.cpp``), so two active
pools mix their tags.  Only one of unisleep's pools is active per thread: entering a pool
inside another suspends the outer one (its torch_npu context is left) and leaving the inner one
enters the outer one again.

NOT RUN ON AN NPU: the route is tested against a SIMULATED torch_npu module (tests/
test_ascend_sim.py) that hands the callbacks' addresses back so the test can call them as
torch_npu's caching allocator would; torch_npu's side has never run here.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator

from unisleep.backends._pool import FREE, MALLOC, TagAllocator, alloc_conf, expandable_on
from unisleep.errors import UnsupportedError

from .descriptor import BACKEND

#: where torch_npu reads its allocator settings, first match wins
CONF_VARS = BACKEND.alloc_conf_vars

_KEEP: list = []  # callbacks and pools live as long as the process: torch_npu may free late
_LOCK = threading.Lock()
_ACTIVE = threading.local()  # this thread's entered pools, innermost last: [(pool, torch_npu context)]

#: the one key torch_npu 2.10's ``_set_allocator_settings`` accepts at run time
RUNTIME_KEY = "expandable_segments"
#: settings every ``_set_allocator_settings`` call resets to their defaults (``parseArgs``)
RESET_BY_SETTINGS_CALL = ("max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the npu device)

        return torch_npu
    except ImportError as e:
        raise UnsupportedError(
            f"pool() on Ascend needs torch_npu ({e}); allocate with MemoryLifecycle.empty(..., tag=...) instead"
        ) from e


def _reset_keys(conf: str) -> list[str]:
    keys = [p.split(":", 1)[0].strip() for p in conf.split(",") if p.strip()]
    return [k for k in keys if k in RESET_BY_SETTINGS_CALL]


@contextlib.contextmanager
def _expandable_off(set_settings):
    """``expandable_segments:False`` while the block runs, ``expandable_segments:True`` after it
    (the user's settings turn them on; the caller checked nothing else would be reset)."""
    set_settings(f"{RUNTIME_KEY}:False")
    try:
        yield
    finally:
        set_settings(f"{RUNTIME_KEY}:True")


@contextlib.contextmanager
def _only_active(memory, pool) -> Iterator[None]:
    """``memory.use_mem_pool(pool)`` as this thread's only active torch_npu pool: an outer pool
    of unisleep's is left while this one is entered, and entered again afterwards."""
    stack = _ACTIVE.__dict__.setdefault("stack", [])
    if stack:
        stack[-1][1].__exit__(None, None, None)
    ctx = memory.use_mem_pool(pool)
    try:
        ctx.__enter__()
    except BaseException:
        if stack:
            stack[-1] = (stack[-1][0], _enter(memory, stack[-1][0]))
        raise
    stack.append((pool, ctx))
    try:
        yield
    finally:
        stack.pop()
        try:
            ctx.__exit__(None, None, None)
        finally:
            if stack:
                stack[-1] = (stack[-1][0], _enter(memory, stack[-1][0]))


def _enter(memory, pool):
    ctx = memory.use_mem_pool(pool)
    ctx.__enter__()
    return ctx


@contextlib.contextmanager
def npu_mem_pool(driver, lifecycle, tag: str, npu=None) -> Iterator[None]:
    """Route torch_npu's allocations made inside the block into ``tag`` (``npu``: the torch_npu
    module; tests pass a simulated one)."""
    npu = _torch_npu() if npu is None else npu
    memory = npu.npu.memory
    set_settings = getattr(memory, "_set_allocator_settings", None)
    conf = alloc_conf(CONF_VARS)
    expandable = expandable_on(conf)
    var = next((v for v in CONF_VARS if alloc_conf([v])), CONF_VARS[0])
    if expandable and set_settings is None:
        raise UnsupportedError(
            f"{var}={conf}: expandable segments do not work in a pluggable "
            f"pool, and this torch_npu ({getattr(npu, '__version__', '?')}) cannot switch them off at run time; "
            "remove expandable_segments:True from PYTORCH_NPU_ALLOC_CONF, or use torch_npu 2.10 or later")
    reset = _reset_keys(conf) if expandable else []
    if reset:
        raise UnsupportedError(
            f"{var}={conf}: expandable segments must be switched off inside pool({tag!r}), and torch_npu's "
            f"_set_allocator_settings resets {', '.join(reset)} at every call (it accepts only "
            f"{RUNTIME_KEY}), so your setting would be lost; remove {', '.join(reset)} or "
            f"expandable_segments:True from {var}. Nothing was changed")
    with _LOCK:
        hooks = TagAllocator(driver, lifecycle, tag, driver._set_device)
        alloc = MALLOC(lambda size, device, stream: hooks.malloc(size, device))
        free = FREE(lambda ptr, size, device, stream: hooks.free(ptr))
        allocator = npu._C._npu_customAllocator(ctypes.cast(alloc, ctypes.c_void_p).value,
                                                ctypes.cast(free, ctypes.c_void_p).value)
        pool = memory.MemPool(allocator)
        _KEEP.append((hooks, alloc, free, allocator, pool))
    outermost = not getattr(_ACTIVE, "stack", None)
    with (_expandable_off(set_settings) if expandable and outermost else contextlib.nullcontext()), \
            _only_active(memory, pool):
        yield
