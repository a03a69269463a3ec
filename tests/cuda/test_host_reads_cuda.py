"""Restores read by the SMs from the pinned arena (backends/cuda/host_reads.py), on a real GPU:
exact bytes whatever the offsets, and the automatic choice right after a sleep that copied
nothing (marker ``cuda``; CPU CI skips these)."""

import time

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep import MemoryLifecycle  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def _host_reads():
    pytest.importorskip("triton", reason="needs Triton (the SM copy kernel): pip install triton")
    from unisleep.backends.cuda import host_reads

    # with Triton present, a kernel that did not build or failed the driver's warm-up is a failure, not a skip
    assert host_reads.available(), f"the SM copy kernel is unavailable: {host_reads._copy.error!r}"
    return host_reads


def test_arena_reads_by_the_sms_equal_the_copy_engines_at_any_offset(lc):
    _host_reads()
    from unisleep.backends.cuda.arena import PinnedArena

    arena = lc.backup_store
    assert isinstance(arena, PinnedArena)
    g = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randint(0, 256, (64 * MiB + 13,), dtype=torch.uint8, device="cuda", generator=g)
    arena.reserve(("t", 0), src.numel())
    arena.save(("t", 0), src)
    arena.flush()
    assert arena.readable_by_sms(("t", 0))
    for off, n in [(0, src.numel()), (5, 1000), (8, 16 * MiB + 3), (64 * MiB, 13), (3, 7), (17 * MiB + 1, 9 * MiB)]:
        a = torch.zeros(n, dtype=torch.uint8, device="cuda")
        b = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
        arena.load_range(("t", 0), off, a, by_sms=True)
        arena.load_range(("t", 0), off, b)
        torch.cuda.synchronize()
        assert torch.equal(a, src[off: off + n]) and torch.equal(b, a), (off, n)
    arena.drop(("t", 0))


def test_wakes_read_by_the_sms_restore_level1_and_preserved_level2_bytes_exactly(lc):
    _host_reads()
    lc.driver.configure(restore_reads="sm")
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [lc.empty((n,), torch.uint8, tag="weights") for n in (1, 7, 4096, 3 * MiB + 5, 1 * GiB + 3)]
    for w in ws:
        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device="cuda", generator=g))
    kv = lc.empty((32 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(9)
    refs = [w.clone() for w in ws]
    ptrs = [t.data_ptr() for t in ws]
    lc.sleep(1)
    lc.wake_up()
    assert lc.driver.last_restore_by_sms
    assert all(torch.equal(w, r) for w, r in zip(ws, refs)) and [t.data_ptr() for t in ws] == ptrs
    assert int(kv.count_nonzero()) == 0
    assert lc.driver.last_zeroed_by_sms == 32 * MiB  # the reads zeroed the KV cache themselves
    # level 2 with preserved parameters: the restore covers part of each region (zeroed first)
    m = torch.nn.Sequential(torch.nn.Linear(1000, 333), torch.nn.Linear(333, 7)).cuda()
    ref = {k: v.detach().clone() for k, v in m.state_dict().items()}
    lc.adopt(m, tag="model")
    assert lc.preserve(["1.*"]) == ["1.bias", "1.weight"]
    lc.sleep(2, tags=["model"])
    lc.wake_up(["model"])
    assert lc.driver.last_restore_by_sms
    sd = m.state_dict()
    assert torch.equal(sd["1.weight"], ref["1.weight"]) and torch.equal(sd["1.bias"], ref["1.bias"])
    assert int(sd["0.weight"].count_nonzero()) == 0 and int(sd["0.bias"].count_nonzero()) == 0
    assert lc.driver.last_zeroed_by_sms == 0  # a region restored in part is zeroed before its reads


def test_reads_by_the_sms_zero_at_most_four_blocks_each_and_the_rest_after_them(lc):
    _host_reads()
    from unisleep.backends.cuda import host_reads

    lc.driver.configure(restore_reads="sm")
    w = lc.empty((4 * MiB,), torch.uint8, tag="weights")
    w.view(torch.int32).random_()
    kvs = [lc.empty((n,), torch.uint8, tag="kv_cache") for n in (6 * MiB, 58 * MiB)]
    for kv in kvs:
        kv.fill_(5)
    ref = w.clone()
    lc.sleep(1)
    lc.wake_up()
    assert lc.driver.last_restore_by_sms and torch.equal(w, ref)
    assert all(int(kv.count_nonzero()) == 0 for kv in kvs)
    # 4 MiB of reads carry 4 x 4 MiB of the 64 MiB to zero; the other 48 MiB are zeroed after them
    assert host_reads.MAX_ZERO_PER_BLOCK == 4 and lc.driver.last_zeroed_by_sms == 16 * MiB


def test_auto_reads_by_the_sms_right_after_a_sleep_that_copied_nothing(lc):
    _host_reads()
    assert lc.driver.config.restore_reads == "auto"
    w = lc.empty((1 * GiB,), torch.uint8, tag="weights")
    w.view(torch.int32).random_()
    kv = lc.empty((4 * GiB,), torch.uint8, tag="kv_cache")
    kv.fill_(1)
    ref = w.clone()
    lc.sleep(1)
    lc.wake_up()
    rep = lc.sleep(1)  # unchanged weights: nothing copied, 5 GiB released just now
    assert rep.bytes_copied == 0
    assert lc.driver.after_release_pending_ms() > 1.5  # 5 GiB: ~10 ms of the driver's work left
    lc.wake_up()
    assert lc.driver.last_restore_by_sms
    assert torch.equal(w, ref) and int(kv.count_nonzero()) == 0
    lc.sleep(1)
    time.sleep(0.2)  # the trainer's step: the driver's work is done by the wake
    assert lc.driver.after_release_pending_ms() == 0
    lc.wake_up()
    assert not lc.driver.last_restore_by_sms
    assert torch.equal(w, ref)


def test_restore_reads_names_the_choices(lc):
    from unisleep import InvalidArgumentError

    lc.empty((4 * MiB,), torch.uint8, tag="weights").fill_(1)
    with pytest.raises(InvalidArgumentError, match="'auto', 'sm' or 'copy-engine'"):
        lc.driver.configure(restore_reads="fast")
    assert lc.driver.config.restore_reads == "auto"
    lc.sleep(1)
    lc.driver.configure(restore_reads="copy-engine")
    lc.wake_up()
    assert not lc.driver.last_restore_by_sms


def test_restore_reads_from_the_environment_is_checked_at_start(monkeypatch):
    from unisleep import InvalidArgumentError

    monkeypatch.setenv("UNISLEEP_RESTORE_READS", "copy-engine")
    m = MemoryLifecycle("cuda")
    try:
        assert m.driver.config.restore_reads == "copy-engine"
    finally:
        m.close()
    monkeypatch.setenv("UNISLEEP_RESTORE_READS", "smx")
    with pytest.raises(InvalidArgumentError, match="UNISLEEP_RESTORE_READS"):
        MemoryLifecycle("cuda")
