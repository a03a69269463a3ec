"""The first level-1 sleep inside vLLM finds its backup room prepared: the vLLM allocator
(``UnisleepAllocator``, in the order vLLM's GPU worker calls it) prepares the room for every tag
that sleep backs up — weights, runtime, graph memory — while the engine starts, and the next stage
of the start waits for the preparation to finish before it goes on (so no graph capture runs
beside it).

The lifecycle is the host backend's (real memfd memory) with the CUDA backend's pinned host arena
as its backup store: the arena's real grower maps and faults in real memory on its threads; only
its page-locking call, ``cuMemHostRegister``, which needs an NVIDIA driver, is **simulated** (it
takes a fixed time per segment, as tests/test_arena_growth.py does).  The sleep itself is not run
here (the arena copies with CUDA streams): tests/cuda/test_vllm_contract.py runs the whole path on
a GPU."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from unisleep import MemoryLifecycle, graph_capture
from unisleep.backends.cuda import arena as ar
from unisleep.backends.host.driver import HostDriver
from unisleep.errors import InvalidArgumentError
from unisleep.vllm_worker.allocator import BACKED_UP_AT_LEVEL1, UnisleepAllocator
from unisleep.vllm_worker.sleep_backend import OFFLOAD_ALWAYS  # imports vLLM's base class where vLLM is installed

MiB = 1 << 20
SEG = 8 * MiB
REGISTER_S = 0.05  # simulated page-locking time per segment


@pytest.fixture
def lifecycle(monkeypatch, tmp_path):
    monkeypatch.setattr(ar, "SEGMENT", SEG)

    class Arena(ar.PinnedArena):
        def __init__(self):
            super().__init__(0, None)
            self.registered: list[tuple[float, int]] = []  # (when, bytes) per segment
            self._lk = threading.Lock()

        def _page_lock(self, addr, size):  # SIMULATED: cuMemHostRegister needs an NVIDIA driver
            time.sleep(REGISTER_S)
            with self._lk:
                self.registered.append((time.perf_counter(), size))
            return ar.Segment(addr, size, [(0, size)], 0)

    class Driver(HostDriver):
        # backups kept after a wake, as on CUDA (what the arena is for); no sleep runs here
        capabilities = dataclasses.replace(HostDriver.capabilities, retain_backups=True)

        def new_backup_store(self, budget_bytes, spill_dir):
            return Arena()

    lc = MemoryLifecycle(Driver(), spill_dir=str(tmp_path))
    yield lc
    lc.close()


def _load(a, tag, n):
    """What the worker does on the host backend: allocate inside use_memory_pool(tag)."""
    with a.use_memory_pool(tag):
        return a.lifecycle.empty((n,), torch.uint8, tag=tag)


def test_the_room_of_every_backed_up_tag_is_ready_before_the_start_goes_on(lifecycle, monkeypatch):
    """weights (40 MiB, 5 segments) then KV cache, runtime, workspace: the weights' room grows
    behind the load (the worker is not held up when their pool closes), the KV cache's pool waits
    until it is all there, the runtime's room is added when its pool closes and is there before
    the next stage; the KV cache and the workspace get none (a level-1 sleep discards them)."""
    monkeypatch.delenv("UNISLEEP_PREPARE_BACKUP", raising=False)
    assert set(BACKED_UP_AT_LEVEL1) == {"weights", *OFFLOAD_ALWAYS, "sleep_persistent"}
    arena = lifecycle.backup_store
    a = UnisleepAllocator(lifecycle)
    t0 = time.perf_counter()
    _load(a, "weights", 40 * MiB)
    closed = time.perf_counter()
    assert closed - t0 < 5 * REGISTER_S, "the weights' pool closed only once their room was ready"
    with a.use_memory_pool("kv_cache"):
        entered = time.perf_counter()
        assert arena.capacity >= 40 * MiB, f"the KV cache's pool began with {arena.capacity / MiB:.0f} MiB of room"
        a.lifecycle.empty((64 * MiB,), torch.uint8, tag="kv_cache")
    assert entered - closed >= 3 * REGISTER_S  # it waited for the growth started behind the weights
    _load(a, "runtime", 6 * MiB)
    with a.use_memory_pool("workspace"):
        assert arena.capacity >= 46 * MiB, f"the runtime's room was not ready: {arena.capacity / MiB:.0f} MiB"
        a.lifecycle.empty((MiB,), torch.uint8, tag="workspace")
    assert arena.capacity == sum(n for _, n in arena.registered) == 46 * MiB  # nothing for KV cache or workspace
    assert a.backup_room["bytes"] == 46 * MiB and a.backup_room["asked"] == 2 and a.backup_room["error"] is None
    assert a.backup_room["wait_s"] >= 3 * REGISTER_S


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_nothing_is_pinned_when_turned_off(lifecycle, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("UNISLEEP_PREPARE_BACKUP", "0")
        a = UnisleepAllocator(lifecycle)
    else:
        monkeypatch.delenv("UNISLEEP_PREPARE_BACKUP", raising=False)
        a = UnisleepAllocator(lifecycle, prepare_backup=False)
    _load(a, "weights", 16 * MiB)
    _load(a, "kv_cache", 16 * MiB)
    _load(a, "runtime", MiB)
    time.sleep(2 * REGISTER_S)
    assert lifecycle.backup_store.capacity == 0 and a.backup_room["asked"] == 0


def test_a_bad_setting_is_refused_before_anything(lifecycle, monkeypatch):
    monkeypatch.setenv("UNISLEEP_PREPARE_BACKUP", "sometimes")
    with pytest.raises(InvalidArgumentError, match="UNISLEEP_PREPARE_BACKUP='sometimes'.*set it to 1"):
        UnisleepAllocator(lifecycle)
    monkeypatch.delenv("UNISLEEP_PREPARE_BACKUP")
    with pytest.raises(InvalidArgumentError, match="prepare_backup must be True, False or None"):
        UnisleepAllocator(lifecycle, prepare_backup="yes")
    assert lifecycle.tags == []


def test_the_start_does_not_wait_on_a_capturing_thread(lifecycle, monkeypatch):
    """A pool entered while this thread captures a graph does not wait for the preparation (which
    itself waits for the capture to end): it is waited for at the next stage instead."""
    monkeypatch.delenv("UNISLEEP_PREPARE_BACKUP", raising=False)
    a = UnisleepAllocator(lifecycle)
    _load(a, "weights", 24 * MiB)
    with graph_capture.capture():
        t0 = time.perf_counter()
        with a.use_memory_pool("runtime"):
            pass
        assert time.perf_counter() - t0 < REGISTER_S
    with a.use_memory_pool("kv_cache"):
        assert lifecycle.backup_store.capacity >= 24 * MiB


def test_a_sleep_can_be_broken_down_phase_by_phase(tmp_path):
    """``unisleep.driver.add_trace_sink``: every sleep's lifecycle and driver traces, without
    ``UNISLEEP_TRACE`` (what the vLLM contract harness prints for the first sleep)."""
    from unisleep.driver import add_trace_sink, remove_trace_sink

    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    recs: list = []
    try:
        lc.empty((2 * MiB,), torch.uint8, tag="weights").fill_(3)
        lc.empty((2 * MiB,), torch.uint8, tag="kv_cache")
        add_trace_sink(recs.append)
        try:
            lc.sleep(1)
        finally:
            remove_trace_sink(recs.append)
        lc.wake_up()
        lc.sleep(1)  # no sink any more: nothing recorded
    finally:
        lc.close()
    assert [r["what"] for r in recs] == ["suspend", "sleep"], recs
    sleep = recs[1]
    assert [p for p, _ in sleep["phases"]] == ["plan + unchanged check", "reserve", "suspend", "bookkeeping"]
    assert sleep["copied"] == 2 * MiB and sleep["seconds"] >= sum(s for _, s in sleep["phases"]) > 0
