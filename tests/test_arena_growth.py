"""How the CUDA backend's pinned host arena grows (backends/cuda/arena.py), on the CPU: the next
segment is mapped and faulted in on a helper thread while the one before it is page-locked;
segment sizes follow what was asked and the budget; a failure gives back every segment not kept.

The memory is real (anonymous mmap, every page faulted in).  Only the page-locking call,
``cuMemHostRegister``, needs an NVIDIA driver: here a **simulated** stand-in takes its place
(it records when it ran and takes as long as a real registration would, proportionally).  The
real call runs in tests/cuda/test_suspend_cuda.py on the H200."""

import os
import threading
import time

import pytest

from unisleep.errors import HostBudgetError

MiB = 1 << 20
SEG = 8 * MiB  # segments of at most 8 MiB here (1 GiB in the backend), to stay small


@pytest.fixture
def arena_cls(monkeypatch):
    """A PinnedArena whose registration is the simulated stand-in; it records, per segment,
    when its faulting-in and its registration began and ended, and every mapping made."""
    from unisleep.backends.cuda import arena as ar

    monkeypatch.setattr(ar, "SEGMENT", SEG)

    class Arena(ar.PinnedArena):
        def __init__(self, budget=None, fail_register_at=None, register_s=0.1):
            super().__init__(0, budget)
            self.events, self.mapped = [], []
            self._lock = threading.Lock()
            self._fail_at, self._register_s = fail_register_at, register_s

        def _note(self, what, addr):
            with self._lock:
                self.events.append((time.perf_counter(), what, addr))

        def _map_faulted(self, size):
            self._note("fault begins", None)
            addr = super()._map_faulted(size)
            self._note("fault ends", addr)
            with self._lock:
                self.mapped.append((addr, size))
            return addr

        def _page_lock(self, addr, size):  # SIMULATED: cuMemHostRegister needs an NVIDIA driver
            self._note("register begins", addr)
            time.sleep(self._register_s)
            if self._fail_at is not None and len([e for e in self.events if e[1] == "register begins"]) >= self._fail_at:
                ar.libc.munmap(addr, size)  # as the real one does when the call fails
                raise RuntimeError("injected: cuMemHostRegister failed")
            self._note("register ends", addr)
            return ar.Segment(addr, size, [(0, size)], 0)

        def _unlock(self, seg):  # SIMULATED: nothing was registered
            pass

    return Arena


@pytest.mark.slow
def test_the_next_segment_is_faulted_in_while_this_one_registers(arena_cls, is_mapped):
    arena = arena_cls()
    try:
        arena.prepare(5 * SEG - 2 * MiB, background=False)
        assert [s.size for s in arena._segs] == [SEG, SEG, SEG, SEG, SEG - 2 * MiB]
        assert arena.capacity == arena._free_bytes() == 5 * SEG - 2 * MiB
        for s in arena._segs:  # every segment kept is mapped
            assert is_mapped(s.addr, s.size)
        ev = arena.events
        reg_begin = [t for t, what, _ in ev if what == "register begins"]
        reg_end = [t for t, what, _ in ev if what == "register ends"]
        fault_begin = [t for t, what, _ in ev if what == "fault begins"]
        assert len(fault_begin) == len(reg_begin) == 5
        for i in range(4):  # segment i+1 started faulting in before segment i was registered
            assert fault_begin[i + 1] < reg_end[i], f"segment {i + 1} waited for segment {i}'s registration"
        assert [a for _, what, a in ev if what == "register ends"] == [s.addr for s in arena._segs]  # in order
    finally:
        arena.close()
    assert not [m for m in arena.mapped if is_mapped(*m)]  # close gives every segment back


def test_growth_stops_at_the_budget_and_maps_nothing_beyond_it(arena_cls):
    arena = arena_cls(budget=2 * SEG + 4 * MiB)
    try:
        arena.prepare(2 * SEG)  # within the budget
        arena.wait_prepared()
        arena.prepare(3 * SEG)  # 1 more segment's worth than the budget holds
        with pytest.raises(HostBudgetError, match="Raise host_budget_bytes"):
            arena.wait_prepared()
        assert arena.capacity == 2 * SEG + 4 * MiB  # filled up to the budget, then refused
        assert sum(n for _, n in arena.mapped) == arena.capacity  # nothing faulted in beyond it
    finally:
        arena.close()


