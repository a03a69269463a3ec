"""A SIMULATED torch_npu (no NPU and no torch_npu here): only the calls ``pool(tag)`` makes,
with the behaviour of torch_npu 2.10.0.post4 that a caller can get wrong.

* ``_C._npu_customAllocator(alloc_ptr, free_ptr)`` keeps the two C callbacks, so the test calls
  them through C as torch_npu's caching allocator would.
* ``npu.memory._set_allocator_settings(s)`` accepts only the ``expandable_segments`` key: any
  other raises ``RuntimeError("torch_npu.npu.memory._set_allocator_settings() unsupported
  setting: <key>")``, and every call first resets ``max_split_size``, the garbage-collection
  threshold and the round-up divisions to their defaults (torch_npu ``NPUCachingAllocator.cpp``
  calls ``parseArgs(settings, {"expandable_segments"})``; ``CachingAllocatorConfig::parseArgs`` in
  ``NPUAllocatorConfig.cpp`` resets those three, then ``TORCH_CHECK``s each key against the
  supported set).  ``settings`` holds the allocator's settings as parsed (from the environment
  variable at construction, as torch_npu reads ``PYTORCH_NPU_ALLOC_CONF``).
* ``npu.memory.use_mem_pool(pool)`` nests as torch_npu's does: ``allocate(nbytes)`` (what
  ``torch.empty(..., device="npu")`` does) serves a cached free block of the pool begun FIRST on
  this thread, and a new segment is asked of the INNERMOST active pool's allocator, its blocks
  then cached in that first pool (``NPUCachingAllocator.cpp``: ``get_pool`` walks the active
  pools from the first begun; ``alloc_block``'s ``raw_alloc`` goes to the innermost pool's
  allocator).  ``free_block(ptr)`` returns a block to its pool's cache (no device free).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import types

SUPPORTED_AT_RUNTIME = {"expandable_segments"}
RESET_BY_EVERY_CALL = {"max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions"}
KNOWN = RESET_BY_EVERY_CALL | SUPPORTED_AT_RUNTIME | {
    "pinned_mem_register", "base_addr_aligned_kb", "page_size", "segment_size_mb"}


def parse(conf: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in conf.split(","))):
        key, _, value = part.partition(":")
        if key not in KNOWN:
            raise RuntimeError(f"Unrecognized CachingAllocator option: {key}")
        out[key] = value
    return out


class _Pool:
    def __init__(self, sim, allocator):
        self.sim, self.allocator = sim, allocator
        self.cached: list[tuple[int, int]] = []  # free blocks (ptr, size) kept by this pool
        sim.events.append(("MemPool", allocator))


class SimTorchNpu:
    """SIMULATED torch_npu 2.10.0.post4 (see the module docstring)."""

    __version__ = "2.10.0.post4 (simulated)"

    def __init__(self, settings: bool = True, env_var: str = "PYTORCH_NPU_ALLOC_CONF"):
        self.events: list[tuple] = []
        self.settings = parse(os.environ.get(env_var, ""))
        self._tls = threading.local()
        self._allocators: dict[str, tuple] = {}
        self._owner: dict[int, _Pool] = {}  # block -> pool caching it
        sim = self

        class C:
            @staticmethod
            def _npu_customAllocator(alloc_ptr, free_ptr):
                name = f"allocator{len(sim._allocators)}"
                alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(alloc_ptr)
                free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(free_ptr)
                sim._allocators[name] = (alloc, free)
                sim.alloc, sim.free = alloc, free  # the latest, for tests calling the callbacks directly
                return name

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            stack = sim._stack()
            stack.append(pool)
            sim.events.append(("enter pool",))
            try:
                yield
            finally:
                stack.remove(pool)
                sim.events.append(("exit pool",))

        memory = types.SimpleNamespace(MemPool=lambda allocator: _Pool(sim, allocator), use_mem_pool=use_mem_pool)
        if settings:
            memory._set_allocator_settings = self._set_allocator_settings
        self._C = C
        self.npu = types.SimpleNamespace(memory=memory)

    def _stack(self) -> list:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _set_allocator_settings(self, conf: str) -> None:
        self.events.append(("settings", conf))
        for key in RESET_BY_EVERY_CALL:
            self.settings.pop(key, None)
        parsed = {}
        for part in filter(None, (p.strip() for p in conf.split(","))):
            key, _, value = part.partition(":")
            if key not in SUPPORTED_AT_RUNTIME:
                raise RuntimeError(f"torch_npu.npu.memory._set_allocator_settings() unsupported setting: {key}")
            parsed[key] = value
        self.settings.update(parsed)

    def allocate(self, nbytes: int, device: int = 0) -> int:
        """A block of ``nbytes`` as torch_npu's caching allocator hands one out (see above);
        0 when the allocator refused."""
        stack = self._stack()
        if not stack:
            raise RuntimeError("SimTorchNpu.allocate models only allocations inside use_mem_pool")
        first, inner = stack[0], stack[-1]
        for i, (ptr, size) in enumerate(first.cached):
            if size >= nbytes:
                del first.cached[i]
                return ptr
        alloc, _ = self._allocators[inner.allocator]
        ptr = alloc(nbytes, device, None) or 0
        if ptr:
            self._owner[ptr] = first
        return ptr

    def free_block(self, ptr: int, nbytes: int) -> None:
        """The tensor died: its block goes back to the cache of the pool that served it."""
        self._owner[ptr].cached.append((ptr, nbytes))
