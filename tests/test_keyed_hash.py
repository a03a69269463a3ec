"""The keyed digest (unisleep.keyed_hash) on the CPU: the NH tree computed with torch ops equals
the plain-integer definition, and no edit pattern — the ones that fooled the old linear digest,
swaps, bit flips, ±0.0, NaN payloads, bf16 pairs — leaves it unchanged.  The same properties run
on the GPU in tests/cuda/test_keyed_hash_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from unisleep import keyed_hash as kh  # noqa: E402
from unisleep.keyed_hash import BLOCK, Digest, HashKey  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nh(t, key):
    return kh.digest(t, key, algorithm="nh2")


@pytest.fixture(scope="module")
def key():
    return HashKey.new()


@pytest.fixture(scope="module")
def base():
    g = torch.Generator().manual_seed(1)
    # 3 blocks and a ragged tail: edits land in full blocks, on block edges and in the padded tail
    return torch.randint(-(2**31), 2**31 - 1, (3 * BLOCK + 101,), dtype=torch.int32, generator=g)


# ---- the definition ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 100, 8191, 8192, 8193, 3 * 8192 + 5, 40000])
def test_torch_ops_equal_the_plain_integer_definition(n, key):
    data = os.urandom(n)
    want = kh.reference_digest(data, key)
    got = kh.digest_bytes(data, key)
    assert got == want
    assert got.nbytes == n and got.algorithm == "nh2"


def test_three_level_tree_equals_the_definition(key):
    # > 512 blocks of level 0 make level 1 longer than one block: three levels
    n = (512 * BLOCK + 3 * BLOCK + 17) * 4 + 3
    data = os.urandom(n)
    assert kh.digest_bytes(data, key) == kh.reference_digest(data, key)


@pytest.mark.slow
def test_a_batch_equals_each_digest_alone():
    # the upper levels of many inputs run as rows of one set of ops (shorter rows zero-padded),
    # every key's level tensors arrive in one copy: each digest must still be its own definition
    sizes = [0, 5, 8192, 3 * 8192 + 5, 3 * 8192 + 5, 40000, (512 * BLOCK + 17) * 4, (512 * BLOCK + 17) * 4,
             (530 * BLOCK + 3) * 4]  # three levels, another length: padded into the same rows
    datas = [os.urandom(n) for n in sizes]
    keys = [HashKey.new() for _ in sizes]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) if d else torch.empty(0, dtype=torch.uint8)
               for d in datas]
    got = kh.digest_many(tensors, keys, algorithm="nh2")
    assert got == [kh.reference_digest(d, k) for d, k in zip(datas, keys)]
    other = kh.digest_many(tensors, [HashKey.new() for _ in sizes], algorithm="nh2")
    assert all(a != b for a, b in zip(got, other))  # each digest depends on its own key


def test_a_key_sized_for_a_region_covers_exactly_its_tree():
    n = (512 * BLOCK + 17) * 4  # a three-level tree
    k = HashKey.new(n)
    assert k.levels == kh.tree_levels(n // 4) == 3
    data = os.urandom(n)
    full = HashKey(k.material + os.urandom((kh.MAX_LEVELS - k.levels) * kh.KEY_WORDS * 4))
    assert kh.digest_bytes(data, k) == kh.digest_bytes(data, full) == kh.reference_digest(data, k)
    assert HashKey.new(8).levels == 1 and HashKey.new().levels == kh.MAX_LEVELS
    with pytest.raises(ValueError, match="too large"):
        kh.digest_bytes(os.urandom(4 * BLOCK + 8), HashKey.new(8))


def test_nh_level_words_and_padding(key):
    k = key.level_tensor(0, "cpu")
    w = torch.arange(BLOCK + 3, dtype=torch.int32)
    out = kh.nh_level(w, k)
    assert out.dtype == torch.int64 and out.numel() == 4
    padded = torch.zeros(2 * BLOCK, dtype=torch.int32)
    padded[: w.numel()] = w
    assert torch.equal(out, kh.nh_level(padded, k))  # the last block is zero-padded


def test_the_length_is_part_of_the_digest(key):
    data = os.urandom(100)
    assert kh.digest_bytes(data, key) != kh.digest_bytes(data + b"\0", key)
    assert kh.digest_bytes(b"", key) != kh.digest_bytes(b"\0" * 8, key)


# ---- no edit pattern is blind ---------------------------------------------------------
def _edits(base):
    """(name, edited copy) for every pattern; each differs from ``base`` in its bytes."""
    n = base.numel()
    out = []
    for at in (0, 1, BLOCK - 2, BLOCK - 1, 2 * BLOCK + 7, n - 3):
        e = base.clone()  # +1, -2, +1 on adjacent words: both linear sums unchanged
        e[at : at + 3] += torch.tensor([1, -2, 1], dtype=torch.int32)
        out.append((f"cancel+1-2+1@{at}", e))
    e = base.clone()  # two opposite dipoles: sum and position-weighted sum unchanged
    e[10] += 1
    e[11] -= 1
    e[BLOCK + 500] -= 1
    e[BLOCK + 501] += 1
    out.append(("dipoles", e))
    e = base.clone()
    e[[5, 6]] = e[[6, 5]]
    out.append(("swap adjacent words", e))
    e = base.clone()
    e[[4, 4 + 2 * BLOCK]] = e[[4 + 2 * BLOCK, 4]]
    out.append(("swap words across blocks", e))
    rows = base[: 3 * BLOCK].clone().view(-1, 64)
    rows[[3, 40]] = rows[[40, 3]]
    e = base.clone()
    e[: 3 * BLOCK] = rows.view(-1)
    out.append(("swap rows", e))
    e = base.clone()
    e[[0, 1]] = e[[1, 0]]
    e[[2, 3]] = e[[3, 2]]
    out.append(("swap the words of two pairs", e))
    for word, bit in ((0, 0), (1, 31), (BLOCK, 17), (n - 1, 5)):
        e = base.clone()
        e[word] ^= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32)
        out.append((f"bit flip {word}:{bit}", e))
    return [(name, e) for name, e in out if not torch.equal(e, base)]


def test_every_edit_pattern_changes_the_nh_digest(base, key):
    d0 = nh(base, key)
    cases = _edits(base)
    assert len(cases) >= 14
    for name, e in cases:
        assert nh(e, key) != d0, name
    assert nh(base.clone(), key) == d0  # equal bytes, equal digest


def test_float_patterns_change_the_nh_digest(key):
    f = torch.zeros(2 * BLOCK + 9, dtype=torch.float32)
    f[1::3] = 1.5
    d0 = nh(f, key)
    e = f.clone()
    e[0] = -0.0  # +0.0 → -0.0: equal as floats, different bytes
    assert bool((e == f).all()) and nh(e, key) != d0
    nan = torch.tensor([0x7FC00000, 0x7FC00001, -0x00400000], dtype=torch.int32).view(torch.float32)
    a, b = f.clone(), f.clone()
    a[BLOCK] = nan[0]
    b[BLOCK] = nan[1]  # another NaN payload
    assert nh(a, key) != nh(b, key)
    b[BLOCK] = nan[2]  # sign-flipped NaN
    assert nh(a, key) != nh(b, key)


def test_bf16_pairs_change_the_nh_digest(key):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * BLOCK + 6, generator=g).to(torch.bfloat16)
    d0 = nh(x, key)
    e = x.clone()
    e[[0, 1]] = e[[1, 0]]  # the two halves of one 32-bit word swapped
    assert nh(e, key) != d0
    e = x.clone()
    e[2 * BLOCK + 1] = -e[2 * BLOCK + 1]
    assert nh(e, key) != d0
    z = torch.zeros(64, dtype=torch.bfloat16)
    mz = z.clone()
    mz[7] = -0.0
    assert nh(z, key) != nh(mz, key)
    e = x.clone()  # +1/-1 ulp on the two halves of one word
    v = e.view(torch.int16)
    v[10] += 1
    v[11] -= 1
    assert nh(e, key) != d0


def test_another_key_gives_another_digest(base):
    k1, k2 = HashKey.new(), HashKey.new()
    assert k1.material != k2.material
    assert nh(base, k1) != nh(base, k2)


# ---- GMAC (host memory) -----------------------------------------------------------------
def test_gmac_is_the_host_default_and_exact(base, key):
    d = kh.digest(base, key)
    assert d.algorithm == "gmac" and d.nbytes == base.numel() * 4
    assert kh.digest(base.clone(), key) == d
    for name, e in _edits(base):
        assert kh.digest(e, key) != d, name
    assert kh.digest(base, HashKey.new()) != d
    assert kh.digest(base[:-1], key) != d
    b = base.view(torch.uint8)
    assert kh.digest(torch.cat((b, torch.zeros(1, dtype=torch.uint8))), key) != d


def test_gmac_is_aes_gcm_tag_of_the_bytes(key):
    """The definition, through the library's one-shot AEAD call: the AES-256-GCM tag of an empty
    message whose associated data are the bytes, under the derived key and a zero nonce."""
    import hashlib
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    data = os.urandom(100_003)
    got = kh.digest_bytes(data, key, algorithm="gmac")
    k = hashlib.sha256(b"unisleep keyed hash gmac v1\0" + key.material).digest()
    tag = AESGCM(k).encrypt(bytes(12), b"", data)
    assert (got.lane_a, got.lane_b) == struct.unpack("<QQ", tag) and got.nbytes == len(data)


def test_gmac_over_pieces_equals_one_pass(key, monkeypatch):
    """Large tensors go to OpenSSL in pieces (one call takes < 2 GiB); the cut changes nothing."""
    t = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    whole = kh.digest(t, key)
    monkeypatch.setattr(kh, "_GMAC_PIECE", 4096 + 16 * 3)
    assert kh.digest(t, key) == whole
    monkeypatch.setattr(kh, "_GMAC_PIECE", 7)
    assert kh.digest(t, key) == whole


# ---- keys and digests -------------------------------------------------------------------
def test_derived_keys_are_deterministic_and_context_bound():
    a = HashKey.derive(b"group secret", b"update 7")
    assert a == HashKey.derive(b"group secret", b"update 7")
    assert len(a.material) == kh.MAX_LEVELS * kh.KEY_WORDS * 4
    assert a.material != HashKey.derive(b"group secret", b"update 8").material
    assert a.material != HashKey.derive(b"other secret", b"update 7").material
    with pytest.raises(ValueError):
        HashKey.derive(b"", b"x")
    assert "secret" in repr(a) and a.material.hex()[:16] not in repr(a)
    data = os.urandom(5000)
    assert kh.digest_bytes(data, a) == kh.digest_bytes(data, HashKey.derive(b"group secret", b"update 7"))


def test_a_key_derived_for_a_size_has_only_its_levels_the_first_ones_of_the_full_key():
    """An update derives only the levels its largest tensor needs (SHAKE-256 is an extendable
    output: they are the full key's first levels), at least one — never an empty key."""
    full = HashKey.derive(b"group secret", b"update 7")
    for nbytes, levels in ((0, 1), (4096, 1), (8 << 20, kh.tree_levels_of_bytes(8 << 20))):
        k = HashKey.derive(b"group secret", b"update 7", nbytes)
        assert k.levels == levels == kh.key_levels(nbytes) >= 1
        assert k.material == full.material[: len(k.material)]
        assert k.level_bytes(levels - 1) == full.level_bytes(levels - 1)
        with pytest.raises(ValueError):
            k.level_bytes(levels)  # an input larger than the key was made for is refused, not hashed
    t = torch.arange(3000, dtype=torch.int32)
    small, big = HashKey.derive(b"s", b"c", t.numel() * 4), HashKey.derive(b"s", b"c", 64 << 20)
    assert kh.digest(t, small, algorithm=kh.NH2) == kh.digest(t, big, algorithm=kh.NH2)  # NH: the same levels


def test_digest_round_trips_through_bytes(key):
    d = kh.digest_bytes(os.urandom(77), key)
    raw = d.to_bytes()
    assert len(raw) == 25 and Digest.from_bytes(raw) == d
    with pytest.raises(ValueError):
        Digest.from_bytes(raw[:-1])


# ---- the fused level-1 kernel's logic, on the CPU through Triton's interpreter -------------
@pytest.mark.slow
def test_fused_kernel_equals_nh_level_in_the_triton_interpreter(triton_interpreter_env):
    code = textwrap.dedent(
        """
        import torch
        from unisleep.keyed_hash import HashKey, nh_level, BLOCK
        from unisleep.backends.cuda import checksum as cs
        assert cs._triton_kernel() is not None, cs._nh1.error
        k = HashKey.new().level_tensor(0, "cpu")
        g = torch.Generator().manual_seed(5)
        for n in (0, 1, 2, 3, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 6, 9 * BLOCK + 1001):
            w = torch.randint(-(2**31), 2**31 - 1, (n + 1,), dtype=torch.int32, generator=g)
            for words in (w[:n], w[1:]):  # aligned, and 4 bytes off
                want = nh_level(words.clone(), k)
                for kind in ("pairs", "split"):
                    for bpp in (1, 4):
                        assert torch.equal(cs.nh_level1(words, k, bpp, 4, kind=kind), want), (n, kind, bpp)
        print("OK")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=triton_interpreter_env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]


# ---- a bucket's tensors hashed together (the transfer's trailers) ------------------------
BUCKET_LAYOUTS = [
    [(0, 0)],
    [(0, 8)],
    [(0, 13)],  # a ragged last pair: the bytes after it (the next slot's) must not count
    [(64, 8192), (8256, 8193), (16512, 1)],
    [(0, 2 << 20), (2 << 20, 0), ((2 << 20) + 64, 1000001)],  # two levels, an empty range
    [(0, 9 << 20), ((9 << 20) + 64, 7), ((9 << 20) + 128, (4 << 20) - 200)],  # three levels
]


@pytest.mark.parametrize("spans", BUCKET_LAYOUTS, ids=lambda s: f"{len(s)}-ranges-{sum(n for _, n in s)}B")
def test_bucket_lanes_equal_the_per_tensor_digests(spans, key):
    g = torch.Generator().manual_seed(len(spans))
    buf = torch.randint(0, 256, (max(o + n for o, n in spans) + 64,), dtype=torch.uint8, generator=g)
    got = kh.bucket_lanes(buf, spans, key, level=kh.nh_segments_reference)
    want = kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * len(spans))
    assert torch.equal(got, want)
    for i, (o, n) in enumerate(spans):  # and the plain-integer definition, for the small ones
        if n <= 20000:
            d = kh.reference_digest(bytes(buf[o: o + n].tolist()), key)
            assert [d.lane_a, d.lane_b] == [v & 0xFFFFFFFFFFFFFFFF for v in got[2 * i: 2 * i + 2].tolist()]


def test_bucket_lanes_see_every_byte_of_every_range_and_nothing_else(key):
    spans = [(0, 8193), (8256, 13), (8320, 3 * 8192)]
    buf = torch.randint(0, 256, (8320 + 3 * 8192 + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    base = kh.bucket_lanes(buf, spans, key, level=kh.nh_segments_reference).view(-1, 2)
    for pos, slot in ((0, 0), (8192, 0), (8256 + 12, 1), (8320 + 3 * 8192 - 1, 2)):
        b = buf.clone()
        b[pos] ^= 1
        got = kh.bucket_lanes(b, spans, key, level=kh.nh_segments_reference).view(-1, 2)
        changed = [i for i in range(3) if not torch.equal(got[i], base[i])]
        assert changed == [slot], (pos, changed)
    for pos in (8193, 8255, 8256 + 13, 8319):  # padding between ranges is not hashed
        b = buf.clone()
        b[pos] ^= 1
        assert torch.equal(kh.bucket_lanes(b, spans, key, level=kh.nh_segments_reference).view(-1, 2), base), pos


def test_bucket_lanes_fall_back_to_per_tensor_digests_off_8_bytes(key):
    buf = torch.randint(0, 256, (40000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    calls = []

    def level(*a):
        calls.append(1)
        return kh.nh_segments_reference(*a)

    spans = [(4, 9000), (9024, 100)]  # the first range is 4 bytes off: no table path
    got = kh.bucket_lanes(buf, spans, key, level=level)
    assert not calls
    assert torch.equal(got, kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * 2))


def test_bucket_lanes_fill_copies_and_hashes_in_one_pass_or_declines(key):
    spans = [(0, 8192 * 3), (8192 * 3, 0), (8192 * 3 + 64, 13), (8192 * 3 + 128, 8 * 1001), (8192 * 3 + 8192, 800)]
    g = torch.Generator().manual_seed(6)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for _, n in spans]
    wide = torch.randint(0, 256, (2 * 800,), dtype=torch.uint8, generator=g)
    srcs[4] = wide.view(-1, 2)[:, 0]  # not contiguous: declined, the caller copies
    buf = torch.randint(0, 256, (spans[-1][0] + 800 + 64,), dtype=torch.uint8, generator=g)
    bl = kh.BucketLanes(buf, spans, key, level=kh.nh_segments_reference, copy_level=kh.nh_segments_copy_reference)
    bl.fill_min = 0
    taken = [bl.fill(i, src.view(torch.int16) if i == 3 else src) for i, src in enumerate(srcs)]
    assert taken == [True, True, False, True, False]  # 13 bytes: not whole pairs; a strided view
    for i in (2, 4):
        o, n = spans[i]
        buf[o: o + n].copy_(srcs[i])
    got = bl.lanes()
    for (o, n), src in zip(spans, srcs):
        assert torch.equal(buf[o: o + n], src)
    assert torch.equal(got, kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * len(spans)))


@pytest.mark.slow
def test_bucket_lanes_fill_only_large_tensors_by_default(key):
    big = kh.BucketLanes.fill_min
    spans = [(0, big), (big, 4096), (big + 4096, big)]
    buf = torch.zeros(2 * big + 8192, dtype=torch.uint8)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)) for _, n in spans]
    bl = kh.BucketLanes(buf, spans, key, level=kh.nh_segments_reference, copy_level=kh.nh_segments_copy_reference)
    assert [bl.fill(i, s) for i, s in enumerate(srcs)] == [True, False, True]
    buf[big: big + 4096].copy_(srcs[1])
    assert torch.equal(bl.lanes(), kh.nh_lanes_many([buf[o: o + n] for o, n in spans], [key] * 3))


@pytest.mark.slow
def test_segmented_kernel_equals_the_reference_in_the_triton_interpreter(triton_interpreter_env):
    code = textwrap.dedent(
        """
        import torch
        from unisleep import keyed_hash as kh
        from unisleep.backends.cuda import checksum as cs
        assert cs._segments.get() is not None, cs._segments.error
        key = kh.HashKey.new()
        buf = torch.randint(0, 256, (3 * 8192 + 300,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        for spans in ([(0, 13)], [(0, 8193), (8256, 0), (8320, 3 * 8192 - 64 - 21)]):
            want = kh.bucket_lanes(buf, spans, key, level=kh.nh_segments_reference)
            assert torch.equal(kh.bucket_lanes(buf, spans, key, level=cs.nh_segments), want), spans
        spans = [(0, 8200), (8256, 3 * 8192)]
        srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _, n in spans]
        dst = torch.zeros(8256 + 3 * 8192 + 64, dtype=torch.uint8)
        bl = kh.BucketLanes(dst, spans, key, level=cs.nh_segments, copy_level=cs.nh_segments_copy)
        bl.fill_min = 0
        assert all(bl.fill(i, s) for i, s in enumerate(srcs))
        got = bl.lanes()
        assert all(torch.equal(dst[o: o + n], s) for (o, n), s in zip(spans, srcs))
        assert torch.equal(got, kh.bucket_lanes(dst, spans, key, level=kh.nh_segments_reference))
        print("OK")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=triton_interpreter_env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]


class _Scratch:
    """A scratch recording when the digests' temporaries are made under it and when it is closed."""

    def __init__(self):
        self.entered, self.closed = 0, 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        self.closed += 1


def test_start_digests_closes_its_scratch_once_the_values_are_read_or_on_failure(key):
    torch = pytest.importorskip("torch")
    srcs = [torch.arange(5000, dtype=torch.uint8), torch.arange(70000, dtype=torch.int32).view(torch.uint8)]
    s = _Scratch()
    pending = kh.start_digests(srcs, [key, key], algorithm=kh.NH2, scratch=s)
    assert s.entered == 1 and s.closed == 0  # still needed: the values are not read yet
    got = pending.result()
    assert s.closed == 1 and got == kh.digest_many(srcs, [key, key], algorithm=kh.NH2)
    pending.result()
    assert s.closed == 1  # once
    s = _Scratch()
    with pytest.raises(ValueError):  # a key too short for the input: refused, the scratch given back
        kh.start_digests([torch.zeros(1 << 20, dtype=torch.uint8)], [HashKey.new(64)], algorithm=kh.NH2, scratch=s)
    assert s.closed == 1
