"""unisleep.compat.torch_memory_saver on the host backend: every method of torch_memory_saver
0.0.10's surface, each checked against tms's documented behaviour (its README and
test/examples), plus the install() shim in child processes.

On the host backend torch's own CPU allocations cannot be routed into a tag (no pool), so the
tensors here are made with the region's helpers (``r.empty`` / ``r.adopt`` / ``tms.empty``);
tests/cuda/test_compat_tms_cuda.py runs the same behaviour with plain ``torch.empty`` on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from unisleep.compat import shim_dir
from unisleep.compat.torch_memory_saver import TorchMemorySaver
from unisleep.driver import Capabilities
from unisleep.errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidTransitionError,
    UnsupportedError,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


@pytest.fixture
def tms(monkeypatch, tmp_path):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    for v in ("TMS_RETAIN_CPU_BACKUP", "TMS_DISK_BACKUP_DIR", "TMS_INIT_ENABLE", "UNISLEEP_TMS_PREPARE_BACKUP"):
        monkeypatch.delenv(v, raising=False)
    saver = TorchMemorySaver()
    yield saver
    saver.close()


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ---------------------------------------------------------------------------- regions
def test_region_without_backup_releases_and_comes_back_zeroed(tms):
    with tms.region() as r:  # tag "default", no backup: "the content is thrown away"
        t = r.empty((4 * MiB,), torch.uint8)
    t.fill_(100)
    ptr = t.data_ptr()
    assert tms.resident_bytes("default") >= 4 * MiB
    tms.pause()
    assert tms.resident_bytes("default") == 0 and tms.state() == {"default": "paused"}
    tms.resume()
    assert t.data_ptr() == ptr  # virtual address kept
    assert tms.resident_bytes("default") >= 4 * MiB
    assert int(t.max()) == 0  # unisleep zeroes what tms throws away


def test_region_with_cpu_backup_keeps_bytes(tms):
    ref = _pattern(3 * MiB + 123, seed=1)
    with tms.region(enable_cpu_backup=True) as r:
        t = r.empty((ref.numel(),), torch.uint8)
        f = r.empty((10, 20, 30), torch.float32)
    t.copy_(ref)
    f.copy_(torch.randn(10, 20, 30, generator=torch.Generator().manual_seed(2)))
    f_ref = f.clone()
    tms.pause()
    assert tms.resident_bytes() == 0
    tms.resume()
    assert torch.equal(t, ref) and torch.equal(f, f_ref)


def test_tms_empty_and_adopt_inside_region(tms):
    model = torch.nn.Linear(64, 32)
    x = torch.randn(4, 64)
    want = model(x).detach()
    with tms.region(tag="weights", enable_cpu_backup=True):
        tms.adopt(model)  # the facade's helper for the innermost region
        extra = tms.empty((1000,), torch.int64)
    extra.copy_(torch.arange(1000))
    tms.pause("weights")
    assert tms.resident_bytes("weights") == 0
    tms.resume("weights")
    assert torch.equal(model(x).detach(), want) and torch.equal(extra, torch.arange(1000))


def test_helpers_outside_a_region_raise(tms):
    with pytest.raises(InvalidTransitionError, match="inside"):
        tms.empty((4,), torch.uint8)


def test_nested_regions_use_the_innermost_tag(tms):
    with tms.region(tag="outer"):
        a = tms.empty((MiB,), torch.uint8)
        with tms.region(tag="inner", enable_cpu_backup=True):
            b = tms.empty((MiB,), torch.uint8)
        c = tms.empty((MiB,), torch.uint8)
    a.fill_(1), b.fill_(2), c.fill_(3)
    tms.pause("inner")
    assert tms.state() == {"outer": "active", "inner": "paused"}
    assert int(a.min()) == 1 and int(c.min()) == 3
    tms.resume("inner")
    assert int(b.min()) == 2 and int(b.max()) == 2


def test_region_argument_checks(tms):
    with pytest.raises(ValueError, match="mutually exclusive"):
        with tms.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.region(cpu_backup_backend="pinned"):
            pass
    with pytest.raises(InvalidArgumentError, match="'pinned' or 'mmap'"):
        with tms.region(enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(InvalidArgumentError, match="tag"):
        with tms.region(tag=""):
            pass


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_cpu_backup_backends_both_keep_bytes(tms, backend):
    ref = _pattern(MiB, seed=3)
    with tms.region(tag="w", enable_cpu_backup=True, cpu_backup_backend=backend) as r:
        t = r.empty((MiB,), torch.uint8)
    t.copy_(ref)
    tms.pause("w")
    tms.resume("w")
    assert torch.equal(t, ref)


# ---------------------------------------------------------------------------- tags, pause/resume
def test_tags_pause_and_resume_independently(tms):
    with tms.region(tag="type1") as r:
        t1 = r.empty((2 * MiB,), torch.uint8)
    with tms.region(tag="type2", enable_cpu_backup=True) as r:
        t2 = r.empty((2 * MiB,), torch.uint8)
    t1.fill_(100), t2.fill_(42)
    tms.pause("type1")
    assert tms.resident_bytes("type1") == 0 and tms.resident_bytes("type2") >= 2 * MiB
    assert int(t2.min()) == 42  # the other tag is untouched and usable
    tms.pause("type2")
    tms.resume("type2")
    assert tms.state() == {"type1": "paused", "type2": "active"} and int(t2.max()) == 42
    tms.resume("type1")
    tms.pause("type1")
    tms.resume("type1")
    assert tms.state() == {"type1": "active", "type2": "active"}


def test_pause_and_resume_all(tms):
    with tms.region(tag="weights", enable_cpu_backup=True) as r:
        w = r.empty((3 * MiB,), torch.uint8)
    with tms.region(tag="kv_cache") as r:
        kv = r.empty((5 * MiB,), torch.uint8)
    ref = _pattern(3 * MiB, seed=4)
    w.copy_(ref), kv.fill_(9)
    ptrs = (w.data_ptr(), kv.data_ptr())
    for _ in range(3):
        tms.pause()
        assert tms.resident_bytes() == 0
        tms.resume()
        assert (w.data_ptr(), kv.data_ptr()) == ptrs
        assert torch.equal(w, ref) and int(kv.max()) == 0
        kv.fill_(9)


def test_pause_of_all_tags_is_one_sleep_of_one_lifecycle(tms):
    # tags with and without backup share a lifecycle per device, so pausing them together is
    # one pipelined sleep (on a GPU the KV cache is released while the weights' copies run)
    with tms.region(tag="weights", enable_cpu_backup=True) as r:
        w = r.empty((2 * MiB,), torch.uint8)
    with tms.region(tag="kv_cache") as r:
        kv = r.empty((3 * MiB,), torch.uint8)
    w.fill_(7), kv.fill_(9)
    (lc,) = tms.lifecycles()
    tms.pause()
    assert lc.last_report.operation == "sleep(level=2)" and lc.last_report.tags == ["kv_cache", "weights"]
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}
    tms.resume()
    assert lc.last_report.operation == "wake_up" and sorted(lc.last_report.tags) == ["kv_cache", "weights"]
    assert int(w.min()) == 7 == int(w.max()) and int(kv.max()) == 0


def test_a_region_named_weights_without_backup_is_thrown_away(tms):
    # the name "weights" means nothing to tms: without enable_cpu_backup its bytes are not kept
    with tms.region(tag="weights") as r:
        w = r.empty((MiB,), torch.uint8)
    w.fill_(5)
    tms.pause("weights")
    tms.resume("weights")
    assert int(w.max()) == 0


def test_one_tag_mixes_regions_with_and_without_backup(tms):
    with tms.region(tag="mixed", enable_cpu_backup=True) as r:
        kept = r.empty((MiB,), torch.uint8)
    with tms.region(tag="mixed") as r:
        dropped = r.empty((MiB,), torch.uint8)
    ref = _pattern(MiB, seed=8)
    kept.copy_(ref), dropped.fill_(3)
    tms.pause("mixed")
    assert tms.state() == {"mixed": "paused"} and tms.resident_bytes("mixed") == 0
    tms.resume("mixed")
    assert tms.state() == {"mixed": "active"}
    assert torch.equal(kept, ref) and int(dropped.max()) == 0


def test_host_backup_is_prepared_at_region_exit_only_when_asked(tms, monkeypatch):
    monkeypatch.delenv("UNISLEEP_TMS_PREPARE_BACKUP", raising=False)
    calls = []
    with tms.region(tag="w", enable_cpu_backup=True) as r:
        r.empty((MiB,), torch.uint8)
        (lc,) = tms.lifecycles()
        real = lc.prepare_backup
        monkeypatch.setattr(lc, "prepare_backup",
                            lambda n, background=True: calls.append((n, background)) or real(n, background=background))
    assert calls == []  # by default, as in tms, nothing is taken before the first pause
    monkeypatch.setenv("UNISLEEP_TMS_PREPARE_BACKUP", "1")
    with tms.region(tag="w2", enable_cpu_backup=True) as r:
        r.empty((2 * MiB,), torch.uint8)
    # every backed-up tag of the lifecycle, at once and in this thread
    assert calls == [(lc.allocated_bytes("w") + lc.allocated_bytes("w2"), False)]
    with tms.region(tag="kv") as r:  # no backup: nothing to prepare
        r.empty((MiB,), torch.uint8)
    assert len(calls) == 1
    tms.pause()
    tms.resume()


def test_a_failed_pause_leaves_every_tag_running(tms, monkeypatch, tmp_path):
    # a pause that spans two lifecycles (disk-backed tags have their own): when the second one's
    # sleep fails (here: a 1 MiB host budget for a 4 MiB backup), the first one's tags are woken
    from unisleep.errors import HostBudgetError
    from unisleep.lifecycle import MemoryLifecycle

    real = tms._new_lifecycle
    monkeypatch.setattr(tms, "_new_lifecycle", lambda device, disk_dir: real(device, disk_dir) if disk_dir is not None
                        else MemoryLifecycle(tms._platform, device=device, host_budget_bytes=MiB))
    tms.set_disk_backup_dir(str(tmp_path / "disk"))
    with tms.region(tag="d", enable_disk_backup=True) as r:
        d = r.empty((MiB,), torch.uint8)
    with tms.region(tag="w", enable_cpu_backup=True) as r:
        w = r.empty((4 * MiB,), torch.uint8)
    d.fill_(1), w.fill_(2)
    with pytest.raises(HostBudgetError):
        tms.pause()
    assert tms.state() == {"d": "active", "w": "active"}
    assert int(d.min()) == 1 == int(d.max()) and int(w.min()) == 2 == int(w.max())
    tms.pause("d")  # the disk-backed tag alone still pauses and resumes
    tms.resume("d")
    assert int(d.min()) == 1


def test_pause_of_paused_and_resume_of_active_raise_and_change_nothing(tms):
    with tms.region(tag="a") as r:
        a = r.empty((MiB,), torch.uint8)
    with tms.region(tag="b", enable_cpu_backup=True) as r:
        b = r.empty((MiB,), torch.uint8)
    a.fill_(5), b.fill_(6)
    tms.pause("a")
    with pytest.raises(InvalidTransitionError, match="already paused"):
        tms.pause("a")
    with pytest.raises(InvalidTransitionError, match="already paused"):
        tms.pause()  # "a" is paused: tms would exit(1) here too
    assert tms.state() == {"a": "paused", "b": "active"} and int(b.min()) == 6
    with pytest.raises(InvalidTransitionError, match="not paused"):
        tms.resume("b")
    with pytest.raises(InvalidTransitionError, match="not paused"):
        tms.resume()  # "b" is active
    assert tms.state() == {"a": "paused", "b": "active"}
    tms.resume("a")
    assert tms.state() == {"a": "active", "b": "active"}


def test_tags_without_allocations_are_a_noop(tms):
    tms.pause("never-used")  # tms: nothing matches, nothing happens
    tms.resume("never-used")
    tms.pause()
    tms.resume()
    with tms.region(tag="empty-region"):
        pass
    tms.pause("empty-region")
    assert tms.state() == {}
    with pytest.raises(InvalidArgumentError):
        tms.pause(3)


# ---------------------------------------------------------------------------- disable
def test_disable_allocates_outside_any_tag(tms):
    with tms.region(tag="kv") as r:
        kept = r.empty((MiB,), torch.uint8)
        before = tms.resident_bytes()
        with tms.disable():
            plain = tms.empty((MiB,), torch.uint8)  # ordinary memory, as tms's disable() gives
            moved = tms.adopt(torch.nn.Linear(4, 4))
        assert tms.resident_bytes() == before
    plain.fill_(7), kept.fill_(1)
    w_before = moved.weight.detach().clone()
    tms.pause()
    assert int(plain.min()) == 7 and torch.equal(moved.weight.detach(), w_before)  # untouched by pause
    tms.resume()
    assert int(kept.max()) == 0
    with tms.disable():  # outside a region: nothing is routed anyway
        with tms.region(tag="inside-disable"):  # a region inside disable() is a region again (tms)
            tms.empty((MiB,), torch.uint8)
    assert tms.resident_bytes("inside-disable") >= MiB


# ---------------------------------------------------------------------------- disk backup
def test_disk_backup_writes_files_and_restores(tms, tmp_path):
    d = tmp_path / "tms-disk"
    tms.set_disk_backup_dir(str(d))
    assert d.is_dir()  # created if needed
    ref = _pattern(3 * MiB + 7, seed=5)
    with tms.region(enable_disk_backup=True) as r:
        big = r.empty((ref.numel(),), torch.uint8)
    with tms.region(enable_disk_backup=False) as r:
        no_backup = r.empty((MiB,), torch.uint8)
    big.copy_(ref), no_backup.fill_(20)
    sizes = set()
    for _ in range(3):
        tms.pause()
        files = [p for p in d.rglob("*") if p.is_file()]
        total = sum(p.stat().st_size for p in files)
        assert total >= ref.numel(), f"backup smaller than the paused tensor: {total}"
        sizes.add(total)
        assert tms.get_cpu_backup(big) is None  # disk-backed: no CPU copy, as in tms
        tms.resume()
        assert torch.equal(big, ref)
        assert int(no_backup.max()) == 0
    assert len(sizes) == 1, f"disk usage grew across cycles: {sorted(sizes)}"


def test_disk_backup_files_lie_directly_in_the_directory_as_in_tms(tms, tmp_path):
    """tms's disk_backup example lists the directory itself while paused: one file per
    disk-backed allocation, directly in it; the facade's files are removed at resume (tms keeps
    them until the allocation is freed), so the listing is empty while running.  Before: the
    files lay in a private subfolder, and a listing of the directory showed only that folder."""
    d = tmp_path / "tms-disk"
    tms.set_disk_backup_dir(str(d))
    with tms.region(enable_disk_backup=True) as r:
        big = r.empty((3 * MiB + 7,), torch.uint8)
        small = r.empty((7,), torch.uint8)
    big.copy_(_pattern(big.numel(), 8)), small.fill_(10)
    ref = big.clone()
    sizes = set()
    for _ in range(3):
        tms.pause()
        files = os.listdir(d)
        assert len(files) >= 2, f"expected a backup file per disk-backed alloc, got {files}"
        assert all(os.path.isfile(d / f) for f in files)
        total = sum(os.path.getsize(d / f) for f in files)
        assert total >= big.numel()
        sizes.add(total)
        tms.resume()
        assert torch.equal(big, ref) and int(small.min()) == 10
        assert os.listdir(d) == []
    assert len(sizes) == 1


def test_cpu_backups_are_released_at_resume_unless_retained(tms, monkeypatch):
    """tms frees a CPU backup at resume unless retain_cpu_backup (TMS_RETAIN_CPU_BACKUP) is on:
    the lifecycle of CPU-backed tags gives its host backups back at every resume made while it
    is off (host_backups="release") and keeps them while it is on; disk-backed tags always
    release (their files go at resume)."""
    with tms.region(tag="w", enable_cpu_backup=True) as r:
        t = r.empty((MiB,), torch.uint8)
    t.fill_(4)
    (lc,) = tms.lifecycles()
    assert lc.host_backups == "release"
    tms.pause("w")
    tms.resume("w")
    assert lc.host_backups == "release" and lc.backup_resident_bytes()["held"] == 0
    tms.retain_cpu_backup = True
    tms.pause("w")
    tms.resume("w")
    assert lc.host_backups == "keep" and int(t.min()) == 4
    tms.retain_cpu_backup = False
    tms.pause("w")
    tms.resume("w")
    assert lc.host_backups == "release"
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    s = TorchMemorySaver()
    try:
        with s.region(tag="x", enable_cpu_backup=True) as r:
            r.empty((MiB,), torch.uint8)
        assert [l.host_backups for l in s.lifecycles()] == ["keep"]
    finally:
        s.close()


def test_disk_backup_dir_set_later_applies_to_tags_used_after(tms, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tms.set_disk_backup_dir(str(a))
    with tms.region(tag="first", enable_disk_backup=True) as r:
        t1 = r.empty((MiB,), torch.uint8)
    tms.set_disk_backup_dir(str(b))
    with tms.region(tag="second", enable_disk_backup=True) as r:
        t2 = r.empty((2 * MiB,), torch.uint8)
    t1.fill_(1), t2.fill_(2)
    tms.pause()
    in_a = sum(p.stat().st_size for p in a.rglob("*") if p.is_file())
    in_b = sum(p.stat().st_size for p in b.rglob("*") if p.is_file())
    assert MiB <= in_a < 2 * MiB and in_b >= 2 * MiB
    tms.resume()
    assert int(t1.min()) == 1 == int(t1.max()) and int(t2.min()) == 2 == int(t2.max())


def test_disk_backup_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    d = tmp_path / "from-env"
    d.mkdir()
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(d))
    s = TorchMemorySaver()
    try:
        with s.region(tag="x", enable_disk_backup=True) as r:
            t = r.empty((MiB,), torch.uint8)
        t.fill_(3)
        s.pause("x")
        assert any(p.is_file() and p.stat().st_size >= MiB for p in d.rglob("*"))
        s.resume("x")
        assert int(t.min()) == 3
    finally:
        s.close()


# ---------------------------------------------------------------------------- get_cpu_backup
def test_get_cpu_backup_while_paused(tms):
    with tms.region(enable_cpu_backup=True) as r:
        typed = r.empty((10, 20, 30), torch.float32)
        raw = r.empty((MiB,), torch.uint8)
    typed.copy_(torch.randn(10, 20, 30, generator=torch.Generator().manual_seed(6)))
    raw.copy_(_pattern(MiB, seed=7))
    typed_ref, raw_ref = typed.clone(), raw.clone()
    tms.pause()
    got = tms.get_cpu_backup(typed)
    assert got.device.type == "cpu" and got.dtype == typed.dtype and got.shape == typed.shape
    assert torch.equal(got, typed_ref)
    zc = tms.get_cpu_backup(raw, zero_copy=True)
    assert torch.equal(zc, raw_ref)
    part = raw[1000:5000]  # a contiguous slice inside the allocation
    assert torch.equal(tms.get_cpu_backup(part), raw_ref[1000:5000])
    tms.resume()
    # without retain_cpu_backup the backup is only exposed while paused (tms README)
    assert tms.retain_cpu_backup is False
    assert tms.get_cpu_backup(typed) is None


def test_get_cpu_backup_after_resume_with_retain(tms):
    tms.retain_cpu_backup = True
    assert tms.retain_cpu_backup is True
    with tms.region(tag="w", enable_cpu_backup=True) as r:
        t = r.empty((MiB,), torch.uint8)
    t.fill_(11)
    tms.pause("w")
    tms.resume("w")
    got = tms.get_cpu_backup(t)
    # the host backend does not keep a backup once its bytes are back (its driver's
    # retain_backups is False), so None is the honest answer here; accelerators that retain
    # return the bytes (tests/cuda/test_compat_tms_cuda.py)
    assert got is None


def test_get_cpu_backup_refusals(tms):
    with tms.region(tag="nb") as r:
        nb = r.empty((MiB,), torch.uint8)
    with tms.region(tag="cb", enable_cpu_backup=True) as r:
        m = r.empty((64, 64), torch.float32)
    assert tms.get_cpu_backup(nb) is None  # active, no backup
    tms.pause("nb")
    with pytest.raises(InvalidTransitionError, match="enable_cpu_backup"):
        tms.get_cpu_backup(nb)
    with pytest.raises(InvalidArgumentError, match="not allocated in a torch_memory_saver region"):
        tms.get_cpu_backup(torch.zeros(16))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        tms.get_cpu_backup(m.t())
    with pytest.raises(InvalidArgumentError):
        tms.get_cpu_backup("not a tensor")
    tms.resume("nb")


# ---------------------------------------------------------------------------- properties
def test_enabled_hook_mode_and_margin(tms):
    assert tms.enabled is True
    with pytest.raises(AttributeError):
        tms.hook_mode
    tms.hook_mode = "torch"  # accepted before first use; unisleep needs no hook either way
    tms.hook_mode = "preload"
    with pytest.raises(InvalidArgumentError, match="'preload' or 'torch'"):
        tms.hook_mode = "ld"
    with pytest.raises(NotImplementedError):
        tms.memory_margin_bytes
    tms.memory_margin_bytes = 1 << 60  # larger than any machine's free memory (this initializes)
    tms.hook_mode = "torch"  # tms would refuse after initialization; no hook here, so it is accepted
    with tms.region(tag="m") as r:
        with pytest.raises(InsufficientMemoryError, match="memory_margin_bytes"):
            r.empty((MiB,), torch.uint8)
    tms.memory_margin_bytes = 0
    with tms.region(tag="m") as r:
        assert r.empty((MiB,), torch.uint8).numel() == MiB
    with pytest.raises(InvalidArgumentError):
        tms.memory_margin_bytes = -1


def test_retain_cpu_backup_from_environment(monkeypatch):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    s = TorchMemorySaver()
    assert s.retain_cpu_backup is True
    s.retain_cpu_backup = False
    assert s.retain_cpu_backup is False
    s.close()


def test_cuda_graph_on_host_is_refused(tms):
    with pytest.raises(UnsupportedError, match="accelerator"):
        with tms.cuda_graph(object(), tag="graph"):
            pass
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.cuda_graph(object(), cpu_backup_backend="mmap"):
            pass


def test_resident_bytes_are_per_tag(tms):
    with tms.region(tag="small") as r:
        r.empty((MiB,), torch.uint8)
    with tms.region(tag="big", enable_cpu_backup=True) as r:
        r.empty((8 * MiB,), torch.uint8)
    small, big = tms.resident_bytes("small"), tms.resident_bytes("big")
    assert MiB <= small < 8 * MiB <= big and tms.resident_bytes() == small + big
    assert tms.resident_bytes("unknown") == 0


# ---------------------------------------------------------------------------- the import shim
def _run(code: str, env_extra=None, timeout=240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_TMS",)}
    env["UNISLEEP_PLATFORM"] = "host"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_install_makes_unmodified_code_and_its_children_use_the_facade():
    code = """
        import json, multiprocessing as mp, subprocess, sys
        import unisleep.compat
        unisleep.compat.install()
        # unmodified tms user code from here on
        import torch
        from torch_memory_saver import torch_memory_saver
        import torch_memory_saver as tms_mod

        def child(q):
            import torch_memory_saver as m
            q.put(m.__name__)

        if __name__ == "__main__":
            with torch_memory_saver.region(tag="weights", enable_cpu_backup=True) as r:
                w = r.empty((1 << 20,), torch.uint8)
            w.fill_(42)
            torch_memory_saver.pause("weights")
            freed = torch_memory_saver.resident_bytes("weights") == 0
            torch_memory_saver.resume("weights")
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start(); spawned = q.get(timeout=120); p.join(120)
            sub = subprocess.run([sys.executable, "-c", "import torch_memory_saver as m; print(m.__name__)"],
                                 capture_output=True, text=True).stdout.strip()
            print(json.dumps({"module": tms_mod.__name__, "kept": int(w.min()) == 42, "freed": freed,
                              "spawned": spawned, "subprocess": sub}))
    """
    path = os.path.join(ROOT, "build", "tms_shim_probe.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:  # spawn needs an importable __main__ file
        f.write(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "UNISLEEP_TMS"}
    env.update(UNISLEEP_PLATFORM="host", PYTHONPATH=ROOT)
    try:
        proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    finally:
        os.unlink(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    facade = "unisleep.compat.torch_memory_saver"
    assert out == {"module": facade, "kept": True, "freed": True, "spawned": facade, "subprocess": facade}


@pytest.mark.slow
def test_configure_subprocess_sets_and_restores_the_environment():
    code = """
        import os, subprocess, sys
        from unisleep.compat.torch_memory_saver import configure_subprocess
        before = (os.environ.get("UNISLEEP_TMS"), os.environ.get("PYTHONPATH"))
        with configure_subprocess():
            out = subprocess.run([sys.executable, "-c", "import torch_memory_saver as m; print(m.__name__)"],
                                 capture_output=True, text=True).stdout.strip()
        after = (os.environ.get("UNISLEEP_TMS"), os.environ.get("PYTHONPATH"))
        print(out, before == after)
    """
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["unisleep.compat.torch_memory_saver", "True"]


@pytest.mark.slow
def test_shim_folder_without_the_switch_steps_aside():
    env = {"PYTHONPATH": shim_dir() + os.pathsep + ROOT}
    proc = _run("import torch_memory_saver as m; print(m.__name__, m.__file__)", env_extra=env)
    import importlib.util

    if importlib.util.find_spec("torch_memory_saver") is None:  # the real one is not installed here
        assert proc.returncode != 0 and "UNISLEEP_TMS=1" in proc.stderr
    else:
        assert proc.returncode == 0 and "compat" not in proc.stdout, proc.stdout
    proc = _run("import torch_memory_saver as m; print(m.__name__)", env_extra={**env, "UNISLEEP_TMS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "unisleep.compat.torch_memory_saver", proc.stderr


@pytest.mark.slow
def test_install_after_the_real_module_was_imported_is_refused():
    code = """
        import sys, types
        sys.modules["torch_memory_saver"] = types.ModuleType("torch_memory_saver")  # stands for the real one
        import unisleep.compat
        from unisleep.errors import InvalidTransitionError
        try:
            unisleep.compat.install()
        except InvalidTransitionError as e:
            print("refused:", "before anything imports it" in str(e))
        unisleep.compat.uninstall()
    """
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "refused: True"


@pytest.mark.slow
def test_uninstall_restores_path_environment_and_modules():
    code = """
        import os, sys
        import unisleep.compat as c
        before = (list(sys.path), os.environ.get("UNISLEEP_TMS"), os.environ.get("PYTHONPATH"))
        c.install()
        assert c.installed() and sys.path[0] == c.shim_dir() and os.environ["UNISLEEP_TMS"] == "1"
        c.uninstall()
        after = (list(sys.path), os.environ.get("UNISLEEP_TMS"), os.environ.get("PYTHONPATH"))
        print(before == after, c.installed(), "torch_memory_saver" in sys.modules)
    """
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False"]


@pytest.mark.slow
def test_pythonpath_helper_prints_the_shim_folder():
    proc = _run("import runpy, sys; sys.argv = ['x', '--pythonpath']; runpy.run_module('unisleep.compat', run_name='__main__')")
    assert proc.returncode == 0 and proc.stdout.strip() == shim_dir()


# ---------------------------------------------------------------------------- pool routing order
class _RecordingLifecycle:
    """Stands in for an accelerator's lifecycle (the host one has no pool): records which tag's
    pool routing is entered and left, so the facade's order can be checked on CPU."""

    platform_name = "recording"

    def __init__(self, log):
        self.log, self.tags = log, []

        class _Driver:
            capabilities = Capabilities(supports_pool=True)

        self.driver = _Driver()

    def pool(self, tag):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.log.append(("on", tag))
            try:
                yield
            finally:
                self.log.append(("off", tag))

        return ctx()

    def state(self):
        return {}

    def close(self):
        pass


