"""MemoryLifecycle on the host backend: real memfd memory, real spill files, no mocks.

"Freed" is measured where the kernel counts it: the memfd's st_blocks, read
both through ``resident_bytes()`` and independently from the kernel's view of this process's
open memfds (/proc/self/fd), never RSS.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import threading
import warnings
import zlib

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.backends.host import HostDriver
from unisleep.errors import (
    HostBudgetError,
    InvalidArgumentError,
    InvalidTransitionError,
    UnisleepError,
    UnknownTagError,
    UnsupportedError,
)

GiB, MiB = 1 << 30, 1 << 20

PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- helpers
def kernel_memfds() -> tuple[int, int]:
    """(bytes, count) of every unisleep memfd this process holds, from the kernel's fd table."""
    total = count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("/memfd:unisleep"):
                total += os.fstat(int(name)).st_blocks * 512
                count += 1
        except OSError:
            continue
    return total, count


def spill_files(spill_dir: str) -> dict[str, tuple]:
    """relative path -> (size, allocated bytes, sha1) of every file under spill_dir."""
    out = {}
    for root, _, files in os.walk(spill_dir):
        for f in files:
            if f == ".owner":  # the owner lock of the spill directory, not a backup
                continue
            p = os.path.join(root, f)
            st = os.stat(p)
            with open(p, "rb") as fh:
                digest = hashlib.sha1(fh.read()).hexdigest() if st.st_size <= 64 * MiB else None
            out[os.path.relpath(p, spill_dir)] = (st.st_size, st.st_blocks * 512, digest, st.st_ino, st.st_mtime_ns)
    return out


