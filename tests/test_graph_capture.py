"""The gate between graph captures and unisleep's background device work (unisleep/graph_capture.py),
on the CPU with real threads: background work waits while a capture is underway, a capture waits
for background work in progress, queued work is drained before a capture begins, a framework's
graph class is watched, and lifecycle verbs are refused on a capturing thread.

The arena cases use the CUDA backend's real ``PinnedArena`` grower on real host memory with the
page-locking call (``cuMemHostRegister``) **simulated** (it needs an NVIDIA driver); the H200 runs
the real one in tests/cuda/test_graph_capture_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from unisleep import graph_capture
from unisleep.errors import InvalidTransitionError

MiB = 1 << 20


def _in_thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_background_work_waits_while_a_capture_is_underway():
    ran = []

    def work():
        with graph_capture.background():
            ran.append(time.perf_counter())

    with graph_capture.capture():
        t = _in_thread(work)
        time.sleep(0.2)
        assert not ran, "background work ran inside the capture"
        ended = time.perf_counter()
    t.join(5)
    assert ran and ran[0] >= ended


def test_a_capture_waits_for_background_work_in_progress():
    inside = threading.Event()
    left = []

    def work():
        with graph_capture.background():
            inside.set()
            time.sleep(0.2)
            left.append(time.perf_counter())

    t = _in_thread(work)
    inside.wait(5)
    with graph_capture.capture():
        began = time.perf_counter()
    t.join(5)
    assert left and began >= left[0], "the capture began while background work was in progress"


def test_the_capturing_thread_is_not_held_by_its_own_capture():
    with graph_capture.capture():
        assert graph_capture.capturing_here() and graph_capture.underway()
        with graph_capture.background():  # would deadlock if it waited
            pass
        with graph_capture.capture():  # nested captures
            assert graph_capture.capturing_here()
        assert graph_capture.capturing_here()
    assert not graph_capture.capturing_here() and not graph_capture.underway()


def test_drainers_run_before_a_capture_begins_and_their_errors_do_not_reach_it():
    calls = []

    class Owner:
        def drain(self):
            calls.append(graph_capture.underway())

        def broken(self):
            raise RuntimeError("injected")

    o = Owner()
    graph_capture.add_drainer(o.drain)
    graph_capture.add_drainer(o.broken)
    with graph_capture.capture():
        pass
    assert calls == [False]  # before the capture counted as underway
    del o  # held weakly: gone with its owner
    with graph_capture.capture():
        pass
    assert calls == [False]


class _Graph:
    """A framework's graph class as the gate sees it: capture_begin / capture_end in Python."""

    fail_begin = fail_end = False

    def capture_begin(self, pool=None):
        if self.fail_begin:
            raise RuntimeError("injected: capture_begin failed")
        self.began = graph_capture.underway()

    def capture_end(self):
        if self.fail_end:
            raise RuntimeError("injected: capture_end failed")


def test_a_watched_graph_class_holds_the_gate_from_begin_to_end():
    cls = type("G", (_Graph,), {})
    assert graph_capture.watch(cls) and graph_capture.watch(cls)  # idempotent
    g = cls()
    g.capture_begin()
    assert g.began and graph_capture.capturing_here()
    g.capture_end()
    assert not graph_capture.underway()
    g.fail_begin = True
    with pytest.raises(RuntimeError):
        g.capture_begin()
    assert not graph_capture.underway(), "a failed capture_begin left the gate closed"
    g.fail_begin, g.fail_end = False, True
    g.capture_begin()
    with pytest.raises(RuntimeError):
        g.capture_end()
    assert not graph_capture.underway(), "a failed capture_end left the gate closed"


@pytest.mark.slow
def test_torchs_graph_class_is_watched_in_a_fresh_process():
    """torch.cuda.CUDAGraph defines capture_begin/capture_end in Python (torch 2.11 and 2.13): the
    gate wraps them.  In a child process, so this process's torch stays as it was."""
    code = textwrap.dedent("""
        import torch
        from unisleep import graph_capture
        assert graph_capture.watch(torch.cuda.CUDAGraph)
        assert torch.cuda.CUDAGraph.capture_begin.__name__ == "capture_begin"
        print("OK")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


FAKE_NPU_GRAPHS = """
class NPUGraph:  # torch_npu's graph class as the gate sees it (simulated: no NPU here)
    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass
"""


@pytest.mark.slow
def test_each_accelerator_backends_graph_class_is_watched_when_a_lifecycle_starts(tmp_path):
    """The core watches the graph class each backend's descriptor names (CUDA and ROCm: torch's
    CUDAGraph; Ascend: torch_npu's NPUGraph), so every platform's captures wait for unisleep's
    background work — here a lifecycle on the simulated HIP and on the simulated ACL library,
    with a stand-in torch_npu graphs module, in a child process (torch stays as it was here)."""
    graphs = tmp_path / "torch_npu" / "npu"
    graphs.mkdir(parents=True)
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    (graphs / "__init__.py").write_text("")
    (graphs / "graphs.py").write_text(FAKE_NPU_GRAPHS)
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        sys.path.insert(0, sys.argv[2])
        from sim.fake_acl import FakeAcl
        from sim.fake_hip import FakeHip
        from unisleep import MemoryLifecycle, graph_capture
        from unisleep.backends.ascend import AscendDriver
        from unisleep.backends.rocm import RocmDriver
        from torch_npu.npu.graphs import NPUGraph

        watched = lambda cls: bool(getattr(cls, graph_capture._WATCHED, False))
        before = [watched(torch.cuda.CUDAGraph), watched(NPUGraph)]
        MemoryLifecycle(RocmDriver(lib=FakeHip(), tensor_device="cpu", env={})).close()
        middle = [watched(torch.cuda.CUDAGraph), watched(NPUGraph)]
        MemoryLifecycle(AscendDriver(lib=FakeAcl(), tensor_device="cpu")).close()
        after = [watched(torch.cuda.CUDAGraph), watched(NPUGraph)]
        print(before, middle, after)
    """)
    tests = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path), tests], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(tests))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "[False, False] [True, False] [True, True]"


