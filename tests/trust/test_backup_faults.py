"""A sleep never loses, corrupts or silently reverts weights: faults on real filesystems.

Every scenario runs in a child process (a SIGSEGV or an abort is a failed test, not a lost run).
The filesystems are mounted by the tests (loop ext4, else tmpfs); without the right to mount,
those tests skip with the reason.  CI runs as root and mounts them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from trust_helpers import Child, kill_tree, run_child, small_filesystem

pytestmark = pytest.mark.slow  # every test here starts processes


# ----------------------------------------------------------------------------- a disk that fills up
def test_two_concurrent_sleeps_on_a_nearly_full_disk(tmp_path):
    """Two processes, 300 MiB of weights each, sleep at once onto a ~550 MB filesystem: only one
    backup fits.  They take turns at the disk (without turns both could pass the free-space check
    and then both fail to allocate: ext4 gives each allocation part of the room); the other fails
    *before* anything is released: every tag awake, bytes exact, no partial file; it sleeps fine
    once the first one woke."""
    with small_filesystem(560, tmp_path) as (mnt, kind):
        go, woke = os.path.join(mnt, "go"), os.path.join(str(tmp_path), "woke")
        code = f"""
        import sys
        me = sys.argv[0]
        lc = MemoryLifecycle("host", spill_dir={mnt!r})
        w = fill(lc.empty((300 * MiB,), torch.uint8, tag="weights"), hash(me) & 0xFFFF)
        kv = fill(lc.empty((64 * MiB,), torch.uint8, tag="kv_cache"), 7)
        cw, ckv, ptrs = crc(w), crc(kv), (w.data_ptr(), kv.data_ptr())
        resident = lc.resident_bytes()
        while not os.path.exists({go!r}):
            pass
        tried = os.path.join({str(tmp_path)!r}, "tried-" + os.path.basename(me))
        try:
            lc.sleep(1)
            outcome = "slept"
            open(tried, "a").close()
        except E.BackupError as e:
            outcome = "refused"
            open(tried, "a").close()
            msg = str(e)
            assert isinstance(e, E.UnisleepError)
            # either the free-space check saw the other backup, or both passed it and the
            # reservation of the whole file hit ENOSPC: both before anything was released
            if not isinstance(e, E.HostBudgetError):
                assert e.path and e.path.startswith({mnt!r}), e.path
                assert "weights" in msg and "No space" in msg, msg
            assert lc.state() == {{"weights": "awake", "kv_cache": "awake"}}, lc.state()
            assert lc.resident_bytes() == resident
            assert (crc(w), crc(kv)) == (cw, ckv)  # nothing lost, kv_cache included
            assert (w.data_ptr(), kv.data_ptr()) == ptrs
            assert bins(lc.backup_store.dir) == [], bins(lc.backup_store.dir)  # the partial backup is gone
            while not os.path.exists({woke!r}):
                time.sleep(0.01)
            lc.sleep(1)  # the retry works once there is room
        assert lc.state() == {{"weights": "offloaded", "kv_cache": "discarded"}}
        assert lc.resident_bytes() == 0
        # wake (and free the disk) only once both have tried to sleep: a child scheduled late
        # must not find the room the other one already gave back
        while sum(n.startswith("tried-") for n in os.listdir({str(tmp_path)!r})) < 2:
            time.sleep(0.01)
        lc.wake_up()
        assert crc(w) == cw and kv.count_nonzero().item() == 0
        open({woke!r}, "a").close()
        report(outcome=outcome)
        """
        a, b = Child(code, tmp_path, "a"), Child(code, tmp_path, "b")
        try:
            time.sleep(3)  # both allocated and waiting
            open(go, "w").close()
            outcomes = sorted([a.ok(240)["outcome"], b.ok(240)["outcome"]])
        finally:  # one failed or timed out: the other must not keep the test filesystem busy
            for c in (a, b):
                if c.proc.poll() is None:
                    kill_tree(c.proc)
        assert outcomes == ["refused", "slept"], (outcomes, kind)


def test_sleeps_onto_one_disk_take_turns_the_second_is_refused_by_the_check(tmp_path):
    """Two lifecycles sleep onto one nearly full disk; the first is slow to allocate its backup
    file (held 1 s before allocating — a slow disk).  The second waits for the first's turn, then
    its free-space check sees the room taken: it is refused by the check (HostBudgetError,
    before any file), the first sleeps.  Without turns the second passed the check while the
    first had not allocated yet, took the room, and the first failed at its allocation — and when
    both allocate at once on ext4, both fail."""
    with small_filesystem(560, tmp_path) as (mnt, kind):
        code = f"""
        import threading
        a, b = MemoryLifecycle("host", spill_dir={mnt!r}), MemoryLifecycle("host", spill_dir={mnt!r})
        mine = {{}}
        for name, lc in (("a", a), ("b", b)):
            w = fill(lc.empty((300 * MiB,), torch.uint8, tag="weights"), len(name))
            kv = fill(lc.empty((64 * MiB,), torch.uint8, tag="kv_cache"), 7)
            mine[name] = (w, kv, crc(w), crc(kv))
        reserve = a.backup_store.reserve

        def slow_reserve(key, n):  # a slow disk: the allocation comes 1 s after the check
            time.sleep(1.0)
            return reserve(key, n)

        a.backup_store.reserve = slow_reserve
        out = {{}}

        def sleep(name, lc):
            try:
                lc.sleep(1)
                out[name] = ("slept", "")
            except Exception as e:
                out[name] = (type(e).__name__, str(e))

        ta = threading.Thread(target=sleep, args=("a", a))
        ta.start()
        time.sleep(0.3)  # a checked and waits to allocate
        tb = threading.Thread(target=sleep, args=("b", b))
        tb.start()
        ta.join(60)
        tb.join(60)
        assert out["a"][0] == "slept", out
        assert out["b"][0] == "HostBudgetError" and "does not fit" in out["b"][1], out
        assert "Nothing was released" in out["b"][1], out
        w, kv, cw, ckv = mine["b"]
        assert b.state() == {{"weights": "awake", "kv_cache": "awake"}} and (crc(w), crc(kv)) == (cw, ckv)
        assert bins(b.backup_store.dir) == []
        a.wake_up()
        assert crc(mine["a"][0]) == mine["a"][2]
        b.sleep(1)  # its turn, now that there is room
        b.wake_up()
        assert crc(w) == cw
        report(a=out["a"][0], b=out["b"][0])
        """
        got = run_child(code, tmp_path, timeout=240)
        assert got == {"a": "slept", "b": "HostBudgetError"}, (got, kind)


def test_enospc_when_reserving_the_backup_changes_nothing(tmp_path):
    """Deterministic ENOSPC at the reservation: the filesystem has free blocks (the free-space
    check passes) but no free inode for the backup file."""
    with small_filesystem(96, tmp_path) as (mnt, kind):
        if kind != "ext4":
            pytest.skip("needs a loop-mounted ext4 (no loop device here) to run out of inodes")
        code = f"""
        lc = MemoryLifecycle("host", spill_dir={mnt!r})
        w = fill(lc.empty((8 * MiB,), torch.uint8, tag="weights"), 1)
        kv = fill(lc.empty((8 * MiB,), torch.uint8, tag="kv_cache"), 2)
        cw, ckv, resident = crc(w), crc(kv), lc.resident_bytes()
        fillers, i = os.path.join({mnt!r}, "inodes"), 0
        os.mkdir(fillers)
        while True:  # use up every inode
            try:
                open(os.path.join(fillers, str(i)), "w").close()
            except OSError:
                break
            i += 1
        try:
            lc.sleep(1)
            raise SystemExit("sleep without an inode for its backup went through")
        except E.BackupError as e:
            assert "No space left" in str(e) and e.path and e.path.startswith({mnt!r}), str(e)
            assert "'weights'" in str(e) and "Nothing was released" in str(e), str(e)
        assert lc.state() == {{"weights": "awake", "kv_cache": "awake"}}
        assert (crc(w), crc(kv), lc.resident_bytes()) == (cw, ckv, resident)
        assert bins(lc.backup_store.dir) == []
        os.unlink(os.path.join(fillers, "0"))
        lc.sleep(1)
        lc.wake_up()
        assert crc(w) == cw
        report(ok=True, inodes=i)
        """
        run_child(code, tmp_path)


def test_read_only_spill_dir(tmp_path):
    """The spill filesystem turns read-only while awake: the sleep raises a named BackupError
    naming the path, with every tag awake and exact (no SIGSEGV later); a lifecycle asked to
    spill to a read-only place is refused at construction with SpillDirError."""
    with small_filesystem(128, tmp_path) as (mnt, kind):
        code = f"""
        import subprocess
        lc = MemoryLifecycle("host", spill_dir={mnt!r})
        w = fill(lc.empty((16 * MiB,), torch.uint8, tag="weights"), 1)
        kv = fill(lc.empty((16 * MiB,), torch.uint8, tag="kv_cache"), 2)
        cw, ckv = crc(w), crc(kv)
        subprocess.run(["mount", "-o", "remount,ro", {mnt!r}], check=True)
        try:
            lc.sleep(1)
            raise SystemExit("sleep onto a read-only filesystem did not fail")
        except E.BackupError as e:
            assert {mnt!r} in str(e) and "Read-only" in str(e), str(e)
        assert lc.state() == {{"weights": "awake", "kv_cache": "awake"}}
        assert (crc(w), crc(kv)) == (cw, ckv)  # touching both is safe: mapped, exact
        try:
            MemoryLifecycle("host", spill_dir={mnt!r})
            raise SystemExit("a lifecycle on a read-only spill dir was created")
        except E.SpillDirError as e:
            assert {mnt!r} in str(e) and "spill_dir" in str(e), str(e)
            assert isinstance(e, ValueError)
        subprocess.run(["mount", "-o", "remount,rw", {mnt!r}], check=True)
        lc.sleep(1)
        lc.wake_up()
        assert crc(w) == cw
        report(ok=True)
        """
        run_child(code, tmp_path)


# ----------------------------------------------------------------------------- verified backups
@pytest.mark.parametrize("damage", ["corrupt-16-bytes", "truncate", "delete"])
def test_damaged_spill_file_is_caught_and_the_tag_is_never_stuck(tmp_path, damage):
    code = f"""
    spill = {str(tmp_path / "spill")!r}
    lc = MemoryLifecycle("host", spill_dir=spill, chunk_bytes=8 * MiB)
    w = fill(lc.empty((40 * MiB,), torch.uint8, tag="weights"), 3)
    kv = lc.empty((8 * MiB,), torch.uint8, tag="kv_cache")
    cw = crc(w)
    lc.sleep(1)
    [path] = bins(spill)
    damage = {damage!r}
    if damage == "corrupt-16-bytes":
        with open(path, "r+b") as f:
            f.seek(17 * MiB + 5)
            old = f.read(16)
            f.seek(17 * MiB + 5)
            f.write(bytes(b ^ 0x5A for b in old))
    elif damage == "truncate":
        os.truncate(path, 30 * MiB)
    else:
        os.unlink(path)
    try:
        lc.wake_up()
        raise SystemExit("a damaged backup was restored silently")
    except E.BackupCorruptError as e:
        msg = str(e)
        assert "weights" in msg and e.tag == "weights", msg
        assert e.path == path or path in msg, msg
        if damage == "corrupt-16-bytes":
            assert "piece 2" in msg and "checksum" in msg, msg
    # the other tag woke; the damaged one stays offloaded, unmapped: nothing unverified exposed
    assert lc.state() == {{"weights": "offloaded", "kv_cache": "awake"}}, lc.state()
    assert lc.resident_bytes("weights") == 0
    assert kv.count_nonzero().item() == 0
    try:  # waking again says the same, does not half-map
        lc.wake_up(["weights"])
        raise SystemExit("second wake restored a damaged backup")
    except E.BackupCorruptError:
        pass
    assert lc.resident_bytes("weights") == 0
    # never stuck: discard it (or sleep at level 2), wake it empty, refill it
    lc.discard(["weights"])
    assert lc.state()["weights"] == "discarded" and bins(spill) == []
    lc.wake_up(["weights"])
    assert w.count_nonzero().item() == 0
    fill(w, 3)  # e.g. a weight transfer
    lc.sleep(1)
    lc.wake_up()
    assert crc(w) == cw
    report(ok=True)
    """
    run_child(code, tmp_path)


def test_corrupt_backup_can_be_slept_at_level_2(tmp_path):
    code = f"""
    spill = {str(tmp_path / "spill")!r}
    lc = MemoryLifecycle("host", spill_dir=spill)
    w = fill(lc.empty((4 * MiB,), torch.uint8, tag="weights"), 3)
    lc.sleep(1)
    with open(bins(spill)[0], "r+b") as f:
        f.write(b"garbage!")
    try:
        lc.wake_up()
        raise SystemExit("corrupt backup restored")
    except E.BackupCorruptError:
        pass
    lc.sleep(2)
    assert lc.state() == {{"weights": "discarded"}} and bins(spill) == []
    lc.wake_up()
    assert w.count_nonzero().item() == 0
    report(ok=True)
    """
    run_child(code, tmp_path)


# ----------------------------------------------------------------------------- orphans
def test_sigkill_while_asleep_then_a_new_lifecycle_cleans_up_but_never_a_live_one(tmp_path):
    spill = str(tmp_path / "spill")
    sleeper = """
    lc = MemoryLifecycle("host", spill_dir=sys.argv[1] if len(sys.argv) > 1 else SPILL)
    w = fill(lc.empty((32 * MiB,), torch.uint8, tag="weights"), 5)
    cw = crc(w)
    lc.sleep(1)
    print("ASLEEP " + lc.backup_store.dir, flush=True)
    sys.stdin.readline() if False else None
    while not os.path.exists(lc.backup_store.dir + ".wake"):
        time.sleep(0.02)
    lc.wake_up()
    assert crc(w) == cw
    report(ok=True)
    """.replace("SPILL", repr(spill))
    doomed, alive = Child(sleeper, tmp_path, "doomed"), Child(sleeper, tmp_path, "alive")

    def asleep_dir(child):
        line = child.proc.stdout.readline()
        assert line.startswith("ASLEEP "), line + child.proc.stderr.read()
        return line.split(" ", 1)[1].strip()

    doomed_dir, alive_dir = asleep_dir(doomed), asleep_dir(alive)
    kill_tree(doomed.proc)
    assert any(f.endswith(".bin") for f in os.listdir(doomed_dir))  # the whole backup left behind
    # a new lifecycle on the same spill_dir removes the dead process's directory, not the live one's
    res = run_child(f"""
    lc = MemoryLifecycle("host", spill_dir={spill!r})
    report(left=sorted(os.listdir({spill!r})), mine=os.path.basename(lc.backup_store.dir))
    lc.close()
    """, tmp_path, "newcomer")
    assert os.path.basename(doomed_dir) not in res["left"]
    assert os.path.basename(alive_dir) in res["left"]
    assert not os.path.exists(doomed_dir)
    open(alive_dir + ".wake", "w").close()
    alive.ok(60)
    assert not os.path.exists(alive_dir)  # a normal exit removes its own


def test_sigterm_cleans_up_like_a_normal_exit(tmp_path):
    spill = str(tmp_path / "spill")
    child = Child(f"""
    lc = MemoryLifecycle("host", spill_dir={spill!r})
    w = fill(lc.empty((8 * MiB,), torch.uint8, tag="weights"), 5)
    lc.sleep(1)
    print("ASLEEP " + lc.backup_store.dir, flush=True)
    while True:
        time.sleep(0.05)
    """, tmp_path)
    line = child.proc.stdout.readline()
    assert line.startswith("ASLEEP "), line + child.proc.stderr.read()
    d = line.split(" ", 1)[1].strip()
    assert os.path.isdir(d)
    child.proc.send_signal(signal.SIGTERM)
    child.wait(30)
    assert child.rc == 128 + signal.SIGTERM, (child.rc, child.err)
    assert not os.path.exists(d), os.listdir(d)
    assert not os.path.exists(spill)  # unisleep created it, so it removed it once empty


# ----------------------------------------------------------------------------- sizes
def _shmem_bytes_of(pid: int) -> int:
    """Shared memory (where memfd pages live) that process ``pid`` holds: the pages allocated in
    the memfds it has open, or the shared pages it maps, whichever is more.  Read per process,
    so other work on the machine cannot trip the guard."""
    held = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:"):
                    held += os.stat(path).st_blocks * 512
            except OSError:
                continue
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    held = max(held, int(line.split()[1]) * 1024)
    except OSError:  # the process has ended
        pass
    return held


def test_the_shared_memory_guard_sees_a_childs_memfd_pages(tmp_path):
    """The guard below must be able to fire: a child that fills a 64 MiB memfd is seen."""
    child = Child("""
    import os, mmap
    fd = os.memfd_create("guard-probe")
    os.ftruncate(fd, 64 << 20)
    m = mmap.mmap(fd, 64 << 20)
    m.write(b"x" * (64 << 20))
    report(ready=True)
    time.sleep(30)
    """, tmp_path)
    seen, t0 = 0, time.monotonic()
    while seen < 64 << 20 and time.monotonic() - t0 < 20 and child.proc.poll() is None:
        seen = max(seen, _shmem_bytes_of(child.proc.pid))
        time.sleep(0.01)
    kill_tree(child.proc)
    assert seen >= 64 << 20, seen


def test_empty_of_one_tib_is_refused_at_once_with_nothing_committed(tmp_path):
    """Guarded: the child is killed if it holds 2 GiB of shared memory (where memfd pages live)."""
    child = Child(f"""
    lc = MemoryLifecycle("host", spill_dir={str(tmp_path / "spill")!r})
    t0 = time.perf_counter()
    try:
        lc.empty((1 << 40,), torch.uint8, tag="weights")
        raise SystemExit("1 TiB was handed out")
    except E.InsufficientMemoryError as e:
        dt = time.perf_counter() - t0
        msg = str(e)
    assert "1.00 TiB" in msg and "free" in msg, msg
    assert lc.allocated_bytes() == 0 and lc.tags == []
    report(seconds=dt, msg=msg)
    """, tmp_path)
    peak = 0
    while child.proc.poll() is None:
        grown = _shmem_bytes_of(child.proc.pid)
        peak = max(peak, grown)
        if grown > 2 << 30:
            kill_tree(child.proc)
            pytest.fail(f"the child committed {grown >> 20} MiB before being stopped")
        time.sleep(0.005)
    res = child.ok(30)
    assert res["seconds"] < 0.5, res
    assert peak < 256 << 20


# ----------------------------------------------------------------------------- lifetime
def test_a_collected_lifecycle_never_unmaps_a_live_model(tmp_path):
    run_child(f"""
    import atexit, weakref
    def load():
        m = torch.nn.Linear(256, 256)
        with torch.no_grad():
            m.weight.copy_(torch.arange(256 * 256, dtype=torch.float32).view(256, 256))
        MemoryLifecycle("host", spill_dir={str(tmp_path / "s")!r}).adopt(m)
        return m
    m = load()
    gc.collect()
    assert m.weight[3, 5].item() == 3 * 256 + 5  # still mapped: the model keeps its lifecycle
    view = m.weight[10:20]
    del m
    gc.collect()
    assert view[0, 1].item() == 10 * 256 + 1  # a view alone keeps it too
    # no exit-handler entry per lifecycle
    n0 = atexit._ncallbacks()
    for _ in range(50):
        MemoryLifecycle("host", spill_dir={str(tmp_path / "s")!r}).close()
    assert atexit._ncallbacks() == n0, (n0, atexit._ncallbacks())
    report(ok=True)
    """, tmp_path)


def test_close_with_live_tensors_fences_their_addresses(tmp_path):
    res = run_child(f"""
    spill = {str(tmp_path / "s")!r}
    lc = MemoryLifecycle("host", spill_dir=spill)
    old = fill(lc.empty((4 * MiB,), torch.uint8, tag="weights"), 1)
    try:
        lc.close(strict=True)
        raise SystemExit("strict close with a live tensor went through")
    except E.LiveTensorsError as e:
        assert "'weights'" in str(e), str(e)
    assert lc.state() == {{"weights": "awake"}}  # refused: nothing changed
    lc.close()
    lo, hi = old.data_ptr(), old.data_ptr() + old.numel()
    # later allocations never land on the fenced range
    others = [MemoryLifecycle("host", spill_dir=spill) for _ in range(3)]
    ts = [o.empty((4 * MiB,), torch.uint8, tag="x") for o in others for _ in range(8)]
    for t in ts:
        a, b = t.data_ptr(), t.data_ptr() + t.numel()
        assert b <= lo or a >= hi, "a new allocation reused a fenced address"
    report(lo=lo)
    """, tmp_path)
    # touching a fenced tensor faults (it cannot read or corrupt anything)
    touch = Child(f"""
    lc = MemoryLifecycle("host", spill_dir={str(tmp_path / "s2")!r})
    t = lc.empty((4096,), torch.uint8, tag="weights")
    lc.close()
    print("touching", flush=True)
    t.fill_(1)
    report(survived=True)
    """, tmp_path, "touch").wait(60)
    assert touch.rc == -signal.SIGSEGV, (touch.rc, touch.err[-2000:])


# ----------------------------------------------------------------------------- adopt is all-or-nothing
def test_failing_adopt_changes_nothing_and_leaks_nothing(tmp_path):
    run_child(f"""
    class Refuses(torch.Tensor):  # a tensor whose move fails half-way through adopt()
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "__set__":
                raise RuntimeError("this tensor refuses to move")
            return super().__torch_function__(func, types, args, kwargs or {{}})

    def fds():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink("/proc/self/fd/" + fd).startswith("/memfd:unisleep")
            except OSError:  # the descriptor listdir itself used
                pass
        return n

    lc = MemoryLifecycle("host", spill_dir={str(tmp_path / "s")!r})
    base = fds()
    for kind in ["meta", "sparse", "half-way"]:
        m = torch.nn.Module()
        m.a = torch.nn.Parameter(torch.randn(64, 64))
        m.b = torch.nn.Parameter(torch.randn(64, 64))
        if kind == "meta":
            m.c = torch.nn.Parameter(torch.empty(8, device="meta"))
        elif kind == "sparse":
            m.register_buffer("c", torch.ones(8).to_sparse())
        else:
            m.c = torch.nn.Parameter(torch.randn(8).as_subclass(Refuses))
        before = {{n: (t.data_ptr(), t.detach().clone()) for n, t in m.named_parameters() if t.device.type != "meta"}}
        for attempt in range(5):
            try:
                lc.adopt(m)
                raise SystemExit(f"adopt of a {{kind}} tensor went through")
            except E.InvalidArgumentError as e:
                assert "Nothing was moved" in str(e) or "nothing was moved" in str(e), str(e)
        for n, t in m.named_parameters():
            if n in before:
                assert t.data_ptr() == before[n][0], (kind, n)
                assert torch.equal(t.detach(), before[n][1]), (kind, n)
        assert lc.allocated_bytes() == 0 and lc.tags == [], (kind, lc.tags)
        assert fds() == base, (kind, fds(), base)
    report(ok=True)
    """, tmp_path)


def test_doctor_reports_and_cleans_orphans_but_not_a_live_process(tmp_path):
    import json
    import sys

    spill = str(tmp_path / "spill")
    sleeper = f"""
    lc = MemoryLifecycle("host", spill_dir={spill!r})
    w = fill(lc.empty((4 * MiB,), torch.uint8, tag="weights"), 5)
    lc.sleep(1)
    print("ASLEEP " + lc.backup_store.dir, flush=True)
    while not os.path.exists(lc.backup_store.dir + ".wake"):
        time.sleep(0.02)
    lc.wake_up()
    report(ok=True)
    """
    doomed, alive = Child(sleeper, tmp_path, "doomed"), Child(sleeper, tmp_path, "alive")
    dirs = []
    for c in (doomed, alive):
        line = c.proc.stdout.readline()
        assert line.startswith("ASLEEP "), line + c.proc.stderr.read()
        dirs.append(line.split(" ", 1)[1].strip())
    kill_tree(doomed.proc)
    env = {**os.environ, "UNISLEEP_SPILL_DIR": spill}
    rep = subprocess.run([sys.executable, "-m", "unisleep", "doctor", "--json"], capture_output=True, text=True, env=env)
    info = json.loads(rep.stdout)["spill"]
    assert info["orphans"] == [dirs[0]] and info["orphan_bytes"] >= 4 << 20, info
    text = subprocess.run([sys.executable, "-m", "unisleep", "doctor"], capture_output=True, text=True, env=env).stdout
    assert "left by processes that are gone" in text and "doctor --clean" in text, text
    out = subprocess.run([sys.executable, "-m", "unisleep", "doctor", "--clean", "--spill-dir", spill],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"removed {dirs[0]}" in out.stdout and "1 leftover spill directory removed" in out.stdout, out.stdout
    assert not os.path.exists(dirs[0]) and os.path.isdir(dirs[1])
    open(dirs[1] + ".wake", "w").close()
    alive.ok(60)