def fill_random(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill t's bytes with seeded random bytes (works for every dtype, bool included)."""
    b = t.view(-1).view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Snapshot:
    """Everything observable about a lifecycle; two snapshots compare equal iff nothing changed."""

    def __init__(self, lc: MemoryLifecycle, tensors: dict[str, tuple[str, torch.Tensor]], spill_dir: str):
        self.state = lc.state()
        self.sleeping = lc.is_sleeping
        self.resident = {tag: lc.resident_bytes(tag) for tag in self.state}
        self.total = lc.resident_bytes()
        self.kernel = kernel_memfds()
        self.files = spill_files(spill_dir)
        self.ptrs = {k: t.data_ptr() for k, (_, t) in tensors.items()}
        # sleeping memory is unmapped (touching it faults): copy only what is awake
        self.data = {k: as_bytes(t).clone() for k, (tag, t) in tensors.items() if self.state[tag] == "awake"}
        self.report = lc.last_report

    def assert_same(self, other: "Snapshot") -> None:
        assert other.state == self.state
        assert other.sleeping == self.sleeping
        assert other.resident == self.resident
        assert other.total == self.total
        assert other.kernel == self.kernel
        assert other.files == self.files
        assert other.ptrs == self.ptrs
        assert other.data.keys() == self.data.keys()
        for k in self.data:
            assert torch.equal(other.data[k], self.data[k]), k
        assert other.report is self.report


def make_tagged(lc, sizes=(("weights", 4 * MiB), ("kv_cache", 8 * MiB), ("graph", 1 * MiB))):
    tensors = {}
    for i, (tag, n) in enumerate(sizes):
        t = lc.empty((n,), torch.uint8, tag=tag)
        fill_random(t, 100 + i)
        tensors[tag] = (tag, t)
    return tensors


# ----------------------------------------------------------------------------- the "done when"
@pytest.mark.slow
@pytest.mark.bigmem
def test_done_when_1gib_weights_2gib_kv_level1(lifecycle, spill_dir):
    lc = lifecycle
    base_kernel, base_count = kernel_memfds()
    w = lc.empty((GiB // 8,), torch.int64, tag="weights")
    kv = lc.empty((2 * GiB // 2,), torch.float16, tag="kv_cache")
    torch.arange(w.numel(), out=w)
    w.mul_(2654435761).bitwise_xor_(0x5DEECE66D)  # not a trivial byte pattern
    kv.fill_(1.5)
    crc = zlib.crc32(w.numpy())
    probe_idx = torch.tensor([0, 1, 12345, w.numel() // 2, w.numel() - 1])
    probe = w[probe_idx].clone()
    ptrs = (w.data_ptr(), kv.data_ptr())

    before = lc.resident_bytes()
    assert before >= 3 * GiB
    assert lc.resident_bytes("weights") >= GiB and lc.resident_bytes("kv_cache") >= 2 * GiB
    kb_before, _ = kernel_memfds()
    assert kb_before - base_kernel >= 3 * GiB

    rep = lc.sleep(1)
    after = lc.resident_bytes()
    assert before - after >= 0.99 * 3 * GiB
    assert after == 0
    # independent of unisleep's bookkeeping: the kernel holds no unisleep memfd pages any more
    kb_after, cnt_after = kernel_memfds()
    assert kb_before - kb_after >= 0.99 * 3 * GiB
    assert (kb_after, cnt_after) == (base_kernel, base_count)
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}
    assert lc.is_sleeping
    assert rep is lc.last_report and "sleep" in rep.operation
    assert sorted(rep.tags) == ["kv_cache", "weights"]
    assert rep.bytes_released >= 3 * GiB and rep.bytes_copied == GiB
    assert rep.seconds > 0 and rep.gbps > 0

    # the spill file holds the 1 GiB of weights, really written (not sparse)
    files = [os.path.join(r, f) for r, _, fs in os.walk(spill_dir) for f in fs if f.endswith(".bin")]
    assert len(files) == 1
    st = os.stat(files[0])
    assert st.st_size == GiB and st.st_blocks * 512 >= GiB
    with open(files[0], "rb") as fh:
        file_crc = 0
        while chunk := fh.read(64 * MiB):
            file_crc = zlib.crc32(chunk, file_crc)
    assert file_crc == crc

    rep = lc.wake_up()
    assert rep.operation == "wake_up" and rep.bytes_copied == GiB
    assert lc.state() == {"weights": "awake", "kv_cache": "awake"}
    assert not lc.is_sleeping
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    assert zlib.crc32(w.numpy()) == crc
    assert torch.equal(w[probe_idx], probe)
    assert kv.count_nonzero().item() == 0  # discarded bytes come back zeroed
    assert lc.resident_bytes() >= 3 * GiB
    assert spill_files(spill_dir) == {}  # the backup is gone once restored


# ----------------------------------------------------------------------------- byte-exact restore
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.bool]
SIZES = [1, 3, 511, 4095, 4096, 4097, 65_537, (1 << 20) + 13]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"chunk_bytes": 3 * PAGE},  # several physical chunks per region
        {"driver": {"granularity": 64 * 1024}},  # coarser granularity, aligned reservations
    ],
    ids=["default", "chunked", "gran64k"],
)
def test_byte_exact_restore_many_sizes_dtypes(spill_dir, config):
    platform = HostDriver(**config["driver"]) if "driver" in config else "host"
    lc = MemoryLifecycle(platform, spill_dir=spill_dir, chunk_bytes=config.get("chunk_bytes"))
    try:
        tensors = {}
        rng = random.Random(7)
        for i, dt in enumerate(DTYPES):
            for n in rng.sample(SIZES, 4):
                for tag in ("weights", "kv_cache", "extra"):
                    t = lc.empty((n,), dt, tag=tag)
                    assert t.dtype == dt and t.shape == (n,)
                    assert as_bytes(t).count_nonzero().item() == 0  # new memory reads zero
                    tensors[(tag, str(dt), n, i)] = t
        # multi-dimensional shapes too
        tensors[("weights", "2d", 0, 0)] = lc.empty((37, 129), torch.float32, tag="weights")
        tensors[("kv_cache", "3d", 0, 0)] = lc.empty((3, 5, 4099), torch.bfloat16, tag="kv_cache")
        ptrs = {k: t.data_ptr() for k, t in tensors.items()}
        for cycle in range(3):
            expect = {}
            for j, (k, t) in enumerate(tensors.items()):
                fill_random(t, 1000 * cycle + j)  # new contents every cycle: no stale backup may leak
                expect[k] = as_bytes(t).clone()
            level = 1 if cycle != 1 else 2
            lc.sleep(level, offload_tags=["extra"])
            assert lc.resident_bytes() == 0
            lc.wake_up()
            for k, t in tensors.items():
                tag = k[0]
                assert t.data_ptr() == ptrs[k]
                if tag == "kv_cache" or (tag == "weights" and level == 2):
                    assert as_bytes(t).count_nonzero().item() == 0, k
                else:
                    assert torch.equal(as_bytes(t), expect[k]), k
            assert spill_files(spill_dir) == {}
    finally:
        lc.close()


def test_fresh_allocation_is_zero_and_shape(lifecycle):
    t = lifecycle.empty((2, 3, 4), torch.float64, tag="weights")
    assert t.shape == (2, 3, 4) and t.dtype == torch.float64 and t.is_contiguous()
    assert t.count_nonzero().item() == 0
    s = lifecycle.empty(10, tag="weights")  # int shape, default dtype
    assert s.shape == (10,)


def test_empty_requires_tag(lifecycle):
    with pytest.raises(TypeError):
        lifecycle.empty((4,), torch.float32)
    with pytest.raises(InvalidArgumentError):
        lifecycle.empty((4,), torch.float32, tag="")


# ----------------------------------------------------------------------------- illegal moves change nothing
def _illegal_setups():
    """(name, setup(lc), move(lc), error class)."""

    def awake(lc):
        pass

    def asleep1(lc):
        lc.sleep(1)

    def asleep2(lc):
        lc.sleep(2)

    def kv_discarded(lc):
        lc.discard(["kv_cache"])

    return [
        ("level3", awake, lambda lc: lc.sleep(3), InvalidArgumentError),
        ("level0", awake, lambda lc: lc.sleep(0), InvalidArgumentError),
        ("unknown-offload-tag", awake, lambda lc: lc.sleep(1, offload_tags=["nope"]), UnknownTagError),
        ("unknown-sleep-tag", awake, lambda lc: lc.sleep(2, tags=["kv_cache", "nope"]), UnknownTagError),
        ("offload-tag-outside-tags", awake, lambda lc: lc.sleep(2, offload_tags=["graph"], tags=["kv_cache"]),
         InvalidArgumentError),
        ("unknown-wake-tag", asleep1, lambda lc: lc.wake_up(["weights", "nope"]), UnknownTagError),
        ("unknown-discard-tag", awake, lambda lc: lc.discard(["kv_cache", "nope"]), UnknownTagError),
        ("unknown-resident-tag", awake, lambda lc: lc.resident_bytes("nope"), UnknownTagError),
        ("level1-after-level2", asleep2, lambda lc: lc.sleep(1), InvalidTransitionError),
        ("level2-after-level1", asleep1, lambda lc: lc.sleep(2), InvalidTransitionError),
        ("offload-a-discarded-tag", kv_discarded, lambda lc: lc.sleep(1, offload_tags=["kv_cache"]),
         InvalidTransitionError),
        ("discard-offloaded", asleep1, lambda lc: lc.discard(["weights"]), InvalidTransitionError),
        ("empty-into-sleeping-tag", asleep1, lambda lc: lc.empty((8,), torch.uint8, tag="weights"),
         InvalidTransitionError),
        ("adopt-into-sleeping-tag", asleep1, lambda lc: lc.adopt(torch.ones(4), tag="kv_cache"),
         InvalidTransitionError),
        ("preserve-matches-nothing", awake, lambda lc: lc.preserve(["no.such.*"]), InvalidArgumentError),
        ("adopt-nothing", awake, lambda lc: lc.adopt({"a": 1}), InvalidArgumentError),
        ("pool-on-host", awake, lambda lc: lc.pool("kv_cache").__enter__(), UnsupportedError),
    ]


@pytest.mark.parametrize("name,setup,move,err", _illegal_setups(), ids=[s[0] for s in _illegal_setups()])
def test_illegal_move_raises_and_changes_nothing(lifecycle, spill_dir, name, setup, move, err):
    lc = lifecycle
    tensors = make_tagged(lc)
    setup(lc)
    before = Snapshot(lc, tensors, spill_dir)
    with pytest.raises(err) as exc:
        move(lc)
    assert isinstance(exc.value, UnisleepError)
    Snapshot(lc, tensors, spill_dir).assert_same(before)
    # and the lifecycle still works: wake restores the weights exactly unless level 2 dropped them
    lc.wake_up()
    assert not lc.is_sleeping


def test_bad_arguments_are_value_errors(lifecycle):
    make_tagged(lifecycle)
    with pytest.raises(ValueError):
        lifecycle.sleep(3)
    with pytest.raises(ValueError, match=r"'weights'.*'kv_cache'|'kv_cache'.*'weights'"):
        lifecycle.wake_up(["nope"])  # unknown tags list the known ones
    with pytest.raises(ValueError, match="known tags"):
        lifecycle.discard(["nope"])


def test_same_policy_sleep_is_noop_and_awake_wake_is_noop(lifecycle, spill_dir):
    lc = lifecycle
    tensors = make_tagged(lc)
    w = tensors["weights"][1]
    expect = as_bytes(w).clone()
    noop = lc.wake_up()  # everything awake already
    assert noop.tags == [] and noop.bytes_copied == 0
    lc.sleep(1)
    before = Snapshot(lc, tensors, spill_dir)
    rep = lc.sleep(1)
    assert rep.tags == [] and rep.bytes_released == 0 and rep.bytes_copied == 0
    after = Snapshot(lc, tensors, spill_dir)
    before.report = after.report  # the no-op's report is the only difference
    before.assert_same(after)
    lc.wake_up(["weights"])
    rep = lc.wake_up(["weights"])
    assert rep.tags == [] and rep.bytes_copied == 0
    assert torch.equal(as_bytes(w), expect)
    lc.wake_up()
    lc.sleep(2)
    rep = lc.sleep(2)
    assert rep.tags == [] and rep.bytes_released == 0


def test_host_budget_error_before_release(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, host_budget_bytes=2 * MiB)
    try:
        tensors = make_tagged(lc)  # weights are 4 MiB
        before = Snapshot(lc, tensors, spill_dir)
        with pytest.raises(HostBudgetError, match="host_budget_bytes"):
            lc.sleep(1)
        Snapshot(lc, tensors, spill_dir).assert_same(before)
        with pytest.raises(HostBudgetError):
            lc.sleep(1, offload_tags=["graph"])
        Snapshot(lc, tensors, spill_dir).assert_same(before)
        lc.sleep(2)  # needs no backup
        assert lc.resident_bytes() == 0
    finally:
        lc.close()
    with pytest.raises(InvalidArgumentError):
        MemoryLifecycle("host", spill_dir=spill_dir, host_budget_bytes=-1)


def test_host_budget_exactly_fits(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, host_budget_bytes=4 * MiB)
    try:
        tensors = make_tagged(lc)
        expect = as_bytes(tensors["weights"][1]).clone()
        lc.sleep(1)
        lc.wake_up()
        assert torch.equal(as_bytes(tensors["weights"][1]), expect)
        lc.sleep(1)  # the budget was given back on wake
        lc.wake_up()
    finally:
        lc.close()


def test_host_budget_counts_level2_preserved(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, host_budget_bytes=64 * 1024)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        lc.adopt(model)
        kv = lc.empty((MiB,), torch.uint8, tag="kv_cache")
        fill_random(kv, 3)
        tensors = {"w0": ("weights", model[0].weight), "kv": ("kv_cache", kv)}
        lc.preserve(["*.weight"])  # 2 x 256 KiB > 64 KiB
        before = Snapshot(lc, tensors, spill_dir)
        with pytest.raises(HostBudgetError):
            lc.sleep(2)
        Snapshot(lc, tensors, spill_dir).assert_same(before)
    finally:
        lc.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 MiB filesystem, so that the free-space check can be provoked for real (needs root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32M", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {r.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_spill_space_checked_before_release(small_tmpfs):
    with pytest.warns(RuntimeWarning):
        lc = MemoryLifecycle("host", spill_dir=small_tmpfs)
    try:
        tensors = make_tagged(lc, (("weights", 8 * MiB), ("kv_cache", MiB)))
        before = Snapshot(lc, tensors, small_tmpfs)
        with pytest.raises(HostBudgetError, match="does not fit"):
            lc.sleep(1)
        Snapshot(lc, tensors, small_tmpfs).assert_same(before)
    finally:
        lc.close()


def test_tmpfs_spill_dir_warns_and_points_at_caller(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        lc = MemoryLifecycle("host", spill_dir="/dev/shm")
    lc.close()
    hits = [w for w in rec if issubclass(w.category, RuntimeWarning) and "tmpfs" in str(w.message)]
    assert hits, [str(w.message) for w in rec]
    assert os.path.abspath(hits[0].filename) == os.path.abspath(__file__)  # stacklevel names the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a disk-backed directory must not warn
        MemoryLifecycle("host", spill_dir=str(tmp_path)).close()


# ----------------------------------------------------------------------------- level 2, partial wake, discard
def test_level2_preserve(lifecycle, spill_dir):
    lc = lifecycle
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    orig = {n: p.detach().clone() for n, p in model.state_dict().items()}
    lc.adopt(model)
    kv = lc.empty((MiB,), torch.uint8, tag="kv_cache")
    fill_random(kv, 5)
    matched = lc.preserve(["0.*", "2.bias"])
    assert matched == ["0.weight", "2.bias"]
    ptrs = {n: p.data_ptr() for n, p in model.state_dict().items()}
    lc.sleep(2)
    assert lc.state() == {"weights": "discarded", "kv_cache": "discarded"}
    assert lc.resident_bytes() == 0
    held = sum(v[0] for v in spill_files(spill_dir).values())
    assert held >= orig["0.weight"].numel() * 4 + orig["2.bias"].numel() * 4  # only preserved bytes kept
    assert held < 2 * (orig["0.weight"].numel() * 4 + orig["2.bias"].numel() * 4) + 4 * PAGE
    lc.wake_up()
    sd = model.state_dict()
    for n, v in sd.items():
        assert v.data_ptr() == ptrs[n]
        if n in matched:
            assert torch.equal(v, orig[n]), n
        else:
            assert v.count_nonzero().item() == 0, n
    assert kv.count_nonzero().item() == 0
    assert spill_files(spill_dir) == {}


class _Rotary(torch.nn.Module):
    """A rotary embedding's shape: a parameter-free module whose ``inv_freq`` is a
    non-persistent buffer computed at construction (not in the checkpoint)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)


def test_level2_keeps_adopted_module_buffers(lifecycle, spill_dir):
    """Level 2 keeps an adopted module's buffers (a rotary embedding's ``inv_freq``, a norm's
    running statistics) like preserved parameters, as vLLM's level 2 does ("the model's buffers
    are kept in CPU, like rope scaling tensors"); parameters not preserved come back as zeros."""
    lc = lifecycle
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), _Rotary(64))
    model[:2].train()(torch.randn(8, 64))  # running statistics that differ from their initial values
    bufs = {n: b.detach().clone() for n, b in model.named_buffers()}
    assert set(bufs) == {"1.running_mean", "1.running_var", "1.num_batches_tracked", "2.inv_freq"}
    lc.adopt(model)
    ptrs = {n: b.data_ptr() for n, b in model.named_buffers()}
    lc.sleep(2)
    assert lc.state() == {"weights": "discarded"}
    assert lc.resident_bytes() == 0
    held = sum(v[0] for v in spill_files(spill_dir).values())
    kept = sum(b.numel() * b.element_size() for b in bufs.values())
    assert kept <= held < kept + 4 * PAGE  # the buffers only, not the parameters
    lc.wake_up()
    for n, b in model.named_buffers():
        assert b.data_ptr() == ptrs[n], n
        assert torch.equal(b, bufs[n]), n
    for n, p in model.named_parameters():
        assert p.count_nonzero().item() == 0, n  # not preserved: zeroed
    assert spill_files(spill_dir) == {}


def test_level2_background_sleep_keeps_adopted_buffers(lifecycle):
    """The background level 2 (``background=True``) keeps them too: a tag with buffers is copied
    out behind the call, not released before it returns."""
    lc = lifecycle
    model = _Rotary(32)
    want = model.inv_freq.clone()
    lc.adopt(model)
    lc.sleep(2, background=True)
    lc.wait()
    lc.wake_up()
    assert torch.equal(model.inv_freq, want)


def test_partial_wake_weights_then_kv(lifecycle, spill_dir):
    lc = lifecycle
    tensors = make_tagged(lc)
    w, kv = tensors["weights"][1], tensors["kv_cache"][1]
    expect = as_bytes(w).clone()
    lc.sleep(1)
    rep = lc.wake_up(["weights"])
    assert rep.tags == ["weights"]
    assert lc.state() == {"weights": "awake", "kv_cache": "discarded", "graph": "discarded"}
    assert lc.is_sleeping
    assert torch.equal(as_bytes(w), expect)
    assert lc.resident_bytes("kv_cache") == 0 and lc.resident_bytes("weights") >= 4 * MiB
    rep = lc.wake_up(["kv_cache"])
    assert rep.tags == ["kv_cache"] and rep.bytes_copied == 0
    assert lc.state()["kv_cache"] == "awake" and lc.state()["graph"] == "discarded"
    assert kv.count_nonzero().item() == 0 and lc.resident_bytes("kv_cache") >= 8 * MiB
    with pytest.raises(InvalidArgumentError, match=r"list of tags.*\['graph'\]"):
        lc.wake_up("graph")  # a string where a list is expected is refused, not split or guessed
    assert lc.state()["graph"] == "discarded"
    lc.wake_up(["graph"])
    assert not lc.is_sleeping


def test_discard_kv_only_keeps_weights(lifecycle, spill_dir):
    lc = lifecycle
    tensors = make_tagged(lc)
    w, kv = tensors["weights"][1], tensors["kv_cache"][1]
    expect = as_bytes(w).clone()
    res_w = lc.resident_bytes("weights")
    k_before, n_before = kernel_memfds()
    rep = lc.discard(["kv_cache"])
    assert rep.tags == ["kv_cache"] and rep.bytes_released >= 8 * MiB and rep.bytes_copied == 0
    assert lc.state() == {"weights": "awake", "kv_cache": "discarded", "graph": "awake"}
    assert lc.resident_bytes("kv_cache") == 0
    assert lc.resident_bytes("weights") == res_w
    k_after, n_after = kernel_memfds()
    assert k_before - k_after >= 8 * MiB and n_before - n_after == 1
    assert torch.equal(as_bytes(w), expect)  # weights untouched and usable while kv sleeps
    w.add_(1)
    assert spill_files(spill_dir) == {}
    assert lc.discard(["kv_cache"]).tags == []  # discarding a discarded tag is a no-op
    lc.sleep(1)  # kv stays discarded under the level-1 policy
    lc.wake_up()
    assert torch.equal(as_bytes(w), expect + 1)
    assert kv.count_nonzero().item() == 0


def test_offload_tags_kept_at_level2(lifecycle):
    lc = lifecycle
    tensors = make_tagged(lc)
    g = tensors["graph"][1]
    expect = as_bytes(g).clone()
    lc.sleep(2, offload_tags=["graph"])
    assert lc.state()["graph"] == "offloaded"
    lc.wake_up()
    assert torch.equal(as_bytes(g), expect)
    assert tensors["weights"][1].count_nonzero().item() == 0


def test_sleep_of_some_tags_leaves_the_others_awake(lifecycle):
    lc = lifecycle
    tensors = make_tagged(lc)
    w, kv, g = (tensors[t][1] for t in ("weights", "kv_cache", "graph"))
    expect_g, expect_w = as_bytes(g).clone(), as_bytes(w).clone()
    lc.sleep(2, offload_tags=["graph"], tags=["graph", "kv_cache"])
    assert lc.state() == {"weights": "awake", "kv_cache": "discarded", "graph": "offloaded"}
    assert lc.resident_bytes("kv_cache") == 0 == lc.resident_bytes("graph")
    assert lc.resident_bytes("weights") >= 4 * MiB and torch.equal(as_bytes(w), expect_w)  # untouched
    lc.sleep(1, tags=["weights"])  # level 1 still backs up "weights"; the sleeping tags stay as they are
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded", "graph": "offloaded"}
    lc.wake_up(["graph", "weights"])
    assert torch.equal(as_bytes(g), expect_g) and torch.equal(as_bytes(w), expect_w)
    assert lc.state()["kv_cache"] == "discarded"
    lc.wake_up()
    assert kv.count_nonzero().item() == 0


# ----------------------------------------------------------------------------- adopt
class TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, ids):
        h = self.norm(self.lin(self.embed(ids))) * self.scale[0]
        return self.head(h)


