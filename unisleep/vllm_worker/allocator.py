"""vLLM's sleep-mode allocator on a :class:`~unisleep.MemoryLifecycle`.

:class:`UnisleepAllocator` offers what vLLM's GPU worker, its sleep-mode backend and its CUDA-graph
capture call on ``CuMemAllocator`` (``vllm/device_allocator/__init__.py`` ``MemAllocator`` protocol
plus ``cudagraph_pool()``), and what vllm-ascend's ``NPUWorker`` calls on ``CaMemAllocator``:

=====================================  =====================================================
vLLM call                              here
=====================================  =====================================================
``get_instance()``                     one allocator, so one ``MemoryLifecycle``, per process
``use_memory_pool(tag)``               ``lifecycle.pool(tag)`` (tag ``None`` = ``"default"``)
``cudagraph_pool()``                   a graph-capture pool id whose memory is tag
                                       ``"cudagraph"`` (``driver.graph_pool``)
``sleep(offload_tags)``                ``lifecycle.sleep``: the offload tags backed up,
                                       every other tag discarded (weights at level 1 only,
                                       because vLLM's backend names them only then)
``discard(tags)``                      ``lifecycle.discard`` of the awake ones
``wake_up(tags)``                      the named deferrable tags (weights, kv_cache) and
                                       every other tag; ``None`` = all
``get_current_usage()``                bytes allocated in the pools, asleep or not
=====================================  =====================================================

vLLM's semantics are kept exactly where they differ from the lifecycle's own rules:

* an allocation already asleep keeps its policy; a sleep or discard asking for another one logs
  vLLM's warning ("the existing policy was kept") instead of raising;
* tags vLLM names but never allocated (``"cudagraph"`` without graph offload, ``"runtime"``
  before the KV cache exists) are ignored, as vLLM's per-allocation loop ignores them;
* a wake of a tag that is not asleep, or unknown, does nothing.

What the lifecycle adds under vLLM: the persistent pinned backup arena, prepared while the engine
starts so that the first level-1 sleep copies at the speed of the steady ones (below), the keyed
skip of unchanged weights, the host-budget check before anything is released, the platform's
mapping policy (chunks on ROCm), the Ascend driver, and a report per operation
(:attr:`UnisleepAllocator.last_report`).

The backup room for the first sleep.  vLLM asks for this allocator only with sleep mode on (its
worker uses the pools only then), so a process that never sleeps pins nothing.  When the pool of
a tag that vLLM's level-1 sleep backs up (:data:`BACKED_UP_AT_LEVEL1`: weights, runtime, graph
memory, vllm-ascend's ``sleep_persistent``) closes, the room for every byte of those tags not yet
backed up is prepared in the background (the CUDA backend maps, faults in and page-locks its host
arena while the worker goes on: after the weights, vLLM profiles its memory); the next stage of the
start — the next pool of another tag (KV cache, runtime) or the graph-capture pool — first waits
for that preparation to finish, outside any capture, so that the captures never run beside it and
the first sleep finds its room.  ``prepare_backup=False`` (or ``UNISLEEP_PREPARE_BACKUP=0`` in the
worker's environment) turns this off: the first level-1 sleep then takes its room itself (slower:
docs/vllm.md), e.g. for an engine that only ever sleeps at level 2.  :attr:`UnisleepAllocator.backup_room`
says what was prepared and how long the start waited for it.

Limits.  ``use_memory_pool`` routes the framework's allocations only where the platform's driver
can (``driver.capabilities.supports_pool``: CUDA, Ascend).  On host memory (CPU) nothing routes torch's CPU
allocator: the context only sets :attr:`current_tag`, and memory enters a tag through the
lifecycle's own means (``allocator.lifecycle.empty(..., tag=...)`` / ``adopt``) — the unit tests
do that, and so does vLLM's CPU worker with ``UNISLEEP_VLLM_ALLOCATOR=1`` (:meth:`adopt_into`,
:mod:`unisleep.vllm_worker.host_worker`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator, Optional

from .. import graph_capture
from ..errors import InvalidArgumentError, UnsupportedError
from ..lifecycle.state import AWAKE, DISCARDED, OFFLOADED

log = logging.getLogger("unisleep.vllm")

#: vLLM's ``DEFERRABLE_TAGS``: a selective wake may leave these asleep; every other tag wakes
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")
#: vLLM's own allocator modules, by the name each vLLM gives them: vLLM main moved
#: ``vllm.device_allocator`` to ``vllm.backends.platform.device_allocator`` and left the old
#: names as shims (a module forwarding attribute reads; ``cumem`` and ``sleep_mode_backend`` as
#: ``sys.modules`` aliases), so the canonical module is the one patched; the released versions
#: (0.24-0.33) have only the old names
DEVICE_ALLOCATOR_MODULES = ("vllm.backends.platform.device_allocator", "vllm.device_allocator")
CUMEM_MODULES = tuple(f"{m}.cumem" for m in DEVICE_ALLOCATOR_MODULES)
#: vLLM's sleep-mode allocator classes the plugin redirects, module -> class name (an
#: out-of-tree platform plugin's own allocator, e.g. vllm-ascend's ``CaMemAllocator``, is added
#: by the plugin's ``install_allocator_hooks`` from the platform plugin's package name)
ALLOCATOR_CLASSES = {m: "CuMemAllocator" for m in CUMEM_MODULES}
PLUGIN_ALLOCATOR = ("device_allocator.camem", "CaMemAllocator")

DEFAULT_TAG = "default"
EXTRA_CLEANUP_ENV = "UNISLEEP_EXTRA_CLEANUP"
PREPARE_ENV = "UNISLEEP_PREPARE_BACKUP"
GRAPH_TAG = "cudagraph"  # vLLM's tag name for graph-capture memory
#: the tags vLLM's level-1 sleep backs up to host memory (vLLM's CuMemBackend: weights at level 1,
#: runtime and graph memory at every level; vllm-ascend's sleep_persistent always): the room the
#: first sleep needs
BACKED_UP_AT_LEVEL1 = ("weights", "runtime", GRAPH_TAG, "sleep_persistent")


class UnisleepAllocator:
    """vLLM's ``MemAllocator`` (and ``CuMemAllocator``/``CaMemAllocator`` extras) over one
    :class:`~unisleep.MemoryLifecycle`.  See the module docstring."""

    instance: "Optional[UnisleepAllocator]" = None
    default_tag: str = DEFAULT_TAG
    #: vllm-ascend's tag for memory that must survive every sleep (here: always backed up)
    sleep_persistent_tag: str = "sleep_persistent"
    _instance_lock = threading.Lock()

    def __init__(self, lifecycle=None, *, prepare_backup: Optional[bool] = None,
                 deferrable_tags: Optional[tuple[str, ...]] = DEFERRABLE_TAGS,
                 extra_cleanup: Optional[bool] = None, **lifecycle_options):
        """``prepare_backup``: prepare the first level-1 sleep's backup room while the engine
        starts (see the module docstring) — default: on, unless ``UNISLEEP_PREPARE_BACKUP=0``.
        ``deferrable_tags``: vLLM's selective-wake rule (a wake with tags also restores every
        tag not in this tuple); ``None`` = vllm-ascend's ``CaMemAllocator`` rule (a wake restores
        exactly the tags named).  ``extra_cleanup``: install the extra-cleanup policy
        (:mod:`unisleep.extra_cleanup`) on the lifecycle — default: ``UNISLEEP_EXTRA_CLEANUP=1``;
        the worker then registers its groups and graphs on :attr:`extra_cleanup`."""
        if prepare_backup is None:
            prepare_backup = _prepare_from_env()
        elif not isinstance(prepare_backup, bool):
            raise InvalidArgumentError(f"prepare_backup must be True, False or None (the environment's "
                                       f"{PREPARE_ENV}), got {prepare_backup!r}")
        if lifecycle is None:
            from ..lifecycle import MemoryLifecycle

            lifecycle_options.setdefault("device", _current_device_index())
            lifecycle = MemoryLifecycle(**lifecycle_options)
        elif lifecycle_options:
            raise InvalidArgumentError(
                "pass either a MemoryLifecycle or options to build one, not both: "
                f"got lifecycle and {sorted(lifecycle_options)}")
        self.lifecycle = lifecycle
        self.current_tag: str = DEFAULT_TAG
        self.prepare_backup = prepare_backup
        #: the first sleep's backup room: bytes asked for in all, how many times, the seconds the
        #: start waited for the preparation to finish, and the last error (None: none)
        self.backup_room = {"bytes": 0, "asked": 0, "wait_s": 0.0, "error": None}
        self._preparing = False
        self.deferrable_tags = None if deferrable_tags is None else tuple(deferrable_tags)
        self.last_report = None
        self._warned_no_route = False
        if extra_cleanup is None:
            from ..platform import env_flag

            extra_cleanup = bool(env_flag(EXTRA_CLEANUP_ENV))
        self.extra_cleanup = None
        if extra_cleanup:
            # the policy module sits above the engines; imported only when asked for
            from ..extra_cleanup import install_extra_cleanup

            self.extra_cleanup = install_extra_cleanup(lifecycle, enabled=True)

    # ------------------------------------------------------------------ singleton
    @classmethod
    def get_instance(cls, **options) -> "UnisleepAllocator":
        """The process's allocator (built on first use, with ``options``): vLLM assumes one per
        process."""
        with cls._instance_lock:
            if cls.instance is None:
                cls.instance = cls(**options)
            return cls.instance

    @classmethod
    def reset_instance(cls) -> None:
        """Close and forget the process's allocator (tests, or a process that starts over)."""
        with cls._instance_lock:
            inst, cls.instance = cls.instance, None
        if inst is not None:
            inst.close()

    # ------------------------------------------------------------------ allocation
    @contextlib.contextmanager
    def use_memory_pool(self, tag: Optional[str] = None) -> Iterator[None]:
        """Allocations made inside land in ``tag`` (vLLM: ``"weights"``, ``"kv_cache"``,
        ``"runtime"``, ``"workspace"``; ``None`` = ``"default"``).  Entering another tag than the
        weights first waits for the backup room prepared behind an earlier pool; closing a tag
        that a level-1 sleep backs up starts preparing its room (the module docstring)."""
        tag = DEFAULT_TAG if tag is None else tag
        if not isinstance(tag, str) or not tag:
            raise InvalidArgumentError(f"tag must be a non-empty string or None, got {tag!r}")
        if tag != "weights":  # the next stage of the start: the room prepared behind the weights first
            self._finish_backup_room()
        old, self.current_tag = self.current_tag, tag
        try:
            if self.lifecycle.driver.capabilities.supports_pool:
                with self.lifecycle.pool(tag):
                    yield
            else:
                if not self._warned_no_route:
                    self._warned_no_route = True
                    log.warning(
                        "the %s backend cannot route the framework's allocations: inside "
                        "use_memory_pool(%r) nothing is placed in the tag; allocate with "
                        "allocator.lifecycle.empty(..., tag=...) instead",
                        self.lifecycle.platform_name, tag)
                yield
        finally:
            self.current_tag = old
        if tag in BACKED_UP_AT_LEVEL1 and self.prepare_backup:
            self._prepare_backup_room()

    def adopt_into(self, tag: str, obj) -> None:
        """Move the storage of ``obj``'s tensors (a module, a mapping, a list of tensors) into
        ``tag``, in place (:meth:`~unisleep.MemoryLifecycle.adopt`): for a backend that cannot
        route the framework's allocations (host memory), what a pool's exit would have placed in
        the tag, once, when the framework has made it (:mod:`unisleep.vllm_worker.host_worker`).
        Then, as at a pool's exit, the first level-1 sleep's backup room is prepared for a tag
        that such a sleep backs up.  Refused (nothing moved) as ``adopt`` refuses."""
        if not isinstance(tag, str) or not tag:
            raise InvalidArgumentError(f"tag must be a non-empty string, got {tag!r}")
        if tag != "weights":
            self._finish_backup_room()
        self.lifecycle.adopt(obj, tag=tag)
        if tag in BACKED_UP_AT_LEVEL1 and self.prepare_backup:
            self._prepare_backup_room()

    def use_allocation_tag(self, tag: Optional[str] = None):
        """vllm-ascend's name for the same context (newer ``CaMemAllocator``)."""
        return self.use_memory_pool(tag)

    @contextlib.contextmanager
    def cudagraph_pool(self) -> Iterator[object]:
        """What ``vllm/compilation/cudagraph_pool.py`` calls: yields the pool id to capture into;
        the graphs' memory is tag ``"cudagraph"`` (offloaded at every level by vLLM's backend,
        restored in place, so replays stay valid).  The backup room prepared behind earlier pools
        is waited for first; unisleep's background device work (the backup arena's growth,
        releases behind a sleep) waits while the context is open."""
        graph_pool = getattr(self.lifecycle.driver, "graph_pool", None)
        if graph_pool is None:
            raise UnsupportedError(
                f"the {self.lifecycle.platform_name} backend has no graph-capture pool; run vLLM "
                "without --sleep-mode-offload-cudagraph (graphs then stay resident)")
        self._finish_backup_room()  # before the capture: the captures never run beside the preparation
        pool_id = graph_pool(self.lifecycle, GRAPH_TAG)
        old, self.current_tag = self.current_tag, GRAPH_TAG
        try:
            with graph_capture.capture():  # no background device work while vLLM captures
                yield pool_id
        finally:
            self.current_tag = old

    def get_current_usage(self) -> int:
        """Bytes allocated in the pools, awake or asleep (vLLM asserts 0 before loading weights)."""
        return self.lifecycle.allocated_bytes()

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, offload_tags=None) -> None:
        """vLLM's ``allocator.sleep``: ``offload_tags`` backed up, everything else discarded."""
        offload = set(_tag_tuple(offload_tags, (DEFAULT_TAG,))) | {self.sleep_persistent_tag}
        lc = self.lifecycle
        state = lc.state()
        conflict = False
        keep_offloaded = []
        for tag, st in state.items():
            if st == AWAKE:
                continue
            requested = tag in offload
            if requested != (st == OFFLOADED):
                conflict = True
            if st == OFFLOADED:
                keep_offloaded.append(tag)
        # the lifecycle offloads "weights" at level 1 and discards them at level 2; an asleep
        # weights tag keeps its policy (vLLM: the existing policy is kept)
        w = state.get("weights")
        if w == OFFLOADED:
            level = 1
        elif w == DISCARDED:
            level = 2
        else:
            level = 1 if "weights" in offload else 2
        awake_offload = [t for t in offload if state.get(t) == AWAKE and t != "weights"]
        tags = sorted(set(awake_offload) | {t for t in keep_offloaded if t != "weights"})
        if any(st == AWAKE for st in state.values()):
            self.last_report = lc.sleep(level, offload_tags=tags)
        if conflict:
            log.warning("UnisleepAllocator: sleep cannot change the policy of already-asleep "
                        "allocations; the existing policy was kept.")

    def discard(self, tags) -> None:
        """vLLM's ``allocator.discard``: release the awake allocations of ``tags`` with no backup."""
        tags = _tag_tuple(tags, None)
        state = self.lifecycle.state()
        if any(state.get(t) == OFFLOADED for t in tags):
            log.warning("UnisleepAllocator: discard cannot change the policy of already-asleep "
                        "allocations; the existing policy was kept.")
        todo = [t for t in tags if state.get(t) == AWAKE]
        if todo:
            self.last_report = self.lifecycle.discard(todo)

    def wake_up(self, tags=None) -> None:
        """vLLM's ``allocator.wake_up``: ``None`` wakes everything; otherwise the named deferrable
        tags and every tag that is not deferrable (runtime, cudagraph, workspace, default)."""
        state = self.lifecycle.state()
        if tags is None:
            todo = [t for t, s in state.items() if s != AWAKE]
        else:
            if isinstance(tags, str):
                raise InvalidArgumentError(f"tags must be a list of tags, not the string {tags!r}")
            want = set(tags)
            if self.deferrable_tags is None:  # vllm-ascend: exactly the tags named
                want.add(self.sleep_persistent_tag)
                todo = [t for t, s in state.items() if s != AWAKE and t in want]
            else:
                todo = [t for t, s in state.items()
                        if s != AWAKE and (t in want or t not in self.deferrable_tags)]
        if todo:
            self.last_report = self.lifecycle.wake_up(todo)

    # ------------------------------------------------------------------ extras
    def resident_bytes(self, tag: Optional[str] = None) -> int:
        return self.lifecycle.resident_bytes(tag)

    def release_pools(self) -> None:
        """vLLM calls this on ``CuMemAllocator.instance`` at shutdown; the lifecycle's driver
        releases its pools before their allocators when it closes."""

    def close(self) -> None:
        self.lifecycle.close()

    def _prepare_backup_room(self) -> None:
        """Start preparing, in the background, the room for every byte of the tags a level-1
        sleep backs up that has no backup yet."""
        lc = self.lifecycle
        try:
            tags = lc.tags
            need = sum(lc.allocated_bytes(t) for t in BACKED_UP_AT_LEVEL1 if t in tags) - lc.backup_bytes()
            if need <= 0:
                return
            lc.prepare_backup(need, background=True)
        except Exception as e:  # the first sleep then takes its room itself, or says why it cannot
            self.backup_room["error"] = f"{type(e).__name__}: {e}"
            log.warning("could not prepare the backup room of the first level-1 sleep ahead: %s", e)
            return
        self._preparing = True
        self.backup_room["bytes"] = need + lc.backup_bytes()
        self.backup_room["asked"] += 1

    def _finish_backup_room(self) -> None:
        """Wait for the preparation started behind an earlier pool (not on a thread that is
        capturing, and not while another thread captures: the preparation waits for captures)."""
        if not self._preparing or graph_capture.capturing_here() or graph_capture.underway():
            return
        self._preparing = False
        wait = getattr(self.lifecycle.backup_store, "wait_prepared", None)
        if wait is None:  # a store with nothing to prepare in the background
            return
        t0 = time.perf_counter()
        try:
            wait()
        except Exception as e:  # the first sleep then takes its room itself, or says why it cannot
            self.backup_room["error"] = f"{type(e).__name__}: {e}"
            log.warning("the backup room prepared for the first level-1 sleep could not be completed: %s", e)
        finally:
            self.backup_room["wait_s"] += time.perf_counter() - t0


