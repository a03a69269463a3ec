"""Fast checks of the transfer pieces: bucket plans, checksums, argument errors, and a sender and
receiver on two threads of this process (real gloo over 127.0.0.1, real memfd)."""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import threading

import pytest
import torch

from unisleep.errors import InvalidArgumentError, InvalidTransitionError, TransferError
from unisleep.transfer import TensorSpec, TransferGroup, WeightReceiver, WeightSender
from unisleep.transfer.manifest import ALIGN, UpdateSeal, check_bucket, plan_buckets, write_trailer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import FaultySender  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plan_buckets_cuts_aligns_and_gives_big_tensors_their_own():
    specs = [TensorSpec("a", (10,), "float32"), TensorSpec("b", (3,), "bfloat16"),
             TensorSpec("big", (1000,), "float32"), TensorSpec("c", (5,), "int64")]
    plans = plan_buckets(specs, 256)
    assert [[specs[s.index].name for s in p.slots] for p in plans] == [["a", "b"], ["big"], ["c"]]
    for p in plans:
        assert all(s.offset % ALIGN == 0 for s in p.slots)
        assert p.data_bytes % 8 == 0 and p.total_bytes == p.data_bytes + 8 * (3 + 4 * len(p.slots))
    assert plans[1].slots[0].nbytes == 4000  # larger than the bucket: alone, not refused


def test_plan_buckets_cuts_many_small_tensors_into_buckets_of_at_most_bucket_tensors():
    """Many small tensors come in several buckets (so the receiver works on one while the sender
    packs the next), however large the bucket size; both sides cut the same way."""
    from unisleep.transfer.manifest import BUCKET_TENSORS

    specs = [TensorSpec(f"t{i}", (1024,), "uint8") for i in range(2 * BUCKET_TENSORS + 5)]
    plans = plan_buckets(specs, 1 << 30)
    assert [len(p.slots) for p in plans] == [BUCKET_TENSORS, BUCKET_TENSORS, 5]
    assert [s.index for p in plans for s in p.slots] == list(range(len(specs)))
    assert len(plan_buckets(specs, 1 << 30, max_tensors=None)) == 1


def _sealed_bucket(seal, tensors):
    specs = [TensorSpec(f"t{i}", tuple(t.shape), str(t.dtype).replace("torch.", "")) for i, t in enumerate(tensors)]
    plan = plan_buckets(specs, 1 << 30)[0]
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for s, t in zip(plan.slots, tensors):
        buf[s.offset: s.offset + s.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    write_trailer(buf, plan, 7, seal)
    return buf, plan


def _seal(seq=7, secret=b"s" * 32):
    from unisleep.keyed_hash import HashKey

    return UpdateSeal(HashKey.derive(secret, b"test/%d" % seq), b"p" * 32, "g/n", 0, seq)


def test_keyed_digest_sees_the_edits_the_positional_sum_missed():
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-(2**31), 2**31 - 1, (3 * 1024 + 3,), dtype=torch.int32, generator=g)
    seal = _seal()
    buf, plan = _sealed_bucket(seal, [t, t[:5].clone()])
    assert check_bucket(buf, plan, 7, seal) == (None, [])
    o = plan.slots[0].offset
    words = buf[o: o + 4096].view(torch.int64)
    edits = {
        "two 8-byte words swapped in one row": lambda w: w[[1, 0]].clone(),
        "+1/-1 inside one row": lambda w: torch.stack([w[0] + 1, w[1] - 1]),
    }
    for what, edit in edits.items():
        c = buf.clone()
        cw = c[o: o + 4096].view(torch.int64)
        cw[:2] = edit(words[:2].clone())
        assert not torch.equal(c, buf)
        assert check_bucket(c, plan, 7, seal)[1] == [0], what
    for i in (o, o + 4095, plan.slots[1].offset + 19):  # one flipped bit anywhere
        c = buf.clone()
        c[i] ^= 1
        assert check_bucket(c, plan, 7, seal)[1] != [], i
    # the digest of another update (or moved from another slot) does not fit
    assert check_bucket(buf, plan, 7, _seal(seq=8))[1] == [0, 1]
    wrong_trailer = check_bucket(buf, plan, 6, seal)[0]
    assert wrong_trailer and "expected update 6" in wrong_trailer


