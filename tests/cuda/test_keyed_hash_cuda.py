"""The keyed digest on the GPU (marker ``cuda``): the fused NH kernel returns exactly the CPU
NH tree's words, no edit pattern is blind, and the skip-unchanged sleep never restores stale
bytes (the public API, 1 GiB)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep import MemoryLifecycle  # noqa: E402
from unisleep import keyed_hash as kh  # noqa: E402
from unisleep.keyed_hash import BLOCK, HashKey  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def key():
    return HashKey.new()


@pytest.fixture(scope="module")
def cs():
    from unisleep.backends.cuda import checksum

    return checksum


def test_the_platform_finds_the_fused_kernel(cs):
    pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
    assert kh.device_level1("cuda") is cs.nh_level1
    assert cs._triton_kernel() is not None, cs._nh1.error
    assert cs.warm_up(torch.device("cuda"))


@pytest.mark.parametrize(
    "n", [0, 1, 2, 3, 7, BLOCK - 1, BLOCK, BLOCK + 1, 4 * BLOCK + 3, (1 << 20) + 5, 9 * (1 << 20) + 2049]
)
def test_kernel_words_equal_nh_level(n, key, cs):
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randint(-(2**31), 2**31 - 1, (n + 1,), dtype=torch.int32, device="cuda", generator=g)
    k = key.level_tensor(0, "cuda")
    for words in (w[:n], w[1:]):  # aligned, and 4 bytes off the allocation's start
        got = cs.nh_level1(words, k)
        assert torch.equal(got, kh.nh_level(words.clone(), k)), n
        assert torch.equal(got.cpu(), kh.nh_level(words.cpu().clone(), key.level_tensor(0, "cpu"))), n
        assert torch.equal(cs.nh_level1(words, k, kind="split"), got), n


@pytest.mark.parametrize("spans", [
    [(0, 13)],
    [(0, 256 * MiB), (256 * MiB, 0), (256 * MiB + 64, 3 * MiB + 5), (259 * MiB + 128, 8193)],
    [(64 * i, 0) for i in range(3)] + [(192, 40 * MiB + 6)],
])
def test_bucket_lanes_kernel_equals_the_per_tensor_digests(spans, key, cs):
    pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
    assert kh.segment_level("cuda") is cs.nh_segments
    g = torch.Generator(device="cuda").manual_seed(len(spans))
    buf = torch.randint(0, 256, (max(o + n for o, n in spans) + 64,), dtype=torch.uint8, device="cuda", generator=g)
    got = kh.bucket_lanes(buf, spans, key)
    assert torch.equal(got, kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * len(spans)))
    small = [(o, n) for o, n in spans if n < 8 * MiB]
    want = kh.bucket_lanes(buf.cpu(), small, key, level=kh.nh_segments_reference)
    assert torch.equal(kh.bucket_lanes(buf, small, key).cpu(), want)


def test_bucket_fill_packs_and_hashes_in_one_pass(key, cs):
    pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
    assert kh.segment_copy_level("cuda") is cs.nh_segments_copy
    sizes = [256 * MiB, 0, 3 * MiB + 8, 8200, 24, 64 * MiB]
    spans, off = [], 0
    for n in sizes:
        spans.append((off, n))
        off = (off + n + 63) // 64 * 64
    g = torch.Generator(device="cuda").manual_seed(7)
    srcs = [torch.randint(-(2**15), 2**15 - 1, (n // 2,), dtype=torch.int16, device="cuda", generator=g).view(torch.bfloat16)
            for n in sizes]
    want = None
    for fill_min, fused in ((None, [True, False, False, False, False, True]), (0, [True] * 6)):
        buf = torch.full((off + 64,), 0xAB, dtype=torch.uint8, device="cuda")
        bl = kh.BucketLanes(buf, spans, key)
        if fill_min is not None:
            bl.fill_min = fill_min
        assert [bl.fill(i, s) for i, s in enumerate(srcs)] == fused  # by default tensors >= 64 MiB
        for i, done in enumerate(fused):
            if not done:
                buf[spans[i][0]: spans[i][0] + sizes[i]].copy_(srcs[i].view(torch.uint8))
        got = bl.lanes()
        for (o, n), s in zip(spans, srcs):
            assert torch.equal(buf[o: o + n], s.view(torch.uint8))
        assert buf[spans[2][0] + sizes[2]: spans[3][0]].eq(0xAB).all()  # padding between slots untouched
        assert torch.equal(got, kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * len(spans)))
        assert want is None or torch.equal(got, want)
        want = got


@pytest.mark.parametrize("nbytes", [1, 5, 8, 8191, 8192, 8193, 3 * 8192 + 12, 4 * MiB + 4, 64 * MiB + 20, 300 * MiB + 7])
def test_gpu_digest_equals_the_cpu_nh_digest(nbytes, key):
    g = torch.Generator(device="cuda").manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    d = kh.digest(t, key)
    assert d.algorithm == "nh2" and d.nbytes == nbytes
    assert d == kh.digest(t.cpu(), key, algorithm="nh2")


def _patterns(base):
    n = base.numel()
    out = []
    for at in (0, BLOCK - 1, 5 * BLOCK + 3, n - 3):
        e = base.clone()
        e[at : at + 3] += torch.tensor([1, -2, 1], dtype=torch.int32, device="cuda")
        out.append((f"+1-2+1@{at}", e))
    e = base.clone()
    e[10] += 1
    e[11] -= 1
    e[BLOCK + 500] -= 1
    e[BLOCK + 501] += 1
    out.append(("dipoles", e))
    e = base.clone()
    e[[5, 6]] = e[[6, 5]]
    out.append(("swap words", e))
    e = base.clone()
    r = e[: 64 * BLOCK].view(-1, 256)
    r[[1, 300]] = r[[300, 1]]
    out.append(("swap rows", e))
    for word, bit in ((0, 0), (BLOCK + 1, 31), (n - 1, 9)):
        e = base.clone()
        e[word] ^= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32, device="cuda")
        out.append((f"bit {word}:{bit}", e))
    return out


def test_no_edit_pattern_is_blind_on_the_gpu(key):
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randint(-(2**31), 2**31 - 1, (8 * MiB // 4 + 333,), dtype=torch.int32, device="cuda", generator=g)
    d0 = kh.digest(base, key)
    assert kh.digest(base.clone(), key) == d0
    for name, e in _patterns(base):
        assert not torch.equal(e, base), name
        assert kh.digest(e, key) != d0, name
    assert kh.digest(base, HashKey.new()) != d0


def test_float_and_bf16_patterns_on_the_gpu(key):
    f = torch.zeros(3 * BLOCK + 5, dtype=torch.float32, device="cuda")
    d0 = kh.digest(f, key)
    e = f.clone()
    e[BLOCK + 2] = -0.0
    assert kh.digest(e, key) != d0
    nan = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32, device="cuda").view(torch.float32)
    a, b = f.clone(), f.clone()
    a[17], b[17] = nan[0], nan[1]
    assert kh.digest(a, key) != kh.digest(b, key)
    x = torch.randn(4 * BLOCK + 6, device="cuda").to(torch.bfloat16)
    dx = kh.digest(x, key)
    s = x.clone()
    s[[0, 1]] = s[[1, 0]]  # the halves of one word swapped
    assert kh.digest(s, key) != dx
    u = x.clone()
    v = u.view(torch.int16)
    v[10] += 1
    v[11] -= 1
    assert kh.digest(u, key) != dx


# ---- the stale-restore case of issue 9, with the public API ------------------------------
def _cancel3(w):
    w[123457 : 123457 + 3] += torch.tensor([1, -2, 1], dtype=torch.int32, device="cuda")


def _dipoles(w):
    w[1000] += 1
    w[1001] -= 1
    w[50_000_000] -= 1
    w[50_000_001] += 1


def _swap(w):
    w[[77, 200_000_003]] = w[[200_000_003, 77]]


def test_an_edit_is_never_taken_as_unchanged():
    lc = MemoryLifecycle("cuda")
    try:
        w8 = lc.empty((GiB,), torch.uint8, tag="weights")
        w = w8.view(torch.int32)
        w.random_()
        lc.sleep(1)
        lc.wake_up()
        rep = lc.sleep(1)
        assert rep.bytes_copied == 0  # unchanged: proven by the digest, the copy is skipped
        lc.wake_up()
        for edit in (_cancel3, _dipoles, _swap):
            before = w8.clone()
            edit(w)
            assert not torch.equal(w8, before), edit.__name__
            ref = w8.clone()
            rep = lc.sleep(1)
            assert rep.bytes_copied >= GiB, (edit.__name__, rep.bytes_copied)
            lc.wake_up()
            assert torch.equal(w8, ref), edit.__name__  # the edited bytes, not the stale backup
            del before, ref
    finally:
        lc.close()