def test_a_failed_registration_gives_back_the_segment_faulted_in_ahead(arena_cls, is_mapped):
    arena = arena_cls(fail_register_at=2)
    try:
        arena.prepare(4 * SEG)
        with pytest.raises(RuntimeError, match="injected"):
            arena.wait_prepared()
        kept = {s.addr for s in arena._segs}
        assert len(kept) == 1 and arena.capacity == SEG  # the first segment only
        # the second (whose registration failed) and the third (faulted in ahead meanwhile) are gone
        assert len(arena.mapped) >= 3, "the third segment was not faulted in ahead"
        assert not [m for m in arena.mapped if m[0] not in kept and is_mapped(*m)]
        assert arena._pending == 0
    finally:
        arena.close()


# ---------------------------------------------------------------------------- giving segments back
@pytest.fixture
def locked_arena(monkeypatch):
    """A PinnedArena of 2 MiB segments whose page-locking is ``mlock``/``munlock`` — real page
    locking by the kernel, read back from ``VmLck`` — in place of ``cuMemHostRegister`` /
    ``cuMemHostUnregister`` (**simulated**: they need an NVIDIA driver)."""
    import ctypes

    from unisleep.backends.cuda import arena as ar

    monkeypatch.setattr(ar, "SEGMENT", 2 * MiB)
    libc = ctypes.CDLL(None, use_errno=True)

    class Arena(ar.PinnedArena):
        def _page_lock(self, addr, size):
            if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
                ar.libc.munmap(addr, size)
                err = ctypes.get_errno()
                raise OSError(err, f"mlock: {os.strerror(err)}")
            return ar.Segment(addr, size, [(0, size)], 0)

        def _unlock(self, seg):
            libc.munlock(ctypes.c_void_p(seg.addr), ctypes.c_size_t(seg.size))

    return Arena


def _locked() -> int:
    from unisleep.hostmem import _status_bytes, process_status

    return _status_bytes(process_status(), "VmLck")


def test_release_unused_gives_back_only_the_segments_no_backup_uses(locked_arena, is_mapped):
    import torch

    a = locked_arena(0, None)
    base = _locked()
    try:
        try:
            a.prepare(3 * 2 * MiB, background=False)
        except OSError as e:
            pytest.skip(f"this machine does not let the test lock 6 MiB ({e}; ulimit -l)")
        assert _locked() - base == 6 * MiB and a.residency() == {"pinned": 6 * MiB, "pageable": 0, "disk": 0}
        segs = [(s.addr, s.size) for s in a._segs]
        # a backup taking the third segment only: the first two stay free
        for si in (0, 1):
            a._segs[si].free = [(0, 2 * MiB)]
        a._segs[2].free = []
        a._slots[(7, 0)] = [(2, 0, 2 * MiB)]
        view = a._host_view(2, 0, 2 * MiB)
        view.copy_(torch.arange(2 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8))
        ref = view.clone()
        a._promised[(9, 0)] = MiB  # room reserved for a sleep under way: nothing is given back
        assert a.release_unused() == 0 and len(a._segs) == 3
        del a._promised[(9, 0)]
        assert a.release_unused() == 4 * MiB
        assert _locked() - base == 2 * MiB and a.capacity == 2 * MiB
        assert not is_mapped(*segs[0]) and not is_mapped(*segs[1]) and is_mapped(*segs[2])
        assert a._slots[(7, 0)] == [(0, 0, 2 * MiB)]  # renumbered: the backup is still found
        assert torch.equal(a._host_view(0, 0, 2 * MiB), ref)
        a.drop((7, 0))
        assert a.release_unused() == 2 * MiB and a.capacity == 0 and _locked() == base
        assert a.release_unused() == 0
    finally:
        a.close()
    assert _locked() == base


def test_release_unused_waits_for_a_graph_capture_to_end(locked_arena):
    """Unregistering during a capture would invalidate it: nothing is given back while one is
    underway (on another thread), and everything once it has ended."""
    import threading

    from unisleep import graph_capture

    a = locked_arena(0, None)
    try:
        try:
            a.prepare(2 * MiB, background=False)
        except OSError as e:
            pytest.skip(f"this machine does not let the test lock 2 MiB ({e}; ulimit -l)")
        inside, leave = threading.Event(), threading.Event()

        def capture():
            with graph_capture.capture():
                inside.set()
                leave.wait(10)

        t = threading.Thread(target=capture)
        t.start()
        inside.wait(10)
        try:
            assert a.release_unused() == 0 and a.capacity == 2 * MiB
        finally:
            leave.set()
            t.join()
        assert a.release_unused() == 2 * MiB and a.capacity == 0
    finally:
        a.close()