def test_adopt_module_tied_weights_and_buffers(lifecycle, spill_dir):
    lc = lifecycle
    torch.manual_seed(1)
    m = TiedModel().eval()
    ids = torch.arange(8)
    with torch.no_grad():
        m.norm.running_mean.uniform_(-1, 1)
        m.norm.running_var.uniform_(0.5, 2)
        ref = m(ids).clone()
    params = {n: p for n, p in m.named_parameters()}
    buffers = {n: b for n, b in m.named_buffers()}
    old_ptrs = {n: t.data_ptr() for n, t in {**params, **buffers}.items()}
    before_res = lc.resident_bytes()

    assert lc.adopt(m) is m
    assert lc.resident_bytes("weights") > before_res
    # same Python objects, tie kept, storage moved once
    assert {n: p for n, p in m.named_parameters()} == params
    assert m.head.weight is m.embed.weight
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()
    new_ptrs = {n: t.data_ptr() for n, t in {**params, **buffers}.items()}
    assert all(new_ptrs[n] != old_ptrs[n] for n in new_ptrs)
    assert isinstance(m.embed.weight, torch.nn.Parameter) and m.embed.weight.requires_grad
    assert m.norm.num_batches_tracked.dtype == torch.int64
    assert set(lc.names("weights")) >= {"embed.weight", "lin.weight", "lin.bias", "norm.running_mean", "scale"}
    with torch.no_grad():
        assert torch.equal(m(ids), ref)

    for level in (1, 1):
        lc.sleep(level)
        lc.wake_up()
        assert {n: t.data_ptr() for n, t in {**params, **buffers}.items()} == new_ptrs
        with torch.no_grad():
            assert torch.equal(m(ids), ref)

    # training keeps working in place, and the tie holds through sleep/wake
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.train()
    m(ids).sum().backward()
    opt.step()
    with torch.no_grad():
        m.embed.weight[0, 0] = 42.0
    snap = {n: t.detach().clone() for n, t in m.state_dict().items()}
    lc.sleep(1)
    lc.wake_up()
    assert m.head.weight[0, 0].item() == 42.0
    for n, t in m.state_dict().items():
        assert torch.equal(t, snap[n]), n
    assert {n: t.data_ptr() for n, t in {**params, **buffers}.items()} == new_ptrs


