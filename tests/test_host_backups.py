"""What happens to host backups after a wake (``MemoryLifecycle(host_backups=...)``), where they
lie (``backup_resident_bytes()``), and the spill files' flat layout and staged store, on the
host backend's real memory and files.

The host driver drops a backup once its bytes are back (it retains none), so "keep" and
"release" differ there only in what the store keeps; to check the policy where a driver retains
backups (the CUDA driver does, proven unchanged by the keyed digest), one test runs the host
driver with that capability turned on — real spill files, real digests, nothing simulated but
the flag."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.backends.host.driver import HostDriver
from unisleep.driver import Capabilities
from unisleep.errors import BackupCorruptError, InvalidArgumentError, LifecycleClosedError, SpillDirError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


class RetainingHost(HostDriver):
    """The host driver with CUDA's ``retain_backups`` capability on (a full backup stays after a
    wake, and an unchanged tag skips its copy, proven by the keyed digest)."""

    capabilities = Capabilities(fresh_memory_is_zero=True, views_hold_owner=True, supports_release_behind=True,
                                retain_backups=True)


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the option
def test_the_option_its_environment_variable_and_its_setter(monkeypatch, spill_dir):
    monkeypatch.delenv("UNISLEEP_HOST_BACKUPS", raising=False)
    lc = MemoryLifecycle("host", spill_dir=spill_dir)
    assert lc.host_backups == "keep"
    lc.host_backups = "release"
    assert lc.host_backups == "release"
    with pytest.raises(InvalidArgumentError, match="'keep' or 'release'"):
        lc.host_backups = "free"
    assert lc.host_backups == "release"
    lc.close()
    with pytest.raises(LifecycleClosedError):
        lc.host_backups = "keep"
    with pytest.raises(LifecycleClosedError):
        lc.backup_resident_bytes()
    monkeypatch.setenv("UNISLEEP_HOST_BACKUPS", "release")
    with MemoryLifecycle("host", spill_dir=spill_dir) as lc:
        assert lc.host_backups == "release"
    with MemoryLifecycle("host", spill_dir=spill_dir, host_backups="keep") as lc:
        assert lc.host_backups == "keep"  # the argument wins over the environment
    monkeypatch.setenv("UNISLEEP_HOST_BACKUPS", "drop")
    with pytest.raises(InvalidArgumentError, match="UNISLEEP_HOST_BACKUPS"):
        MemoryLifecycle("host", spill_dir=spill_dir)
    for bad in ({"backup_to": "tape"}, {"spill_layout": "nested"}):
        with pytest.raises(InvalidArgumentError):
            MemoryLifecycle("host", spill_dir=spill_dir, **bad)


def test_backup_resident_bytes_read_where_the_backups_lie(lifecycle):
    w = lifecycle.empty((4 * MiB + 123,), torch.uint8, tag="weights")
    w.copy_(_pattern(w.numel()))
    assert lifecycle.backup_resident_bytes() == {"pinned": 0, "pageable": 0, "disk": 0, "held": 0}
    lifecycle.sleep(1)
    r = lifecycle.backup_resident_bytes()
    store = lifecycle.backup_store
    blocks = sum(os.stat(os.path.join(store.dir, n)).st_blocks * 512 for n in os.listdir(store.dir)
                 if n.endswith(".bin"))
    held = lifecycle.allocated_bytes("weights")  # the region, rounded up to the page
    assert r == {"pinned": 0, "pageable": 0, "disk": blocks, "held": held} and blocks >= held >= w.numel()
    lifecycle.wake_up()
    assert lifecycle.backup_resident_bytes() == {"pinned": 0, "pageable": 0, "disk": 0, "held": 0}


def test_spill_files_on_a_ram_file_system_count_as_host_memory(tmp_path):
    from unisleep.backends.host.spill_dir import filesystem_type

    shm = "/dev/shm"
    if not os.path.isdir(shm) or filesystem_type(shm) not in ("tmpfs", "shm"):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with pytest.warns(RuntimeWarning, match="lives in RAM"):
        lc = MemoryLifecycle("host", spill_dir=shm)
    try:
        w = lc.empty((2 * MiB,), torch.uint8, tag="weights")
        w.fill_(5)
        lc.sleep(1)
        r = lc.backup_resident_bytes()
        assert r["pageable"] >= 2 * MiB and r["disk"] == 0
        lc.wake_up()
        assert int(w.min()) == 5
    finally:
        lc.close()


@pytest.mark.parametrize("policy", ["keep", "release"])
def test_keep_retains_a_backup_and_release_drops_it_at_the_wake(spill_dir, policy):
    lc = MemoryLifecycle(RetainingHost(), spill_dir=spill_dir, host_backups=policy)
    try:
        w = lc.empty((4 * MiB,), torch.uint8, tag="weights")
        ref = _pattern(w.numel(), 1)
        w.copy_(ref)
        lc.sleep(1)
        assert lc.last_report.bytes_copied == w.numel()
        lc.wake_up()
        assert torch.equal(w, ref)
        after = lc.backup_resident_bytes()
        lc.sleep(1)  # unchanged weights
        unchanged_copied = lc.last_report.bytes_copied
        lc.wake_up()
        assert torch.equal(w, ref)
        if policy == "keep":  # the full backup stays (on disk here), and the unchanged sleep copies nothing
            assert after["held"] == w.numel() and after["disk"] >= w.numel()
            assert unchanged_copied == 0
            assert lc.release_host_backups() == 0  # spill files keep nothing beyond their backups ...
            assert lc.backup_resident_bytes()["disk"] == 0  # ... and the retained one is dropped
            lc.sleep(1)
            assert lc.last_report.bytes_copied == w.numel()  # so the next sleep copies again
            lc.wake_up()
        else:
            assert after == {"pinned": 0, "pageable": 0, "disk": 0, "held": 0}
            assert unchanged_copied == w.numel()
    finally:
        lc.close()


def test_a_policy_changed_between_wakes_applies_from_the_next_one(spill_dir):
    lc = MemoryLifecycle(RetainingHost(), spill_dir=spill_dir)
    try:
        w = lc.empty((MiB,), torch.uint8, tag="weights")
        w.fill_(9)
        lc.sleep(1)
        lc.wake_up()
        assert lc.backup_resident_bytes()["held"] == MiB
        lc.host_backups = "release"
        assert lc.backup_resident_bytes()["held"] == MiB  # setting it gives nothing back by itself
        lc.sleep(1)
        lc.wake_up()
        assert lc.backup_resident_bytes()["held"] == 0 and int(w.min()) == 9
    finally:
        lc.close()


def test_the_process_sums_the_backups_of_its_open_lifecycles(spill_dir):
    from unisleep import hostmem

    before = hostmem.backups_of_process()
    lc = MemoryLifecycle("host", spill_dir=spill_dir)
    try:
        w = lc.empty((2 * MiB,), torch.uint8, tag="weights")
        w.fill_(1)
        lc.sleep(1)
        now = hostmem.backups_of_process()
        assert now["lifecycles"] == before["lifecycles"] + 1
        assert now["held"] - before["held"] == 2 * MiB and now["disk"] - before["disk"] >= 2 * MiB
    finally:
        lc.close()
    assert hostmem.backups_of_process()["lifecycles"] == before["lifecycles"]


# ---------------------------------------------------------------------------- the flat layout
def test_flat_layout_files_lie_directly_in_the_directory(tmp_path):
    d = tmp_path / "flat"
    d.mkdir(mode=0o700)
    lc = MemoryLifecycle("host", spill_dir=str(d), spill_layout="flat")
    try:
        a = lc.empty((3 * MiB,), torch.uint8, tag="weights")
        b = lc.empty((MiB + 5,), torch.uint8, tag="weights")
        ra, rb = _pattern(a.numel(), 2), _pattern(b.numel(), 3)
        a.copy_(ra), b.copy_(rb)
        assert os.listdir(d) == []
        lc.sleep(1)
        names = sorted(os.listdir(d))
        assert len(names) == 2  # one file per backed-up allocation, directly in d
        for n in names:
            assert n.startswith(f"unisleep-backup-{os.getpid()}-") and n.endswith(".bin")
            st = os.lstat(d / n)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
            fd = os.open(d / n, os.O_RDONLY)
            try:  # kept open and locked by the store while the backup lives
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        page = lc.driver.granularity()
        assert sorted(os.stat(d / n).st_size for n in names) == [-(-x.numel() // page) * page for x in (b, a)]
        lc.wake_up()
        assert torch.equal(a, ra) and torch.equal(b, rb)
        assert os.listdir(d) == []  # removed at the wake
        lc.sleep(1)
        assert len(os.listdir(d)) == 2
    finally:
        lc.close()
    assert os.listdir(d) == []  # and at close; the directory itself is the user's
    assert d.is_dir()


def test_a_flat_backup_is_read_through_its_own_descriptor_whatever_the_name_becomes(tmp_path):
    """Someone who may write in the directory (here the owner itself) renames the backup and
    plants another file under its name: the wake reads the store's own file, byte-exact, and
    the planted file is neither read nor changed."""
    d = tmp_path / "flat"
    d.mkdir(mode=0o700)
    lc = MemoryLifecycle("host", spill_dir=str(d), spill_layout="flat")
    try:
        w = lc.empty((2 * MiB,), torch.uint8, tag="weights")
        ref = _pattern(w.numel(), 4)
        w.copy_(ref)
        lc.sleep(1)
        (name,) = os.listdir(d)
        os.rename(d / name, d / "moved-away.bin")
        planted = b"planted" * 1000
        (d / name).write_bytes(planted)
        lc.wake_up()
        assert torch.equal(w, ref)
        assert (d / name).read_bytes() == planted
    finally:
        lc.close()


def test_a_flat_spill_directory_must_pass_the_same_checks(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(SpillDirError, match="not safe"):
        MemoryLifecycle("host", spill_dir=str(d), spill_layout="flat")
    assert os.listdir(d) == []


@pytest.mark.slow
def test_flat_files_of_a_killed_process_are_cleaned_and_a_live_ones_are_not(tmp_path):
    from unisleep.backends.host.spill_dir import clean_orphans

    d = tmp_path / "flat"
    d.mkdir(mode=0o700)
    code = textwrap.dedent("""
        import os, sys, time, torch
        from unisleep import MemoryLifecycle
        lc = MemoryLifecycle("host", spill_dir=sys.argv[1], spill_layout="flat")
        w = lc.empty((1 << 20,), torch.uint8, tag="weights")
        lc.sleep(1)
        print("asleep", flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "asleep"
        files = {p.pid: [n for n in os.listdir(d) if n.startswith(f"unisleep-backup-{p.pid}-")] for p in procs}
        assert all(len(v) == 1 for v in files.values())
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        removed = clean_orphans(str(d))
        assert [os.path.basename(r) for r in removed] == files[procs[0].pid]
        assert sorted(os.listdir(d)) == files[procs[1].pid]  # the live process's file stays
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


# ---------------------------------------------------------------------------- the staged store
@pytest.fixture
def staged(tmp_path):
    """The accelerators' file store on host tensors: its staging route forced (``_on_host``
    answers False, so host tensors stand for device memory; the staging buffer is not
    page-locked: there is no accelerator to pin for)."""
    from unisleep.backends.host.staged_spill import StagedSpillStore

    class Staged(StagedSpillStore):
        STAGE = 1 * MiB

        @staticmethod
        def _on_host(t) -> bool:
            return False

    s = Staged(None, str(tmp_path), layout="flat", pin=False)
    yield s
    s.close()


def test_the_staged_store_writes_and_reads_through_its_staging_buffer(staged):
    src = _pattern(3 * MiB + 17, 5)
    staged.reserve((1, 0), src.numel())
    staged.save((1, 0), src)
    assert staged.residency()["pageable"] == staged.STAGE  # the staging buffer (not pinned here)
    out = torch.empty_like(src)
    staged.load((1, 0), out)
    assert torch.equal(out, src)
    part = torch.empty(MiB + 3, dtype=torch.uint8)
    staged.load_range((1, 0), MiB - 7, part)  # across two pieces
    assert torch.equal(part, src[MiB - 7: 2 * MiB - 4])
    assert staged.release_unused() == staged.STAGE and staged.residency()["pageable"] == 0
    staged.load((1, 0), out)  # the staging buffer is made again
    assert torch.equal(out, src)
    fd = staged._fds[staged._files[(1, 0)][0]]
    os.pwrite(fd, b"\xff", MiB + 1)  # a byte of the second piece changes on disk
    with pytest.raises(BackupCorruptError, match="piece 1"):
        staged.load((1, 0), out)