def _tag_tuple(tags, default) -> tuple[str, ...]:
    if tags is None:
        if default is None:
            raise InvalidArgumentError("tags must be given (a tuple of tag names)")
        return tuple(default)
    if isinstance(tags, str):
        return (tags,)
    out = tuple(tags)
    for t in out:
        if not isinstance(t, str) or not t:
            raise InvalidArgumentError(f"tags must be non-empty strings, got {t!r}")
    return out


def _prepare_from_env() -> bool:
    """``UNISLEEP_PREPARE_BACKUP``: unset = on; 1/true/yes/on or 0/false/no/off; anything else is
    refused (before any memory is touched), naming the values."""
    import os

    from ..platform import env_flag

    raw = os.environ.get(PREPARE_ENV, "").strip()
    flag = env_flag(PREPARE_ENV)
    if raw and flag is None:
        raise InvalidArgumentError(f"{PREPARE_ENV}={raw!r} is not understood: set it to 1 (prepare the first "
                                   "level-1 sleep's host backup room while the engine starts, the default) or 0 "
                                   "(the first sleep takes it), or unset it")
    return flag is not False


def _current_device_index() -> int:
    try:
        import torch

        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            return int(acc.current_device_index())
    except Exception:  # no usable accelerator in torch here: device 0
        pass
    return 0