def test_adopt_optimizer_state(lifecycle):
    lc = lifecycle
    torch.manual_seed(2)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    lc.adopt(model)
    lc.adopt(opt, tag="optim")
    state = [dict(s) for s in opt.state.values()]
    ptrs = [{k: v.data_ptr() for k, v in s.items()} for s in state]
    snap = [{k: v.clone() for k, v in s.items()} for s in state]
    assert lc.resident_bytes("optim") > 0
    assert any(n.startswith("state.") for n in lc.names("optim"))

    lc.sleep(1, offload_tags=["optim"])
    assert lc.state() == {"weights": "offloaded", "optim": "offloaded"}
    lc.wake_up()
    for s, p, ref in zip(opt.state.values(), ptrs, snap):
        for k, v in s.items():
            assert v.data_ptr() == p[k] and torch.equal(v, ref[k]), k

    # the optimizer keeps stepping in lifecycle memory
    opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    for s, p in zip(opt.state.values(), ptrs):
        assert {k: v.data_ptr() for k, v in s.items()} == p

    # without offload_tags the optimizer state is discarded at level 1 (zeros come back)
    lc.sleep(1)
    lc.wake_up()
    for s in opt.state.values():
        assert s["exp_avg"].count_nonzero().item() == 0


def test_adopt_dict_and_views(lifecycle):
    lc = lifecycle
    base = torch.arange(100, dtype=torch.float32)
    d = {"a": base, "a_view": base[10:20], "nested": {"b": torch.ones(3, 5, dtype=torch.float16)},
         "list": [torch.full((7,), 3, dtype=torch.int32)]}
    view = d["a_view"]
    lc.adopt(d, tag="weights")
    assert d["a"] is base and d["a_view"] is view
    assert set(lc.names()) == {"a", "a_view", "nested.b", "list.0"}
    assert view.data_ptr() == base.data_ptr() + 10 * 4  # still a view into the same storage
    base[12] = -1
    assert view[2].item() == -1
    ptrs = [t.data_ptr() for t in (base, view, d["nested"]["b"], d["list"][0])]
    lc.sleep(1)
    lc.wake_up()
    assert [t.data_ptr() for t in (base, view, d["nested"]["b"], d["list"][0])] == ptrs
    expect = torch.arange(100, dtype=torch.float32)
    expect[12] = -1
    assert torch.equal(base, expect)
    assert torch.equal(d["nested"]["b"], torch.ones(3, 5, dtype=torch.float16))
    assert torch.equal(d["list"][0], torch.full((7,), 3, dtype=torch.int32))


