"""How the CUDA backend's pinned host arena grows (backends/cuda/arena.py), on the CPU: the next
segment is mapped and faulted in on a helper thread while the one before it is page-locked;
segment sizes follow what was asked and the budget; a failure gives back every segment not kept.

The memory is real (anonymous mmap, every page faulted in).  Only the page-locking call,
``cuMemHostRegister``, needs an NVIDIA driver: here a **simulated** stand-in takes its place
(it records when it ran and takes as long as a real registration would, proportionally).  The
real call runs in tests/cuda/test_suspend_cuda.py on the H200."""

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
