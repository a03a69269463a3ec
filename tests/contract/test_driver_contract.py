"""The driver contract, run over every backend (see conftest.py): what the core asks of a driver
and of its backup store — sleep/wake byte-exact at the same addresses with the memory really
returned, wake by tag, discard, reading a backup while asleep, a progressive wake, and the undo
of a sleep that failed half way (the backup is read back into the chunks already released)."""

from __future__ import annotations

import pytest
import torch

from unisleep.errors import BackupError

MiB = 1 << 20


def returned(b, before: int, after: int, nbytes: int) -> bool:
    """``nbytes`` went back to the device between two readings (exact where the reading is
    per lifecycle; within 10% on a GPU, whose reading is the whole device's)."""
    if b.name == "cuda":
        return before - after >= 0.9 * nbytes
    return before - after == nbytes


def test_level1_restores_bytes_at_the_same_addresses_and_returns_memory(backend):
    b = backend
    w, w0 = b.fill("weights", 3 * b.unit + 123, 1)
    kv, _ = b.fill("kv_cache", 2 * b.unit, 2)
    addrs = (w.data_ptr(), kv.data_ptr())
    held = b.lc.allocated_bytes()
    for _ in range(2):
        awake = b.device_bytes()
        b.lc.sleep(level=1)
        assert returned(b, awake, b.device_bytes(), held)
        assert b.lc.resident_bytes() == 0 and b.lc.backup_bytes() >= w0.numel()
        b.lc.wake_up()
        assert torch.equal(b.host(w), w0)
        assert int(kv.count_nonzero()) == 0  # discarded bytes come back zeroed, never stale
        assert (w.data_ptr(), kv.data_ptr()) == addrs
        assert b.lc.resident_bytes() == held


def test_level2_wakes_by_tag(backend):
    b = backend
    w, _ = b.fill("weights", 2 * b.unit, 3)
    kv, _ = b.fill("kv_cache", 4 * b.unit, 4)
    w_bytes = b.lc.allocated_bytes("weights")
    b.lc.sleep(level=2)
    assert b.lc.backup_bytes() == 0 and b.lc.resident_bytes() == 0
    b.lc.wake_up(["weights"])
    assert b.lc.resident_bytes() == w_bytes and b.lc.resident_bytes("kv_cache") == 0
    assert b.lc.state()["kv_cache"] != "awake"
    assert int(w.count_nonzero()) == 0
    new = b.random(w.numel(), 5)
    w.copy_(new.to(w.device))  # the weight update, into woken memory
    b.lc.wake_up(["kv_cache"])
    assert torch.equal(b.host(w), new) and int(kv.count_nonzero()) == 0


def test_discard_then_wake_gives_zeros(backend):
    b = backend
    kv, _ = b.fill("kv_cache", 2 * b.unit, 6)
    b.lc.discard(["kv_cache"])
    assert b.lc.resident_bytes("kv_cache") == 0
    b.lc.wake_up(["kv_cache"])
    assert int(kv.count_nonzero()) == 0


def test_read_backup_while_asleep(backend):
    """``read_backup`` reads a window of a sleeping tensor into host memory (the store's
    ``load_range`` with a host destination); discarded memory has no backup to read."""
    b = backend
    w, w0 = b.fill("weights", 3 * b.unit, 7)
    kv, _ = b.fill("kv_cache", b.unit, 8)
    b.lc.sleep(level=1)
    lo, n = b.unit - 1000, b.unit + 2000  # across a chunk boundary
    out = torch.empty(n, dtype=torch.uint8)
    assert b.lc.read_backup(w.data_ptr() + lo, out) is True
    assert torch.equal(out, w0[lo : lo + n])
    assert b.lc.read_backup(kv.data_ptr(), torch.empty(16, dtype=torch.uint8)) is False
    b.lc.wake_up()
    assert torch.equal(b.host(w), w0)