# ----------------------------------------------------------------------------- threads
@pytest.mark.parametrize("with_level2", [False, True])
def test_concurrent_sleep_wake_is_consistent(lifecycle, spill_dir, with_level2):
    lc = lifecycle
    tensors = make_tagged(lc, (("weights", 2 * MiB), ("kv_cache", 4 * MiB), ("graph", 256 * 1024)))
    w = tensors["weights"][1]
    expect = as_bytes(w).clone()
    ops = [
        lambda: lc.sleep(1),
        lambda: lc.wake_up(),
        lambda: lc.wake_up(["weights"]),
        lambda: lc.wake_up(["kv_cache"]),
        lambda: lc.discard(["kv_cache"]),
        lambda: lc.sleep(1, offload_tags=["graph"]),
        lambda: lc.state(),
        lambda: lc.resident_bytes(),
        lambda: lc.is_sleeping,
    ]
    if with_level2:
        ops.append(lambda: lc.sleep(2))
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed):
        rng = random.Random(seed)
        start.wait()
        for _ in range(40):
            try:
                rng.choice(ops)()
            except InvalidTransitionError:
                pass  # an illegal move given what another thread did: expected, and changes nothing
            except BaseException as e:  # anything else is a bug
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    # consistent: bookkeeping agrees with the kernel, tag by tag
    st = lc.state()
    for tag, s in st.items():
        res = lc.resident_bytes(tag)
        assert (res == 0) if s != "awake" else (res >= lc.allocated_bytes(tag)), (tag, s, res)
    backups = sum(v[0] for v in spill_files(spill_dir).values())
    assert backups == lc.backup_bytes()
    lc.wake_up()
    assert not lc.is_sleeping
    assert spill_files(spill_dir) == {}
    assert kernel_memfds()[0] >= lc.allocated_bytes()
    got = as_bytes(w)
    if with_level2:
        assert torch.equal(got, expect) or got.count_nonzero().item() == 0
    else:
        assert torch.equal(got, expect)  # weights are only ever offloaded, never discarded


