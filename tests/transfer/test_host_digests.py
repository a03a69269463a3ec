"""The host-memory fast paths of an update's digests and packing give the same values as the
definitions they replace: one-call GMAC of each range against the streaming GMAC of each
slice, a bucket's pads at once against one pad per slot, and a memory copy against torch's."""

import torch

from unisleep.keyed_hash import GMAC, HashKey, digest, gmac_spans
from unisleep.transfer.manifest import pack_tensor
from unisleep.transfer.manifest import TensorSpec, UpdateSeal, check_bucket, plan_buckets, write_trailer


def test_gmac_of_ranges_is_the_digest_of_each_slice():
    key = HashKey.derive(b"s" * 32, b"test/1")
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, ((1 << 20) + 3 * 4096 + 77,), dtype=torch.uint8, generator=g)
    spans = [(0, 0), (0, 4096), (8, 13), (4096, (1 << 20) + 5)]  # the last one is over one call's size
    got = gmac_spans(buf, spans, key)
    want = [digest(buf[o: o + n], key, algorithm=GMAC) for o, n in spans]
    assert got == want
    other = gmac_spans(buf, spans, HashKey.derive(b"s" * 32, b"test/2"))
    assert all(a != b for a, b in zip(got[1:], other[1:]))  # keyed: another update's key differs


def test_pads_of_a_bucket_are_the_pads_of_its_slots():
    seal = UpdateSeal(HashKey.derive(b"s" * 32, b"t"), b"p" * 32, "g/n", 0, 3)
    signed = [v - (1 << 64) if v >= (1 << 63) else v for i in range(50) for v in seal.pad(2, i)]
    assert seal.pads(2, 50) == signed
    assert seal.pads(3, 50) != signed


def test_pack_tensor_copies_what_torch_copies():
    buf = torch.zeros(4096, dtype=torch.uint8)
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    for t in (base, base[:, 1:4], base.t(), base[2]):  # contiguous, strided, transposed, offset
        buf.zero_()
        pack_tensor(buf, 64, t.numel() * 4, t)
        assert torch.equal(buf[64: 64 + t.numel() * 4].view(torch.float32).view(t.shape), t)


def test_many_small_tensors_verify_and_each_edit_is_named():
    ts = [torch.randn(1024) for _ in range(300)]
    specs = [TensorSpec(f"t{i}", (1024,), "float32") for i in range(300)]
    plan = plan_buckets(specs, 1 << 30, max_tensors=None)[0]  # all 300 in one bucket
    assert len(plan.slots) == 300
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for s, t in zip(plan.slots, ts):
        pack_tensor(buf, s.offset, s.nbytes, t)
    seal = UpdateSeal(HashKey.derive(b"s" * 32, b"u"), b"p" * 32, "g/n", 0, 7)
    write_trailer(buf, plan, 7, seal)
    assert check_bucket(buf, plan, 7, seal) == (None, [])
    for i in (0, 137, 299):
        c = buf.clone()
        c[plan.slots[i].offset + 5] ^= 1
        assert check_bucket(c, plan, 7, seal) == (None, [i])