def test_progressive_wake_restores_every_byte(backend):
    b = backend
    w, w0 = b.fill("weights", 4 * b.unit + 4096, 9)
    kv, _ = b.fill("kv_cache", 2 * b.unit, 10)
    b.lc.sleep(level=1)
    b.lc.wake_up(progressive=True).wait()
    assert b.lc.state() == {"weights": "awake", "kv_cache": "awake"}
    assert torch.equal(b.host(w), w0) and int(kv.count_nonzero()) == 0


def test_a_sleep_that_fails_half_way_is_undone_from_its_backup(backend, monkeypatch):
    """The second unmap fails: the first region (or chunk) is already released by then.  The
    lifecycle maps it again and reads its bytes back from the backup it just took (the store's
    ``load_range`` into device memory): the tags stay awake, byte-exact, nothing is lost."""
    b = backend
    w1, w1_0 = b.fill("weights", 2 * b.unit, 11)
    w2, w2_0 = b.fill("weights", 2 * b.unit, 12)
    drv = b.driver
    real_unmap, calls = drv.unmap, []

    def unmap(va, size):
        calls.append(va)
        if len(calls) == 2:
            raise RuntimeError("injected: unmap failed")
        return real_unmap(va, size)

    monkeypatch.setattr(drv, "unmap", unmap)
    with pytest.raises(BackupError, match="injected: unmap failed") as e:
        b.lc.sleep(level=1)
    monkeypatch.setattr(drv, "unmap", real_unmap)
    msg = str(e.value)
    del e  # its traceback holds this frame, and so the tensors, alive past the test
    assert "every tag is as it was" in msg, msg
    assert b.lc.state() == {"weights": "awake"}
    assert torch.equal(b.host(w1), w1_0) and torch.equal(b.host(w2), w2_0)
    b.lc.sleep(level=1)  # and the lifecycle goes on as before
    b.lc.wake_up()
    assert torch.equal(b.host(w1), w1_0) and torch.equal(b.host(w2), w2_0)


def test_the_descriptor_describes_the_driver_in_use(backend):
    """What the backend's descriptor says holds for the lifecycle made from it: its driver class,
    its backup store, its torch device, and a collective whose backend torch knows."""
    from unisleep.registry import backend_of

    d = backend_of(backend.driver)
    assert d is not None and d.name == backend.driver.name
    assert isinstance(backend.driver, d.driver_class())
    assert isinstance(backend.lc.backup_store, d.load(d.store))
    assert d.is_accelerator == (backend.name != "host")
    assert d.collective_module().BACKEND in ("gloo", "nccl", "hccl")
    for ref in (d.collective, d.ipc, d.checksum, d.pool, d.vllm_worker, d.environment_warnings, d.detect):
        assert ref is None or d.has_module(ref), ref


@pytest.mark.parametrize("name", ["sim-hip", "sim-acl"])
def test_a_simulated_library_hands_out_stale_memory(name):
    """The control for the zeroed-discard checks above: the simulated HIP and ACL libraries
    hand out fresh memory full of stale bytes, so a driver that trusted it to be zero (here:
    told so) would show them — the checks could fail."""
    from dataclasses import replace

    from sim.fake_acl import FakeAcl
    from sim.fake_hip import FakeHip
    from sim.vmm import STALE_BYTE
    from unisleep import MemoryLifecycle
    from unisleep.backends.ascend import AscendDriver
    from unisleep.backends.rocm import RocmDriver

    if name == "sim-hip":
        lib = FakeHip(granularity=64 << 10, total_bytes=96 * MiB)
        drv = RocmDriver(lib=lib, tensor_device="cpu", chunk_bytes=1 * MiB, env={})
    else:
        lib = FakeAcl(granularity=2 * MiB, total_bytes=96 * MiB)
        drv = AscendDriver(lib=lib, tensor_device="cpu")
    drv.capabilities = replace(drv.capabilities, fresh_memory_is_zero=True)
    with MemoryLifecycle(drv) as lc:
        t = lc.empty(2 * MiB, torch.uint8, tag="kv_cache")
        assert int((t == STALE_BYTE).sum()) == t.numel()
    lib.close()