def test_device_side_trailer_agrees_with_the_host_rules_and_sees_edits():
    """The writer and checker that run on an accelerator (masked NH digests made and compared
    where the bytes are, one small read) run here on CPU tensors: their trailer must be what the
    host rules accept for NH, and every edit must still be seen."""
    from unisleep.transfer.manifest import _check_on_device, _write_on_device

    g = torch.Generator().manual_seed(1)
    ts = [torch.randint(-(2**31), 2**31 - 1, (5000,), dtype=torch.int32, generator=g), torch.randn(33, generator=g)]
    seal = _seal()
    buf, plan = _sealed_bucket(None, ts)
    tr = buf[plan.data_bytes: plan.total_bytes].view(torch.int64)
    _write_on_device(buf, tr, plan, [7, plan.index, len(plan.slots)], seal)
    assert check_bucket(buf, plan, 7, seal) == (None, [])  # the host checker, reading "nh2" from the trailer
    assert _check_on_device(buf, tr, plan, 7, seal) == (None, [])
    for i, want in ((plan.slots[0].offset + 4, [0]), (plan.slots[1].offset + 131, [1])):
        c = buf.clone()
        c[i] ^= 0x10
        ctr = c[plan.data_bytes: plan.total_bytes].view(torch.int64)
        assert _check_on_device(c, ctr, plan, 7, seal) == (None, want)
    assert _check_on_device(buf, tr, plan, 7, _seal(seq=8))[1] == [0, 1]  # another update's key
    problem, bad = _check_on_device(buf, tr, plan, 6, seal)
    assert "expected update 6" in problem and bad == [0, 1]
    c = buf.clone()  # a slot that claims another algorithm or length is refused
    ctr = c[plan.data_bytes: plan.total_bytes].view(torch.int64)
    ctr[3 + 4 * 1] = 1
    ctr[3 + 1] += 8
    assert _check_on_device(c, ctr, plan, 7, seal) == (None, [0, 1])


def test_no_vendor_names_in_the_core_transfer_code():
    words = re.compile(r"cuda|nccl|npu|hccl|rccl|\bhip\b", re.I)
    for rel in ("unisleep/transfer", "unisleep/bench/transfer.py"):
        path = os.path.join(ROOT, rel)
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py")] if os.path.isdir(path) else [path]
        for f in files:
            for n, line in enumerate(open(f), 1):
                assert not words.search(line), f"{f}:{n}: {line.strip()}"


def _device_group(free_bytes):
    """The two attributes default_bucket_bytes reads, as a device group would have them."""
    from types import SimpleNamespace

    plat = SimpleNamespace(is_accelerator=True, devices=[SimpleNamespace(free_bytes=free_bytes)])
    return SimpleNamespace(platform=plat, device_index=0)


@pytest.mark.parametrize("free_gib,mib", [(8, 512), (20, 1024), (64, 1024), (40, 1024), (140, 1024), (0.1, 16)])
def test_default_buckets_take_an_eighth_of_free_memory_for_two_up_to_1_gib_on_every_path(free_gib, mib):
    from unisleep.transfer.sender import default_bucket_bytes

    if torch.accelerator.is_available():
        pytest.skip("reads this machine's device instead of the free memory given")
    g = _device_group(int(free_gib * (1 << 30)))
    assert default_bucket_bytes(g) == default_bucket_bytes(g, "collective") == default_bucket_bytes(g, "ipc") == mib << 20


def test_host_ipc_buckets_keep_the_collective_cap():
    from unisleep.platform import detect_platform
    from unisleep.transfer.sender import MAX_DEFAULT_BUCKET, default_bucket_bytes
    from types import SimpleNamespace

    g = SimpleNamespace(platform=detect_platform("host"), device_index=0)
    assert default_bucket_bytes(g, "ipc") == default_bucket_bytes(g) <= MAX_DEFAULT_BUCKET


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        TransferGroup.create("tcp://127.0.0.1:1", 0, 1, platform="host")
    with pytest.raises(InvalidArgumentError):
        TransferGroup.create("http://x", 0, 2, platform="host")


