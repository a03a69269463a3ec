"""The CUDA driver's pipelined suspend is transactional up to its release point (marker
``cuda``): when the pinned arena cannot hold the backup, or growing it fails part-way, the call
raises with every region still mapped, the device bytes intact and the arena's room given back."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep.driver import SaveJob  # noqa: E402
from unisleep.errors import HostBudgetError  # noqa: E402
from unisleep.region import Region  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def drv():
    from unisleep.backends.cuda.driver import CudaDriver

    d = CudaDriver(0)
    yield d
    d.close()


def _region(drv, nbytes, chunk=256 * MiB, seed=0):
    r = Region.allocate(drv, nbytes, chunk)
    v = drv.view(r.va, r.size)
    v.view(torch.int32).random_(generator=torch.Generator(device="cuda").manual_seed(seed))
    return r, v.clone()


def _intact(drv, regions):
    drv.synchronize()
    for r, ref in regions:
        assert r.mapped
        assert torch.equal(drv.view(r.va, r.size), ref)


def test_no_room_raises_before_anything_is_released(drv):
    from unisleep.backends.cuda.arena import PinnedArena

    regions = [_region(drv, 64 * MiB, seed=1), _region(drv, 512 * MiB, seed=2)]
    kv, _ = _region(drv, 128 * MiB, seed=3)
    store = PinnedArena(0, budget_bytes=256 * MiB)  # holds the first backup, not both
    saves = [SaveJob(i, r, [(0, r.size)]) for i, (r, _) in enumerate(regions)]
    free0 = drv.memory_info()[0]
    try:
        with pytest.raises(HostBudgetError, match="Nothing was released"):
            drv.suspend(saves, [kv], store)
        assert kv.mapped
        _intact(drv, regions)
        assert drv.memory_info()[0] <= free0 + 2 * MiB
        assert store.held_bytes == 0 and not store._promised  # no backup, no room held
        assert store.capacity <= 256 * MiB
    finally:
        store.close()
        for r, _ in regions:
            r.free(drv)
        kv.free(drv)


def _failing_arena(monkeypatch, stage):
    """A pinned arena whose second host segment fails, as the host does when it runs short:
    its registration (``cuMemHostRegister``), or its faulting-in, which runs on a helper thread
    while the first segment registers.  The fault is injected below the code under test (the
    driver call, the page-touching helper); every address the arena mapped is recorded."""
    from unisleep.backends.cuda import arena as ar

    calls = {"cuMemHostRegister": 0, "fault": 0}
    real_call, real_fault = ar.cu.call, ar._fault_in

    def call(name, *args):
        if name == "cuMemHostRegister":
            calls[name] += 1
            if stage == "register" and calls[name] >= 2:
                raise RuntimeError("injected: cuMemHostRegister failed")
        return real_call(name, *args)

    def fault_in(addr, size):
        calls["fault"] += 1
        if stage == "fault" and calls["fault"] >= 2:
            raise RuntimeError("injected: faulting the next segment in failed")
        real_fault(addr, size)

    monkeypatch.setattr(ar.cu, "call", call)
    monkeypatch.setattr(ar, "_fault_in", fault_in)

    class Arena(ar.PinnedArena):
        mapped: list = []  # (address, size) of every segment mapped and faulted in

        def _map_faulted(self, size):
            addr = super()._map_faulted(size)
            Arena.mapped.append((addr, size))
            return addr

    return Arena(0, None)


@pytest.mark.parametrize("stage", ["register", "fault"])
def test_failure_part_way_through_the_copies_leaves_everything_mapped(drv, monkeypatch, stage, is_mapped):
    from unisleep.backends.cuda.arena import SEGMENT, PinnedArena

    # three segments at least (1 GiB at most each): the third is faulted in ahead while the
    # second registers, so a failure there also has a segment in flight to give back
    a, b = _region(drv, 512 * MiB, seed=4), _region(drv, 2 * SEGMENT, seed=5)
    kv, _ = _region(drv, 64 * MiB, seed=6)
    store = _failing_arena(monkeypatch, stage)
    saves = [SaveJob(0, a[0], [(0, a[0].size)]), SaveJob(1, b[0], [(0, b[0].size)])]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            drv.suspend(saves, [kv], store)
        # checked at once: a later host allocation (the byte checks below) may map the same addresses
        kept = {seg.addr for seg in store._segs}
        assert not [m for m in type(store).mapped if m[0] not in kept and is_mapped(*m)]  # nothing left behind
        assert kv.mapped
        _intact(drv, [a, b])
        assert not store.has((0, 0)) and not store.has((1, 0))  # no half-written backup is kept
        assert store.held_bytes == 0
        assert store._free_bytes() == store.capacity  # the room taken is given back
        assert len(store._segs) == 1  # the first segment only
    finally:
        store.close()
        monkeypatch.undo()
    # the same memory sleeps and comes back exactly with a working arena
    good = PinnedArena(0, None)
    try:
        released, copied = drv.suspend(saves, [kv], good)
        assert copied == a[0].size + b[0].size and released >= copied + kv.size
        assert a[0].unmapped and b[0].unmapped and kv.unmapped
        for r, ref in (a, b):
            r.map(drv)
            good.load((saves[0].key if r is a[0] else saves[1].key, 0), drv.view(r.va, r.size))
        _intact(drv, [a, b])
    finally:
        good.close()
        for r in (a[0], b[0], kv):
            r.free(drv)


def test_strict_order_and_partial_reload(drv):
    """With ``release_discards_during_copies`` off, discards go only after every copy; a
    released chunk reads back from the store by range (the lifecycle's rollback path)."""
    from unisleep.backends.cuda.arena import PinnedArena

    a = _region(drv, 768 * MiB, chunk=256 * MiB, seed=8)
    kv, _ = _region(drv, 64 * MiB, seed=9)
    store = PinnedArena(0, None)
    drv.configure(release_discards_during_copies=False)
    try:
        store.reserve((0, 0), a[0].size)
        assert store._promised == {(0, 0): a[0].size}
        released, copied = drv.suspend([SaveJob(0, a[0], [(0, a[0].size)])], [kv], store)
        assert copied == a[0].size and released == a[0].size + kv.size
        assert a[0].unmapped and kv.unmapped and not store._promised
        r, ref = a
        r.map(drv)
        for c in reversed(r.chunks):  # chunk by chunk, as an undo does
            store.load_range((0, 0), c.offset, drv.view(r.va + c.offset, c.size))
        _intact(drv, [a])
        piece = torch.empty(1000, dtype=torch.uint8, device="cuda")
        store.load_range((0, 0), 300 * MiB - 7, piece)  # across a piece boundary, unaligned
        torch.cuda.synchronize()
        assert torch.equal(piece, ref[300 * MiB - 7 : 300 * MiB + 993])
    finally:
        drv.configure(release_discards_during_copies=True)
        store.close()
        a[0].free(drv)
        kv.free(drv)