# ----------------------------------------------------------------------------- close
def test_close_is_idempotent_and_frees(spill_dir):
    k0, n0 = kernel_memfds()
    lc = MemoryLifecycle("host", spill_dir=spill_dir)
    make_tagged(lc)
    lc.sleep(1)
    assert spill_files(spill_dir)
    lc.close()
    lc.close()
    assert kernel_memfds() == (k0, n0)
    assert spill_files(spill_dir) == {} and os.listdir(spill_dir) == []
    with pytest.raises(InvalidTransitionError):
        lc.sleep(1)
    with pytest.raises(InvalidTransitionError):
        lc.wake_up()
    with pytest.raises(InvalidTransitionError):
        lc.empty((4,), tag="weights")


@pytest.mark.slow
def test_context_manager_and_garbage_collection(spill_dir):
    import gc

    k0, n0 = kernel_memfds()
    with MemoryLifecycle("host", spill_dir=spill_dir) as lc:
        make_tagged(lc)
    assert kernel_memfds() == (k0, n0)
    lc = MemoryLifecycle("host", spill_dir=spill_dir)
    make_tagged(lc)
    lc.sleep(1)
    del lc
    gc.collect()
    assert kernel_memfds() == (k0, n0)
    assert os.listdir(spill_dir) == []


def test_level2_preserve_strided_view_and_offsets(lifecycle):
    """Preserved spans must be region offsets of each adopted tensor (not counted twice) and
    cover a strided view's whole extent."""
    lc = lifecycle
    first = torch.full((1000,), 7.0)
    grid = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    # grid is adopted with its view: left out, it would stay on the old memory (refused)
    d = {"first": first, "grid": grid, "cols": grid[:, ::2], "last": torch.full((300,), 3.0)}
    lc.adopt(d)
    assert lc.preserve(["cols", "last"]) == ["cols", "last"]
    expect_cols = d["cols"].clone()
    lc.sleep(2)
    lc.wake_up()
    assert torch.equal(d["cols"], expect_cols)
    assert torch.equal(d["last"], torch.full((300,), 3.0))
    assert d["first"].count_nonzero().item() == 0