# ---------------------------------------------------------------------------- two threads
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair():
    addr = f"tcp://127.0.0.1:{_port()}"
    out = {}

    def mk(r):
        out[r] = TransferGroup.create(addr, r, 2, platform="host", timeout_s=20)

    ts = [threading.Thread(target=mk, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return out[0], out[1]


@pytest.fixture(scope="module")
def pair():
    g0, g1 = _pair()
    yield g0, g1
    g0.close(), g1.close()


def _both(send, recv):
    res = {}

    def run(k, f):
        try:
            res[k] = f()
        except Exception as e:  # noqa: BLE001
            res[k] = e

    ts = [threading.Thread(target=run, args=("s", send)), threading.Thread(target=run, args=("r", recv))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    return res["s"], res["r"]


def _weights(v):
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "n": torch.arange(5) * v}


#: the ways bytes move between two processes of one machine: the collective path over a Unix
#: socket (its default there), over gloo as between machines (encrypted, or not), and shared memory
WAYS = {"collective": {"path": "collective"}, "ipc": {"path": "ipc"},
        "gloo": {"path": "collective", "via": "gloo"}, "gloo-plain": {"path": "collective", "via": "gloo", "encrypt": False}}


@pytest.mark.parametrize("way", list(WAYS))
def test_apply_callback_and_module_target(pair, way):
    g0, g1 = pair
    path = WAYS[way]["path"]
    got = []
    rx = WeightReceiver(g1, apply=lambda pairs: got.extend((n, t.clone()) for n, t in pairs))
    tx = WeightSender(g0, bucket_bytes=4096, **WAYS[way])
    s, r = _both(lambda: tx.send(_weights(1), "step-1"), rx.receive)
    assert not isinstance(r, Exception), r
    assert r.version == "step-1" and r.path == path and rx.version == "step-1"
    assert dict(got).keys() == _weights(1).keys()
    assert all(torch.equal(dict(got)[k], v) for k, v in _weights(1).items())
    # nn.Module as the target, parameters updated in place (same objects)
    m = torch.nn.Linear(70, 300)
    ptr = m.weight.data_ptr()
    rx2 = WeightReceiver(g1, target=m)
    src = {"weight": torch.randn(300, 70), "bias": torch.randn(300)}
    s, r = _both(lambda: tx.send(src, "step-2"), rx2.receive)
    assert not isinstance(r, Exception), r
    assert torch.equal(m.weight, src["weight"]) and torch.equal(m.bias, src["bias"]) and m.weight.data_ptr() == ptr


@pytest.mark.parametrize("way", ["collective", "gloo", "gloo-plain", "ipc"])
def test_a_bucket_altered_on_the_way_is_refused(pair, way):
    """Encrypted (gloo): the bucket's AES-GCM tag fails and all its tensors are named; otherwise the
    keyed digest names the one altered tensor.  The receiver keeps its previous version."""
    g0, g1 = pair
    tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
    rx = WeightReceiver(g1, target=tgt)
    tx = FaultySender(g0, bucket_bytes=1 << 20, **WAYS[way], corrupt={0})
    s, r = _both(lambda: tx.send(_weights(8), 8), rx.receive)
    assert isinstance(r, TransferError) and "corrupt" in str(r) and "w" in str(r), r
    if way == "gloo":
        assert "AES-GCM" in str(r) and "AES-GCM" in str(s), (r, s)
    else:
        assert "keyed digest" in str(r), r
    assert isinstance(s, TransferError) and rx.version is None
    assert torch.count_nonzero(tgt["w"]) == 0


def test_target_that_does_not_fit_is_refused_before_bytes_move(pair):
    g0, g1 = pair
    tgt = {"w": torch.zeros(300, 70), "b": torch.zeros(7, dtype=torch.bfloat16)}  # no "n"
    rx = WeightReceiver(g1, target=tgt)
    s, r = _both(lambda: WeightSender(g0, path="collective").send(_weights(3), 3), rx.receive)
    assert isinstance(r, TransferError) and "not in the target: n" in str(r)
    assert isinstance(s, TransferError) and "nothing was sent" in str(s)
    assert torch.count_nonzero(tgt["w"]) == 0 and rx.version is None


def test_guard_callable(pair):
    g0, g1 = pair
    tgt = {k: torch.zeros_like(v) for k, v in _weights(4).items()}
    awake = {"v": False}
    rx = WeightReceiver(g1, target=tgt, guard=lambda: awake["v"])
    tx = WeightSender(g0, path="collective")
    s, r = _both(lambda: tx.send(_weights(4), 4), rx.receive)
    assert isinstance(r, InvalidTransitionError) and "wake the weights first" in str(r)
    assert isinstance(s, InvalidTransitionError)
    awake["v"] = True
    s, r = _both(lambda: tx.send(_weights(4), 4), rx.receive)
    assert not isinstance(r, Exception), r
    assert all(torch.equal(tgt[k], v) for k, v in _weights(4).items())


def test_streaming_mode_and_generator_with_specs(pair):
    g0, g1 = pair
    w = _weights(5)
    tgt = {k: torch.zeros_like(v) for k, v in w.items()}
    rx = WeightReceiver(g1, target=tgt, staged=False)
    specs = [(k, tuple(v.shape), v.dtype) for k, v in w.items()]
    tx = WeightSender(g0, bucket_bytes=1024, path="collective")
    s, r = _both(lambda: tx.send(((k, v) for k, v in w.items()), 5, specs=specs), rx.receive)
    assert not isinstance(r, Exception), r
    assert all(torch.equal(tgt[k], v) for k, v in w.items())
    # a generator that does not match its specs: the sender aborts, the receiver keeps version 5
    bad = ((k, v.double() if k == "n" else v) for k, v in _weights(6).items())
    s, r = _both(lambda: tx.send(bad, 6, specs=specs), rx.receive)
    assert isinstance(s, TransferError) and "specs say" in str(s)
    assert isinstance(r, TransferError) and "aborted" in str(r) and rx.version == 5


@pytest.mark.slow
def test_the_collectives_sealed_store_lives_as_long_as_its_backend():
    """A backend that bootstraps after its constructor (the device collective reads its unique id on the first
    collective) calls back into the Python store: it must not have been collected by then."""
    import gc
    import weakref

    g0, g1 = _pair()
    seen = []
    try:
        for g in (g0, g1):
            real = g._collective.create_backend

            def spy(store, *a, _real=real, **k):
                seen.append(weakref.ref(store))
                return _real(store, *a, **k)

            g._collective = type("Spied", (), {"create_backend": staticmethod(spy),
                                               "SAME_DEVICE_OK": g._collective.SAME_DEVICE_OK})
            g.epoch += 1  # as after a broken update: the next use connects a new backend
        _both(g0.process_group, g1.process_group)
        gc.collect()
        assert len(seen) == 2 and all(r() is not None for r in seen)
        assert all(type(r()).__name__ == "SealedStore" for r in seen)
        r = seen[0]()
        r.set("k", b"v")
        assert r.get("k") == b"v"  # still the Python store: its authenticated get answers
    finally:
        g0.close(), g1.close()


# ------------------------------------------------------------ bucket memory after the update
BIG = 40 << 20  # above glibc's largest mmap threshold (32 MiB): each such buffer is its own mapping


def _big_anonymous_mappings() -> set:
    """Address ranges of this process's anonymous read-write mappings the size of a bucket
    buffer of BIG bytes (read from the kernel, not from any bookkeeping); the heaps of glibc's
    per-thread arenas (64 MiB-aligned reservations) are not buffers."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if (len(parts) == 5 and parts[1] == "rw-p" and parts[4] == "0" and BIG - (4 << 20) <= hi - lo <= 2 * BIG
                    and lo % (64 << 20)):
                out.add((lo, hi))
    return out


def _memfd_buffers() -> tuple[int, int]:
    """(open descriptors, mappings) of the transfer's shared bucket memory in this process."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:unisleep-transfer" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("memfd:unisleep-transfer" in line for line in f)
    return fds, maps


@pytest.mark.parametrize("way,staged", [("collective", True), ("ipc", True),  # each ~0.6 s: the rest in the slow lane
                                        pytest.param("collective", False, marks=pytest.mark.slow),
                                        pytest.param("gloo", False, marks=pytest.mark.slow),
                                        pytest.param("gloo-plain", True, marks=pytest.mark.slow)])
def test_an_update_leaves_no_bucket_memory_behind(pair, way, staged):
    """When send() and receive() return, neither side holds bucket memory any more — neither the
    sender's send buffers (host buffers, shared memfds) nor the receiver's (imported memfds,
    receive buffers, staged copies): read from /proc/self, not from the objects' own counts.
    ``keep_buffers=True`` keeps them for the next update (and says so)."""
    g0, g1 = pair
    src = {"w": torch.arange(BIG // 4 - 1024, dtype=torch.int32)}
    tgt = {"w": torch.zeros_like(src["w"])}
    rx = WeightReceiver(g1, target=tgt, staged=staged)
    tx = WeightSender(g0, bucket_bytes=BIG, keep_buffers=False, **WAYS[way])
    gc.collect()  # senders and receivers that other tests dropped (in reference cycles) close theirs now
    before_maps, before_fds = _big_anonymous_mappings(), _memfd_buffers()
    s, r = _both(lambda: tx.send(src, 1), rx.receive)
    assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
    assert torch.equal(tgt["w"], src["w"])
    leaked = sorted(_big_anonymous_mappings() - before_maps)
    assert not leaked, f"{way}: {len(leaked)} bucket-sized mapping(s) still there after the update: {leaked}"
    assert _memfd_buffers() == before_fds == (0, 0), f"{way}: shared bucket memory still open/mapped"
    assert tx.buffer_bytes() == 0 and rx.buffer_bytes() == 0
    assert {"buffers", "release"} <= set(s.phases) and {"buffers", "release"} <= set(r.phases), (s.phases, r.phases)
    # kept on request: the next update reuses them, and both sides say how much they hold
    tx.keep_buffers = True
    s, r = _both(lambda: tx.send({"w": src["w"] + 1}, 2), rx.receive)
    assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
    assert torch.equal(tgt["w"], src["w"] + 1)
    assert tx.buffer_bytes() >= BIG
    if way == "ipc":
        assert _memfd_buffers()[0] >= 1 and rx.buffer_bytes() >= BIG
    # and given back by the next update that does not keep them
    tx.keep_buffers = False
    s, r = _both(lambda: tx.send({"w": src["w"] + 2}, 3), rx.receive)
    assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
    assert torch.equal(tgt["w"], src["w"] + 2)
    assert not sorted(_big_anonymous_mappings() - before_maps) and _memfd_buffers() == (0, 0)
    assert tx.buffer_bytes() == 0 and rx.buffer_bytes() == 0


def test_bucket_memory_is_kept_by_default_on_the_host_platform(pair):
    """The default (None) keeps the buckets where the platform is the host: there fresh pages cost
    the kernel's zeroing on every update (docs/benchmarks.md); an accelerator's are given back."""
    g0, g1 = pair
    assert not g0.platform.is_accelerator
    src = {"w": torch.arange(BIG // 4 - 1024, dtype=torch.int32)}
    tgt = {"w": torch.zeros_like(src["w"])}
    rx = WeightReceiver(g1, target=tgt)
    tx = WeightSender(g0, bucket_bytes=BIG)
    assert tx.keep_buffers is None
    s, r = _both(lambda: tx.send(src, 1), rx.receive)
    assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
    assert torch.equal(tgt["w"], src["w"]) and tx.buffer_bytes() >= BIG


def test_a_sender_dropped_without_close_gives_back_what_it_kept(pair):
    """The IPC path's accept thread keeps its channel alive; a sender that kept its buffers and is
    then dropped without close() still closes its socket and gives its shared memory back (a
    framework that makes a sender per step would otherwise leak one bucket pair per step)."""
    g0, g1 = pair
    src = {"w": torch.arange(BIG // 4 - 1024, dtype=torch.int32)}
    tgt = {"w": torch.zeros_like(src["w"])}
    rx = WeightReceiver(g1, target=tgt)
    tx = WeightSender(g0, bucket_bytes=BIG, keep_buffers=True, path="ipc")
    s, r = _both(lambda: tx.send(src, 1), rx.receive)
    assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
    assert _memfd_buffers()[0] >= 1
    rx.close()
    del tx, s, r
    gc.collect()
    assert _memfd_buffers() == (0, 0)


def test_keep_buffers_must_be_a_bool(pair):
    with pytest.raises(InvalidArgumentError, match="keep_buffers"):
        WeightSender(pair[0], keep_buffers="yes")