def test_at_most_one_pool_routing_is_active_per_thread(tms, monkeypatch):
    log = []
    monkeypatch.setattr(tms, "_new_lifecycle", lambda device, disk_dir: _RecordingLifecycle(log))
    with tms.region(tag="outer"):
        with tms.region(tag="inner", enable_cpu_backup=True):
            with tms.disable():
                pass
        with tms.disable():
            with tms.region(tag="nested-in-disable"):
                pass
    active, seen = set(), []
    for what, tag in log:
        if what == "on":
            assert not active, f"{tag} routed while {active} still routed: {log}"
            active.add(tag)
        else:
            active.remove(tag)
        seen.append((what, tag))
    assert not active
    assert seen == [
        ("on", "outer"), ("off", "outer"), ("on", "inner"),  # the inner region suspends the outer one
        ("off", "inner"), ("on", "inner"),  # disable() inside "inner" switches it off, then back on
        ("off", "inner"), ("on", "outer"),  # leaving "inner" gives the routing back to "outer"
        ("off", "outer"), ("on", "nested-in-disable"),  # a region inside disable() routes, as in tms
        ("off", "nested-in-disable"), ("on", "outer"), ("off", "outer"),
    ]


@pytest.mark.parametrize("backend", ["mmap", "pinned"])
def test_zero_copy_backup_is_one_host_tensor_until_a_resume_without_retain(tms, backend):
    """tms's cpu_backup example: with retain_cpu_backup, get_cpu_backup(x, zero_copy=True) after
    resume is the tensor read while paused (same data_ptr, same bytes); the next pause refreshes
    it in place; a resume without retain gives it up.  Before: None after every resume."""
    expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    with tms.region(tag="w", enable_cpu_backup=True, cpu_backup_backend=backend) as r:
        t = r.empty((4096,), torch.uint8)
    t.copy_(expected)
    tms.pause("w")
    first = tms.get_cpu_backup(t, zero_copy=True)
    ptr = first.data_ptr()
    assert torch.equal(first, expected)
    tms.retain_cpu_backup = True
    del first
    tms.resume("w")
    after = tms.get_cpu_backup(t, zero_copy=True)
    assert after is not None and after.data_ptr() == ptr and torch.equal(after, expected)
    assert torch.equal(tms.get_cpu_backup(t), expected)  # zero_copy=False: a copy
    tms.retain_cpu_backup = False  # retained until the next resume made without retain
    assert tms.get_cpu_backup(t, zero_copy=True).data_ptr() == ptr
    t.fill_(9)
    tms.pause("w")
    again = tms.get_cpu_backup(t, zero_copy=True)
    assert again.data_ptr() == ptr and int(again.min()) == 9 == int(after.max())  # refreshed in place
    tms.resume("w")
    assert tms.get_cpu_backup(t) is None and int(t.min()) == 9