def test_preserve_finds_a_tied_weight_by_its_second_name(lifecycle):
    """adopt() records every name of a tied tensor, so preserve() can use either of them."""
    lc = lifecycle
    torch.manual_seed(3)
    m = TiedModel().eval()
    lc.adopt(m)
    assert {"embed.weight", "head.weight"} <= set(lc.names("weights"))
    ref = m.embed.weight.detach().clone()
    assert lc.preserve(["head.*"]) == ["head.weight"]
    lc.sleep(2)
    lc.wake_up(["weights"])
    assert torch.equal(m.head.weight, ref) and m.head.weight is m.embed.weight
    assert m.lin.weight.count_nonzero().item() == 0  # not preserved: zeroed


def test_region_map_with_a_per_chunk_step_and_its_rollback():
    """``Region.map(driver, each=...)`` (what a backend's ``map_region`` uses to zero chunk by
    chunk): each chunk is mapped and accessible when ``each`` sees it; a failure part-way
    unmaps and releases exactly what that call mapped, after waiting for the device."""
    from unisleep.region import Region

    drv = HostDriver(chunk_bytes=1 << 20)
    r = Region.allocate(drv, 4 << 20, 1 << 20)
    try:
        r.release(drv)
        seen = []

        def fill(c):
            drv.view(r.va + c.offset, c.size).fill_(7)  # accessible now
            seen.append(c.offset)

        r.map(drv, each=fill)
        assert seen == [c.offset for c in r.chunks] and r.mapped
        assert int(drv.view(r.va, r.size).min()) == 7
        r.release(drv)
        synced = []
        drv.synchronize = lambda: synced.append(True)

        def fail_third(c):
            if c.offset == 2 << 20:
                raise OSError("injected")

        with pytest.raises(OSError, match="injected"):
            r.map(drv, each=fail_third)
        assert synced and r.unmapped  # waited, then gave back the three chunks it had mapped
    finally:
        r.free(drv)