def test_lifecycle_verbs_are_refused_on_a_capturing_thread_before_anything_changes(tmp_path):
    import torch

    from unisleep import MemoryLifecycle

    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    try:
        w = lc.empty((1 * MiB,), torch.uint8, tag="weights")
        w.fill_(5)
        lc.empty((1 * MiB,), torch.uint8, tag="kv_cache")
        with graph_capture.capture():
            for verb in (lambda: lc.sleep(1), lambda: lc.discard(["kv_cache"]),
                         lambda: lc.prepare_backup(background=False)):
                with pytest.raises(InvalidTransitionError, match="capturing a graph"):
                    verb()
        assert lc.state() == {"weights": "awake", "kv_cache": "awake"}
        lc.sleep(1)
        with graph_capture.capture():
            with pytest.raises(InvalidTransitionError, match="capturing a graph"):
                lc.wake_up()
        assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}
        lc.wake_up()
        assert int(w.sum()) == 5 * MiB
    finally:
        lc.close()


def test_releases_behind_a_sleep_are_done_before_a_capture_and_none_runs_inside_one(tmp_path):
    """Host backend with release_behind: each release is slowed by a hook; a capture begun right
    after the sleep returns first waits for the queue (the pool's first allocation would wait for
    it inside the capture), and no release runs while the capture is underway."""
    import torch

    from unisleep import MemoryLifecycle

    lc = MemoryLifecycle("host", spill_dir=str(tmp_path), release_behind=True)
    seen = []
    try:
        for _ in range(4):
            lc.empty((1 * MiB,), torch.uint8, tag="kv_cache")
        lc._driver.hooks.release = lambda h: (time.sleep(0.05), seen.append(graph_capture.underway()))
        lc.sleep(2)
        assert lc._driver._behind.pending  # the releases run behind the return
        with graph_capture.capture():
            assert not lc._driver._behind.pending, "the capture began with releases still queued"
        assert seen and not any(seen), "a release ran while the capture was underway"
    finally:
        lc._driver.hooks.release = None
        lc.close()


@pytest.fixture
def arena_cls(monkeypatch):
    """The CUDA backend's PinnedArena on real host memory, with the page-locking call SIMULATED
    (cuMemHostRegister needs an NVIDIA driver); it records whether a capture was underway."""
    from unisleep.backends.cuda import arena as ar

    monkeypatch.setattr(ar, "SEGMENT", 4 * MiB)

    class Arena(ar.PinnedArena):
        def __init__(self):
            super().__init__(0, None)
            self.locked_inside = []

        def _page_lock(self, addr, size):  # SIMULATED
            self.locked_inside.append(graph_capture.underway())
            time.sleep(0.02)
            return ar.Segment(addr, size, [(0, size)], 0)

        def warm_stream(self):
            pass

    return Arena


def test_the_arena_grows_around_a_capture_not_inside_it(arena_cls):
    """The race that aborted vLLM engine starts: the arena prepared behind the model load while
    the engine captured its graphs.  The grower now waits for the capture to end."""
    arena = arena_cls()
    try:
        with graph_capture.capture():
            arena.prepare(16 * MiB, background=True)
            time.sleep(0.3)
            assert arena.capacity == 0, "the arena page-locked a segment during the capture"
        arena.wait_prepared()
        assert arena.capacity >= 16 * MiB
        assert arena.locked_inside and not any(arena.locked_inside)
    finally:
        arena.close()


@pytest.mark.slow
def test_a_capture_begun_while_the_arena_grows_waits_for_the_segment_in_progress(arena_cls):
    arena = arena_cls()
    try:
        arena.prepare(64 * MiB, background=True)  # 16 segments, ~20 ms each
        time.sleep(0.05)
        with graph_capture.capture():
            n = len(arena._segs)
            time.sleep(0.2)
            assert len(arena._segs) == n, "segments were page-locked during the capture"
        arena.wait_prepared()
        assert arena.capacity >= 64 * MiB and not any(arena.locked_inside)
    finally:
        arena.close()
