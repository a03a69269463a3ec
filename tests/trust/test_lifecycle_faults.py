"""The lifecycle's remaining fault cases: a closed lifecycle, a spill file system that turns
read-only while asleep, orphan cleanup beside a live transfer group's secret directory, two
processes starting lifecycles on one spill directory at once, and bad arguments to
``prepare_backup`` / ``adopt``.

The risky parts (a write into released memory, a remount under a sleeping lifecycle, the start-up
race) run in child processes, so a crash is a failed test, not a lost run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from trust_helpers import Child, run_child, small_filesystem

from unisleep import MemoryLifecycle
from unisleep.errors import InvalidArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


# ----------------------------------------------------------------------------- closed
@pytest.mark.slow
def test_a_closed_lifecycle_reads_closed_and_refuses_every_verb(tmp_path):
    """After close() every tag reads "closed" (never "awake"), and every verb raises
    LifecycleClosedError before it touches memory."""
    spill = str(tmp_path / "spill")
    res = run_child(f"""
    import contextlib
    lc = MemoryLifecycle("host", spill_dir={spill!r})
    w = fill(lc.empty((2 * MiB,), torch.uint8, tag="weights"), 1)
    kv = lc.empty((MiB,), torch.uint8, tag="kv_cache")
    lc.sleep(1)
    lc.wake_up(["weights"])  # weights awake, kv_cache discarded
    assert lc.state() == {{"weights": "awake", "kv_cache": "discarded"}}
    lc.close()
    state, closed = lc.state(), getattr(lc, "closed", "no such attribute")
    out = torch.empty(16, dtype=torch.uint8)
    model = torch.nn.Linear(2, 2)
    calls = {{
        "sleep(1)": lambda: lc.sleep(1),
        "sleep(2)": lambda: lc.sleep(2),
        "sleep(background)": lambda: lc.sleep(1, background=True),
        "wake_up()": lambda: lc.wake_up(),
        "wake_up(weights)": lambda: lc.wake_up(["weights"]),
        "wake_up(progressive)": lambda: lc.wake_up(progressive=True),
        "discard": lambda: lc.discard(["kv_cache"]),
        "empty(weights)": lambda: lc.empty((4,), tag="weights"),
        "empty(new tag)": lambda: lc.empty((4,), tag="other"),
        "adopt": lambda: lc.adopt(torch.ones(4)),
        "pool": lambda: lc.pool("weights").__enter__(),
        "prepare_backup()": lambda: lc.prepare_backup(),
        "prepare_backup(n)": lambda: lc.prepare_backup(MiB),
        "resident_bytes()": lambda: lc.resident_bytes(),
        "resident_bytes(tag)": lambda: lc.resident_bytes("weights"),
        "allocated_bytes": lambda: lc.allocated_bytes(),
        "read_backup": lambda: lc.read_backup(w.data_ptr(), out),
        "preserve": lambda: lc.preserve(["*"]),
        "add_hooks": lambda: lc.add_hooks(before_sleep=lambda *a: None),
        "on_free": lambda: lc.on_free(lambda va, size: None),
        "wait": lambda: lc.wait(),
        "ready": lambda: lc.ready(w),
        "install_ready_hooks": lambda: lc.install_ready_hooks(model),
        "is_sleeping": lambda: lc.is_sleeping,
    }}
    outcome = {{}}
    for what, call in calls.items():
        try:
            call()
            outcome[what] = "returned"
        except E.LifecycleClosedError as e:
            assert isinstance(e, E.UnisleepError) and "closed" in str(e) and "MemoryLifecycle" in str(e), str(e)
            outcome[what] = "closed"
        except Exception as e:
            outcome[what] = type(e).__name__ + ": " + str(e)
    lc.close()  # idempotent
    report(state=state, closed=closed, outcome=outcome)
    """, tmp_path)
    assert res["state"] == {"weights": "closed", "kv_cache": "closed"}, res
    assert res["closed"] is True, res
    wrong = {k: v for k, v in res["outcome"].items() if v != "closed"}
    assert not wrong, f"verbs that did not raise LifecycleClosedError on a closed lifecycle: {wrong}"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_receive_into_a_closed_lifecycle_is_refused_before_a_byte_moves(tmp_path):
    """A receiver guarded by a lifecycle that was closed under live target tensors: the guard
    refuses (LifecycleClosedError) instead of writing into released memory (a SIGSEGV), on both
    transfer paths; the sender is told nothing was applied."""
    res = run_child(f"""
    import socket, threading
    from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender
    addr = "tcp://127.0.0.1:{_port()}"
    groups = {{}}
    ts = [threading.Thread(target=lambda r=r: groups.__setitem__(r, TransferGroup.create(addr, r, 2, platform="host",
          timeout_s=30))) for r in (0, 1)]
    [t.start() for t in ts]; [t.join(60) for t in ts]
    g0, g1 = groups[0], groups[1]

    def weights(v):
        g = torch.Generator().manual_seed(v)
        return {{"w": torch.randn(512, 1024, generator=g), "b": torch.randn(33, generator=g)}}

    def both(send, recv):
        res = {{}}
        def run(k, f):
            try:
                res[k] = f()
            except Exception as e:
                res[k] = e
        ts = [threading.Thread(target=run, args=("s", send)), threading.Thread(target=run, args=("r", recv))]
        [t.start() for t in ts]; [t.join(60) for t in ts]
        return res["s"], res["r"]

    lc = MemoryLifecycle("host", spill_dir={str(tmp_path / "spill")!r})
    target = {{k: torch.zeros_like(v) for k, v in weights(0).items()}}
    lc.adopt(target, tag="weights")
    rx = WeightReceiver(g1, target=target, guard=lc)
    out = {{}}
    for v, path in ((1, "collective"), (2, "ipc")):
        tx = WeightSender(g0, path=path)
        s, r = both(lambda: tx.send(weights(v), v), rx.receive)
        assert not isinstance(r, Exception) and not isinstance(s, Exception), (s, r)
        assert all(torch.equal(target[k], t) for k, t in weights(v).items())
    lc.close()  # target tensors are still referenced: their addresses stay fenced
    out["state"] = lc.state()
    print("closed; state", out["state"], flush=True)
    for v, path in ((3, "collective"), (4, "ipc")):
        tx = WeightSender(g0, path=path)
        s, r = both(lambda: tx.send(weights(v), v), rx.receive)
        print(path, "receive returned", repr(r)[:300], flush=True)
        out[path] = {{"receiver": type(r).__name__, "message": str(r), "sender": type(s).__name__,
                      "version": rx.version}}
    g0.close(); g1.close()
    report(**out)
    """, tmp_path, timeout=240)
    assert res["state"] == {"weights": "closed"}, res
    for path in ("collective", "ipc"):
        got = res[path]
        assert got["receiver"] == "LifecycleClosedError", (path, got)
        assert "closed" in got["message"] and "Nothing was transferred" in got["message"], got
        assert got["sender"] in ("InvalidTransitionError", "LifecycleClosedError", "TransferError"), got
        assert got["version"] == 2, got


# ----------------------------------------------------------------------------- read-only at wake
@pytest.mark.slow
def test_a_spill_filesystem_turning_read_only_while_asleep_never_loses_good_bytes(tmp_path):
    """ext4 ``errors=remount-ro`` while asleep, reproduced by remounting the test's filesystem
    read-only: the wake reads the backup back (exact, verified) and the tag is awake, with a
    warning that the spill file could not be removed; its disk room stays counted until the
    file is removed at the next sleep on a writable file system.  No message advises
    discarding good bytes.  Same for a progressive wake."""
    with small_filesystem(160, tmp_path) as (mnt, kind):
        res = run_child(f"""
        import subprocess, warnings
        warnings.simplefilter("always")
        def mount(opt):
            r = subprocess.run(["mount", "-o", "remount," + opt, {mnt!r}], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr

        lc = MemoryLifecycle("host", spill_dir={mnt!r})
        w = fill(lc.empty((8 * MiB,), torch.uint8, tag="weights"), 1)
        kv = fill(lc.empty((2 * MiB,), torch.uint8, tag="kv_cache"), 2)
        cw, ptr = crc(w), w.data_ptr()
        out = {{}}
        for mode in ("plain", "progressive"):
            lc.sleep(1)
            assert lc.state() == {{"weights": "offloaded", "kv_cache": "discarded"}}
            files = bins(lc.backup_store.dir)
            assert len(files) == 1, files
            mount("ro")
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                try:
                    if mode == "plain":
                        lc.wake_up()
                    else:
                        lc.wake_up(progressive=True)
                        lc.wait()
                    woke = "ok"
                except Exception as e:
                    woke = type(e).__name__ + ": " + str(e)
            state = lc.state()
            got = {{"woke": woke, "state": state, "warnings": [str(x.message) for x in ws],
                    "exact": state.get("weights") == "awake" and crc(w) == cw and w.data_ptr() == ptr,
                    "kv_zero": state.get("kv_cache") == "awake" and kv.count_nonzero().item() == 0,
                    "held": lc.backup_bytes(), "files": bins(lc.backup_store.dir)}}
            print(mode, "first wake:", got, flush=True)
            # a second wake is a no-op; a sleep on the read-only file system is refused with
            # everything as it was (and no advice to discard anything)
            try:
                lc.wake_up()
                got["second_wake"] = "ok"
            except Exception as e:
                got["second_wake"] = type(e).__name__ + ": " + str(e)
            print(mode, "second wake:", got["second_wake"], lc.state(), flush=True)
            try:
                lc.sleep(1)
                got["sleep_ro"] = "slept"
            except E.BackupError as e:
                got["sleep_ro"] = type(e).__name__ + ": " + str(e)
            got["after_sleep_ro"] = lc.state()
            got["exact_after_sleep_ro"] = got["after_sleep_ro"].get("weights") == "awake" and crc(w) == cw
            mount("rw")
            lc.sleep(1)  # the file system is writable again: the leftover file goes
            lc.wake_up()
            got["files_rw"] = bins(lc.backup_store.dir)
            got["held_rw"] = lc.backup_bytes()
            got["exact_rw"] = crc(w) == cw
            out[mode] = got
        lc.close()
        report(**out)
        """, tmp_path)
    for mode, got in res.items():
        assert got["woke"] == "ok", (mode, got)
        assert got["state"] == {"weights": "awake", "kv_cache": "awake"}, (mode, got)
        assert got["exact"] and got["kv_zero"], (mode, got)
        assert any("could not be removed" in w and mnt in w for w in got["warnings"]), (mode, got["warnings"])
        assert got["held"] == 8 * MiB and len(got["files"]) == 1, (mode, got)  # the record is kept
        assert got["second_wake"] == "ok", (mode, got)
        assert got["sleep_ro"].startswith("BackupError") and "Read-only" in got["sleep_ro"], (mode, got)
        assert "discard" not in got["sleep_ro"], (mode, got)
        assert got["after_sleep_ro"] == {"weights": "awake", "kv_cache": "awake"} and got["exact_after_sleep_ro"], got
        assert got["files_rw"] == [] and got["held_rw"] == 0 and got["exact_rw"], (mode, got)


@pytest.mark.slow
def test_a_corrupt_backup_error_says_the_bytes_were_not_exposed(tmp_path):
    """The message of a corrupt backup (bad bytes, never exposed) is true: the tag stays
    offloaded with its memory unmapped; discarding is advised only because the backup is bad."""
    spill = str(tmp_path / "spill")
    res = run_child(f"""
    lc = MemoryLifecycle("host", spill_dir={spill!r})
    w = fill(lc.empty((4 * MiB,), torch.uint8, tag="weights"), 3)
    lc.sleep(1)
    path = bins(lc.backup_store.dir)[0]
    with open(path, "r+b") as f:
        f.seek(MiB); b = f.read(1); f.seek(MiB); f.write(bytes([b[0] ^ 0xFF]))
    try:
        lc.wake_up()
        msg = "woke"
    except E.BackupCorruptError as e:
        msg = str(e)
    report(msg=msg, state=lc.state(), resident=lc.resident_bytes("weights"))
    """, tmp_path)
    assert res["state"] == {"weights": "offloaded"} and res["resident"] == 0, res
    assert "fails its XXH3 checksum" in res["msg"] and "not exposed" in res["msg"], res["msg"]
    assert "memory unmapped" in res["msg"], res["msg"]


# ----------------------------------------------------------------------------- orphan cleanup
@pytest.mark.slow
def test_orphan_cleanup_never_removes_a_live_groups_secret_directory(tmp_path, monkeypatch):
    """The private run directory ``<tmp>/unisleep-<uid>`` (a live loopback group's secret) sits
    beside spill directories in the temp directory.  Neither a new MemoryLifecycle nor
    ``unisleep doctor --clean`` removes it, however old it is, nor anything else without
    unisleep's own marker of a dead owner; rank 1 still finds rank 0's secret."""
    import tempfile

    from unisleep.backends.host.spill_dir import clean_orphans
    from unisleep.transfer import TransferGroup
    from unisleep.transfer.secret import loopback_secret_path

    tmp = str(tmp_path / "tmp")
    os.makedirs(tmp)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    # a host where the private run directory falls back to the temp directory (no /run/user/<uid>,
    # and not root's /run/unisleep): there it sits beside the spill directories cleanup looks at
    from unisleep import private_dir as private_dir_mod

    monkeypatch.setattr(private_dir_mod, "_run_dir_candidates", lambda: [])
    port = _port()
    addr = f"tcp://127.0.0.1:{port}"
    groups: dict = {}

    def mk(r):
        try:
            groups[r] = TransferGroup.create(addr, r, 2, platform="host", timeout_s=30)
        except Exception as e:  # noqa: BLE001
            groups[r] = e

    t0 = threading.Thread(target=mk, args=(0,))
    t0.start()
    secret = loopback_secret_path(port, "default")
    private = os.path.dirname(secret)
    assert private == os.path.join(tmp, f"unisleep-{os.getuid()}")
    deadline = time.monotonic() + 30
    while not os.path.exists(secret):
        assert time.monotonic() < deadline, "rank 0 wrote no secret"
        time.sleep(0.02)
    # beside it, other things no unisleep process marked as its spill directory
    unmarked = os.path.join(tmp, "unisleep-123456789-deadbeef-old")  # old-style name, no owner file
    garbage = os.path.join(tmp, "unisleep-99-cafebabe-garbage")  # an owner file that is not unisleep's
    os.makedirs(unmarked)
    os.makedirs(garbage)
    with open(os.path.join(garbage, ".owner"), "w") as f:
        f.write("not json")
    for d in (private, unmarked, garbage):
        os.utime(d, (time.time() - 86400, time.time() - 86400))
    before = {d: sorted(os.listdir(d)) for d in (private, unmarked, garbage)}

    listed = clean_orphans(tmp, remove=False)
    lc = MemoryLifecycle("host", spill_dir=tmp)  # runs the cleanup of its spill directory
    lc.close()
    env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=ROOT)
    env.pop("XDG_RUNTIME_DIR", None)
    r = subprocess.run([sys.executable, "-m", "unisleep", "doctor", "--clean", "--spill-dir", tmp],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert clean_orphans(tmp) == []
    after = {d: sorted(os.listdir(d)) if os.path.isdir(d) else None for d in (private, unmarked, garbage)}
    assert after == before, (before, after)
    assert listed == [], listed

    t1 = threading.Thread(target=mk, args=(1,))
    t1.start()
    t0.join(60), t1.join(60)
    for rank in (0, 1):
        assert not isinstance(groups.get(rank), Exception), groups.get(rank)
    groups[0].close(), groups[1].close()


# ----------------------------------------------------------------------------- start-up race
#: start-ups per process (two processes); UNISLEEP_STARTUP_RACE_N=50000 is the 100,000 start-up check
STARTUP_RACE_N = int(os.environ.get("UNISLEEP_STARTUP_RACE_N", "2500"))


@pytest.mark.slow
def test_two_processes_starting_lifecycles_on_one_spill_dir_never_lose_one(tmp_path):
    """Two processes construct (and close) lifecycles on one spill directory in a loop, as fast
    as they can: no start-up fails, no live spill directory disappears under its owner (each is
    checked, and every 50th one sleeps and wakes through it), and nothing is left behind."""
    spill = str(tmp_path / "spill")
    os.makedirs(spill)
    go = str(tmp_path / "go")
    code = f"""
    import logging
    from unisleep.backends.host import HostDriver
    logging.disable(logging.WARNING)
    n = {STARTUP_RACE_N}
    fails = []
    while not os.path.exists({go!r}):
        time.sleep(0.001)
    t0 = time.perf_counter()
    for i in range(n):
        try:
            # a ready driver: the start-up is then the spill directory's claim (no backend lookup)
            lc = MemoryLifecycle(HostDriver(), spill_dir={spill!r})
            d = lc.backup_store.dir
            if i % 50 == 0:
                t = fill(lc.empty((64 << 10,), torch.uint8, tag="weights"), i)
                c = crc(t)
                lc.sleep(1)
                lc.wake_up()
                assert crc(t) == c
                del t
            if not os.path.exists(os.path.join(d, ".owner")):
                fails.append(f"start-up {{i}}: its spill directory {{d}} is gone")
            lc.close()
        except Exception as e:
            fails.append(f"start-up {{i}}: {{type(e).__name__}}: {{e}}")
    report(n=n, fails=len(fails), first=fails[:10], seconds=time.perf_counter() - t0)
    """
    a, b = Child(code, tmp_path, "a"), Child(code, tmp_path, "b")
    time.sleep(0.5)
    open(go, "w").close()
    ra, rb = a.ok(1800), b.ok(1800)
    print(f"start-up race: {ra['n'] + rb['n']} start-ups in {max(ra['seconds'], rb['seconds']):.1f} s")
    assert ra["fails"] + rb["fails"] == 0, (ra, rb)
    assert os.listdir(spill) == [], os.listdir(spill)


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("nbytes", [-5, -1, 1.5, "1024", True, float("nan")])
def test_prepare_backup_refuses_a_negative_or_non_int_size(lifecycle, nbytes):
    lc = lifecycle
    lc.empty((1024,), torch.uint8, tag="weights")
    with pytest.raises(InvalidArgumentError, match="prepare_backup"):
        lc.prepare_backup(nbytes)
    with pytest.raises(InvalidArgumentError, match="background"):
        lc.prepare_backup(1024, background="yes")
    assert lc.prepare_backup(0) == 0
    assert lc.prepare_backup() == lc.allocated_bytes("weights")


def test_adopting_a_view_without_its_base_is_refused(lifecycle):
    """Moving a view alone would leave its base behind: the two would silently stop sharing
    their bytes.  Refused, naming what to pass; nothing moves."""
    lc = lifecycle
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:20]
    ptr = view.data_ptr()
    with pytest.raises(InvalidArgumentError, match=r"view.*pass") as e:
        lc.adopt({"v": view}, tag="weights")
    assert "'v'" in str(e.value) and "Nothing was moved" in str(e.value)
    assert view.data_ptr() == ptr and lc.allocated_bytes() == 0 and lc.tags == []
    base[12] = -1
    assert view[2].item() == -1  # still a view of its base
    lc.adopt({"base": base, "v": view})  # together they move together
    assert view.data_ptr() == base.data_ptr() + 40
    # a view of a parameter, without the parameter (which its module still holds): refused
    m = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidArgumentError, match=r"'row'.*a view .*not passed"):
        lc.adopt({"row": m.weight[0]}, tag="other")
    # a view whose base nobody else holds (a reshaped temporary) moves alone
    grid = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    buf = torch.nn.Module()
    buf.register_buffer("table", torch.arange(10, dtype=torch.float32).view(2, 5))
    lc.adopt({"grid": grid, "buf": buf}, tag="other")
    assert torch.equal(grid, torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert lc.owns(grid.data_ptr(), 256) and lc.owns(buf.table.data_ptr(), 40)


def test_adopting_a_tensor_whose_view_is_not_passed_is_refused(lifecycle):
    """A view (or a state_dict() alias) of an adopted tensor that was not passed would keep
    pointing at the old memory: refused, naming the fix; passing it too, or dropping it, works."""
    lc = lifecycle
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:20]
    with pytest.raises(InvalidArgumentError, match=r"share its storage.*pass") as e:
        lc.adopt({"base": base}, tag="weights")
    assert "'base'" in str(e.value) and "Nothing was moved" in str(e.value)
    assert lc.allocated_bytes() == 0
    m = torch.nn.Linear(8, 8)
    sd = m.state_dict()
    with pytest.raises(InvalidArgumentError, match="state_dict"):
        lc.adopt(m)
    del sd
    lc.adopt(m)  # nothing else holds its storage now
    del view
    lc.adopt({"base": base}, tag="other")
    assert lc.allocated_bytes() > 0