__all__ = ["UnisleepAllocator", "DEFERRABLE_TAGS", "EXTRA_CLEANUP_ENV", "PREPARE_ENV", "BACKED_UP_AT_LEVEL1",
           "vllm_weights_asleep"]


def vllm_weights_asleep() -> tuple[Optional[bool], str]:
    """Whether the weights of this vLLM worker process are asleep, read from the sleep-mode
    allocator that holds them: ``(True|False, where it was read)``, or ``(None, why not)`` when
    no allocator can tell (the caller then refuses — it fails closed).

    What each allocator records: unisleep's lifecycle keeps every tag's state; vLLM's
    ``CuMemAllocator`` marks each allocation ``is_asleep``; vllm-ascend's ``CaMemAllocator``
    keeps no sleep state — its ``sleep`` sets an allocation's ``cpu_backup_tensor`` only when it
    offloads it (level 1: the weights) and ``wake_up`` clears it, while an allocation it discards
    (level 2) looks exactly like an awake one.  So with CaMem: a weights backup means asleep;
    no backup cannot be told from a level-2 sleep, and is refused (run the engine with
    ``UNISLEEP_VLLM_ALLOCATOR=1`` so the weights live in a unisleep lifecycle)."""
    inst = UnisleepAllocator.instance
    if inst is not None:
        st = inst.lifecycle.state().get("weights")
        if st is None:
            return None, "the unisleep allocator holds no 'weights' tag"
        return st != AWAKE, f"unisleep allocator: weights {st}"
    problems = []
    allocs = []
    try:
        from vllm.device_allocator import get_mem_allocator_instance

        allocs.append(get_mem_allocator_instance())
    except Exception as e:  # reported as a problem, whatever vLLM raised
        problems.append(f"get_mem_allocator_instance(): {type(e).__name__}: {e}")
    import sys

    for mod, cls_name in list(ALLOCATOR_CLASSES.items()):  # a platform plugin's own
        cls = getattr(sys.modules.get(mod), cls_name, None)
        if cls is not None and getattr(cls, "instance", None) is not None:
            allocs.append(cls.instance)
    for alloc in allocs:
        name = type(alloc).__name__
        data = getattr(alloc, "pointer_to_data", None)
        if data is None:
            problems.append(f"{name} has no pointer_to_data")
            continue
        weights = [d for d in list(data.values()) if getattr(d, "tag", None) == "weights"]
        if not weights:
            problems.append(f"{name} holds no 'weights' allocation")
            continue
        if all(hasattr(d, "is_asleep") for d in weights):  # vLLM's CuMemAllocator
            return any(bool(d.is_asleep) for d in weights), f"{name}: {len(weights)} weights allocation(s)"
        if all(hasattr(d, "cpu_backup_tensor") for d in weights):  # vllm-ascend's CaMemAllocator
            backed = sum(1 for d in weights if d.cpu_backup_tensor is not None)
            if backed:
                return True, f"{name}: {backed} of {len(weights)} weights allocation(s) offloaded to host memory"
            problems.append(f"{name} records no sleep state: its {len(weights)} weights allocation(s) have no host "
                            "backup, which is both what awake weights and weights discarded by a level-2 sleep look "
                            "like; run the engine with UNISLEEP_VLLM_ALLOCATOR=1 so that unisleep's lifecycle holds "
                            "the weights and knows their state")
            continue
        problems.append(f"{name}'s allocation records ({type(weights[0]).__name__}) say nothing about sleep")
    return None, "; ".join(problems) or "no sleep-mode allocator in this process"
