"""The CUDA cumem backend on a real GPU (marker ``cuda``; CPU CI skips these)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep import InvalidArgumentError, InvalidTransitionError, MemoryLifecycle, UnknownTagError  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def test_level1_restores_bytes_exactly_at_the_same_addresses(lc):
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 7, 4096, 3 * MiB + 5, 64 * MiB]
    ws = [lc.empty((n,), torch.uint8, tag="weights") for n in sizes]
    for w in ws:
        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device="cuda", generator=g))
    fl = lc.empty((1000, 333), torch.float32, tag="weights")
    fl.normal_(generator=g)
    kv = lc.empty((32 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(9)
    refs = [w.clone() for w in ws] + [fl.clone()]
    ptrs = [t.data_ptr() for t in ws + [fl, kv]]
    rep = lc.sleep(1)
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}
    assert lc.resident_bytes() == 0
    assert rep.bytes_copied == lc.allocated_bytes("weights")
    lc.wake_up()
    for t, r in zip(ws + [fl], refs):
        assert torch.equal(t, r)
    assert [t.data_ptr() for t in ws + [fl, kv]] == ptrs
    assert int(kv.count_nonzero()) == 0  # discarded memory comes back zeroed


def test_many_allocations_and_cycles(lc):
    ts = [lc.empty((n * 1000 + 1,), torch.float16, tag="weights") for n in range(1, 65)]
    want = list(range(len(ts)))
    for i, t in enumerate(ts):
        t.fill_(i)
    gran = lc.driver.granularity()
    for cycle in range(4):
        rep = lc.sleep(1)
        if cycle == 0:
            assert rep.bytes_copied == lc.allocated_bytes("weights")  # nothing retained yet
        else:  # exactly the one tensor changed last cycle is copied again; the rest are proven unchanged
            changed = ts[cycle - 1]
            assert rep.bytes_copied == -(-changed.numel() * changed.element_size() // gran) * gran, cycle
        lc.wake_up()
        for i, t in enumerate(ts):
            assert bool((t == want[i]).all()), (cycle, i)
        ts[cycle].add_(1)  # a real change, kept: the next sleep must copy it, the wake restore it
        want[cycle] += 1


def test_cuda_graph_replays_after_wake(lc):
    x = lc.empty((1 << 20,), torch.float32, tag="weights")
    y = lc.empty((1 << 20,), torch.float32, tag="kv_cache")
    x.fill_(2.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.copy_(x * 3)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(x * 3)
    lc.sleep(1)
    lc.wake_up()
    g.replay()
    torch.cuda.synchronize()
    assert bool((y == 6.0).all())
    x.fill_(5.0)
    g.replay()
    torch.cuda.synchronize()
    assert bool((y == 15.0).all())


def test_level2_preserve(lc):
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    ref = {k: v.detach().clone() for k, v in m.state_dict().items()}
    lc.adopt(m, tag="weights")
    assert lc.preserve(["1.*"]) == ["1.bias", "1.weight"]
    lc.sleep(2)
    lc.wake_up(["weights"])
    sd = m.state_dict()
    assert torch.equal(sd["1.weight"], ref["1.weight"]) and torch.equal(sd["1.bias"], ref["1.bias"])
    assert int(sd["0.weight"].count_nonzero()) == 0 and int(sd["0.bias"].count_nonzero()) == 0


def test_discard_kv_only_and_partial_wake_order(lc):
    w = lc.empty((8 * MiB,), torch.uint8, tag="weights")
    w.fill_(4)
    kv = lc.empty((16 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(1)
    lc.discard(["kv_cache"])
    assert lc.state() == {"weights": "awake", "kv_cache": "discarded"}
    assert lc.resident_bytes("weights") == lc.allocated_bytes("weights")
    assert lc.resident_bytes("kv_cache") == 0
    assert bool((w == 4).all())
    lc.wake_up(["kv_cache"])
    lc.sleep(2)
    lc.wake_up(["weights"])
    assert lc.state() == {"weights": "awake", "kv_cache": "discarded"}
    lc.wake_up(["kv_cache"])
    assert not lc.is_sleeping


def test_illegal_moves_raise_and_change_nothing(lc):
    w = lc.empty((4 * MiB,), torch.uint8, tag="weights")
    w.fill_(3)
    lc.empty((4 * MiB,), torch.uint8, tag="kv_cache")
    with pytest.raises(InvalidArgumentError):
        lc.sleep(3)
    with pytest.raises(UnknownTagError):
        lc.wake_up(["nope"])
    lc.sleep(1)
    before = (lc.state(), lc.resident_bytes(), lc.backup_bytes())
    with pytest.raises(InvalidTransitionError):
        lc.sleep(2)
    with pytest.raises(InvalidTransitionError):
        lc.discard(["weights"])
    with pytest.raises(InvalidTransitionError):
        lc.empty((10,), tag="weights")
    assert (lc.state(), lc.resident_bytes(), lc.backup_bytes()) == before
    lc.sleep(1)  # same policy again: a no-op
    lc.wake_up()
    lc.wake_up()  # awake: a no-op
    assert bool((w == 3).all())


def test_freed_memory_seen_by_mem_get_info(lc):
    w = lc.empty((1 << 30,), torch.uint8, tag="weights")
    kv = lc.empty((2 << 30,), torch.uint8, tag="kv_cache")
    w.fill_(1)
    kv.fill_(1)
    torch.cuda.synchronize()
    pooled = lc.resident_bytes()
    assert pooled == lc.allocated_bytes() >= 3 << 30
    free0 = torch.cuda.mem_get_info()[0]
    lc.sleep(1)
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= 0.99 * pooled, (freed, pooled)
    lc.wake_up()
    assert torch.cuda.mem_get_info()[0] <= free0 + (64 << 20)


def test_pool_routes_torch_allocations_and_sleeps_them(lc):
    with lc.pool("kv_cache"):
        a = torch.full((3 << 20,), 7, dtype=torch.int32, device="cuda")
        b = torch.ones((1000, 1000), device="cuda")
    with lc.pool("weights"):
        c = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    assert lc.resident_bytes("kv_cache") >= a.numel() * 4 + b.numel() * 4
    ptr = c.data_ptr()
    lc.sleep(1)
    assert lc.resident_bytes() == 0
    lc.wake_up()
    assert c.data_ptr() == ptr
    assert torch.equal(c, torch.arange(1 << 20, dtype=torch.float32, device="cuda"))
    assert int(a.count_nonzero()) == 0 and int(b.count_nonzero()) == 0
    del a, b  # freeing pooled tensors must not crash, asleep or awake
    lc.sleep(2)
    del c


def test_unchanged_weights_skip_the_copy(lc):
    w = lc.empty((64 * MiB,), torch.uint8, tag="weights")
    w.view(torch.int32).random_()
    ref = w.clone()
    assert lc.sleep(1).bytes_copied == 64 * MiB
    lc.wake_up()
    assert lc.sleep(1).bytes_copied == 0  # identical to the retained backup: proven by the digest
    lc.wake_up()
    assert torch.equal(w, ref)
    w[12345] += 1
    ref[12345] += 1
    assert lc.sleep(1).bytes_copied == 64 * MiB  # one changed byte: copied again
    lc.wake_up()
    assert torch.equal(w, ref)


def test_expandable_segments_setting_survives_the_pool(tmp_path):
    code = textwrap.dedent(
        """
        import torch
        from unisleep import MemoryLifecycle

        def segment_of(ptr):
            for seg in torch.cuda.memory_snapshot():
                if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                    return seg
            return None

        before = torch.ones(1 << 22, device="cuda")  # the caching allocator, user's setting
        assert segment_of(before.data_ptr())["is_expandable"] is True
        lc = MemoryLifecycle("cuda")
        with lc.pool("kv_cache"):
            t = torch.ones(1 << 22, device="cuda")
        assert lc.resident_bytes("kv_cache") >= t.numel() * 4  # routed into the lifecycle
        seg = segment_of(t.data_ptr())
        assert seg is None or seg["is_expandable"] is False, seg  # not in an expandable segment
        lc.sleep(1)
        assert lc.resident_bytes() == 0, lc.resident_bytes()
        lc.wake_up()
        x = torch.ones(1 << 22, device="cuda")  # ordinary allocations still use the user's setting
        assert segment_of(x.data_ptr())["is_expandable"] is True
        assert float(x.sum()) == float(1 << 22) and float(t.sum()) == 0.0
        print("OK")
        """
    )
    env = dict(__import__("os").environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "OK" in p.stdout


_EXIT_SETUPS = {
    # lifecycle memory only (empty), asleep at exit
    "asleep": 'w = lc.empty((1 << 24,), torch.uint8, tag="weights"); w.fill_(1); lc.sleep(1)',
    # framework allocations routed through pool(), asleep at exit with the tensors still referenced
    "pool-asleep": (
        'with lc.pool("kv_cache"):\n'
        '    k = torch.ones(1 << 22, device="cuda")\n'
        'with lc.pool("weights"):\n'
        '    p = torch.arange(1 << 20, device="cuda")\n'
        "lc.sleep(1)\n"
        "assert lc.resident_bytes() == 0"
    ),
    # both kinds, awake at exit
    "awake": (
        'w = lc.empty((1 << 24,), torch.uint8, tag="weights"); w.fill_(1)\n'
        'with lc.pool("kv_cache"):\n'
        '    k = torch.ones(1 << 22, device="cuda")'
    ),
}


@pytest.mark.parametrize("end", sorted(_EXIT_SETUPS))
def test_clean_exit(end):
    code = "import torch\nfrom unisleep import MemoryLifecycle\nlc = MemoryLifecycle(\"cuda\")\n"
    code += _EXIT_SETUPS[end] + '\nprint("done")\n'
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "done" in p.stdout
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr


def test_a_sleep_leaves_no_digest_scratch_in_torchs_cache(lc):
    """The digests a sleep takes (of the weights it copies; of retained weights, to skip an
    unchanged copy) need device temporaries, ~1/64 of the bytes hashed; they are given back to
    the device when the digests are read, so torch's cache holds no more after a sleep than
    before it, and the sleep frees all it put to sleep."""
    w = lc.empty((1 << 30,), torch.uint8, tag="weights")  # 1 GiB: 16 MiB of level-0 lanes
    w.fill_(5)
    kv = lc.empty((256 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(1)
    torch.cuda.synchronize()
    for what in ("copied", "unchanged"):
        reserved = torch.cuda.memory_reserved()
        free0 = torch.cuda.mem_get_info()[0]
        rep = lc.sleep(1)
        torch.cuda.synchronize()
        grew = torch.cuda.memory_reserved() - reserved
        freed = torch.cuda.mem_get_info()[0] - free0
        assert grew == 0, f"{what} sleep left {grew / MiB:.1f} MiB in torch's cache"
        assert freed >= (1 << 30) + 256 * MiB - 4 * MiB, f"{what} sleep freed {freed / MiB:.1f} MiB of 1280"
        assert rep.bytes_copied == ((1 << 30) if what == "copied" else 0)
        lc.wake_up()
    assert int(w[::4096].min()) == 5 and int(w[::4096].max()) == 5


def test_release_behind_sleeps_return_before_the_release_and_everything_comes_back():
    """``release_behind=True``: the sleep returns once its memory is unmapped; the handles are
    released behind it; ``wait()`` sees the memory back; waking restores the bytes exactly."""
    lc = MemoryLifecycle("cuda", release_behind=True)
    try:
        w = lc.empty((512 * MiB,), torch.uint8, tag="weights")
        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(3)))
        ref = w.clone()
        kvs = [lc.empty((GiB,), torch.uint8, tag="kv_cache") for _ in range(8)]
        for k in kvs:
            k.fill_(9)
        torch.cuda.synchronize()
        for level in (1, 1, 2):
            free0 = torch.cuda.mem_get_info()[0]
            rep = lc.sleep(level)
            assert rep.bytes_released >= 8 * GiB + 512 * MiB
            lc.wait()  # the releases behind the return are done
            freed = torch.cuda.mem_get_info()[0] - free0
            assert freed >= 8 * GiB + 512 * MiB - 8 * MiB, f"level {level}: freed {freed / MiB:.0f} MiB"
            assert lc.resident_bytes() == 0
            lc.wake_up()
            if level == 2:  # level 2 discards the weights: reload them, as the engine does
                w.copy_(ref)
            assert torch.equal(w, ref)
            assert all(int(k.max()) == 0 for k in kvs)
    finally:
        lc.close()
