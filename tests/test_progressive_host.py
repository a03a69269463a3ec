"""Progressive wake and background sleep on the host backend: real memfd memory, real spill
files, copies delayed through the driver's own hooks (``hooks.restore`` / ``hooks.backup``), no
mocks.  A layer that ran on a chunk still in flight would read unmapped memory (SIGSEGV) or
bytes that are not yet back, so the forward-pass checks run in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.errors import BackupCorruptError, BackupError, CopyInFlightError, HostBudgetError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 64 << 10  # one 128x128 float32 weight per mapping chunk
LAYERS = 12


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(LAYERS)])


@pytest.fixture
def lc(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, chunk_bytes=CHUNK)
    yield lc
    lc.close()


def test_bytes_exact_and_adoption_order(lc):
    lc.driver.configure(progressive_workers=1)  # one reader: the read order is exactly the step order
    m = make_model()
    lc.adopt(m)
    ref = [p.detach().clone() for p in m.parameters()]
    ptrs = [p.data_ptr() for p in m.parameters()]
    lc.sleep(1)
    seen = []
    lc.driver.hooks.restore = lambda va, n: seen.append(va)
    pw = lc.wake_up(["weights"], progressive=True)
    assert lc.state()["weights"] in ("waking", "awake")
    rep = lc.wait()
    assert rep.operation == "wake_up(progressive)" and rep.bytes_copied == LAYERS * CHUNK
    assert lc.state() == {"weights": "awake"}
    assert len(pw.steps) == LAYERS and seen == sorted(seen)  # chunk after chunk, in adoption order
    assert seen == [p.data_ptr() for p in m.parameters()]
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
    assert lc.wait() is None  # nothing in flight any more


def test_given_module_order_is_the_read_order(lc):
    lc.driver.configure(progressive_workers=1)
    m = make_model()
    lc.adopt(m)
    lc.sleep(1)
    seen = []
    lc.driver.hooks.restore = lambda va, n: seen.append(va)
    order = [m[5], m[0], m[11]]
    lc.wake_up(["weights"], progressive=True, order=order)
    lc.wait()
    want = [m[5].weight.data_ptr(), m[0].weight.data_ptr(), m[11].weight.data_ptr()]
    rest = sorted(p.data_ptr() for p in m.parameters() if p.data_ptr() not in want)
    assert seen == want + rest


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from unisleep import MemoryLifecycle
    hooks = sys.argv[1] == "hooks"
    lc = MemoryLifecycle("host", spill_dir=sys.argv[2], chunk_bytes=64 << 10)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(12)])
    lc.adopt(m)
    x = torch.randn(4, 128)
    with torch.no_grad():
        ref_out = m(x)
    ref = [p.detach().clone() for p in m.parameters()]
    lc.sleep(1)
    lc.driver.hooks.restore = lambda va, n: time.sleep(0.03)   # every chunk's read starts 30 ms late
    bad = []
    if hooks:
        lc.install_ready_hooks(m)
    for i, layer in enumerate(m):  # runs after the ready hook: the layer's bytes must be back
        layer.register_forward_pre_hook(lambda mod, a, i=i: bad.append(i) if not torch.equal(mod.weight, ref[i]) else None)
    t0 = time.perf_counter()
    lc.wake_up(["weights"], progressive=True)
    with torch.no_grad():
        out = m(x)
    took = time.perf_counter() - t0
    lc.wait()
    print("RESULT", torch.equal(out, ref_out), bad, round(took, 3), flush=True)
    """
)


def run_child(mode, spill_dir):
    return subprocess.run([sys.executable, "-c", CHILD, mode, spill_dir], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.slow
def test_a_layer_never_runs_on_a_chunk_in_flight(spill_dir):
    r = run_child("hooks", spill_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))
    _, same, bad, took = line.split(" ", 3)
    assert same == "True" and bad == "[]", line
    assert float(took) >= 0.03 * 2  # the delays were really in the way


@pytest.mark.slow
def test_without_ready_the_delayed_copy_is_visible(spill_dir):
    """The control: the same forward without the ready hooks runs into memory still in flight
    (unmapped: SIGSEGV; or not yet read back) — so the test above can fail."""
    r = run_child("none", spill_dir)
    ok_line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT True []")), None)
    assert r.returncode != 0 or ok_line is None, r.stdout


def test_guards_while_a_progressive_wake_is_in_flight(lc):
    m = make_model()
    lc.adopt(m)
    kv = lc.empty((1 << 16,), torch.uint8, tag="kv_cache")
    ref = [p.detach().clone() for p in m.parameters()]
    lc.sleep(1)
    go = threading.Event()
    lc.driver.hooks.restore = lambda va, n: go.wait(10)
    lc.wake_up(["weights"], progressive=True)
    try:
        assert lc.state() == {"weights": "waking", "kv_cache": "discarded"}
        for call in (lambda: lc.sleep(1), lambda: lc.sleep(2), lambda: lc.wake_up(["weights"]), lambda: lc.wake_up(),
                     lambda: lc.discard(["weights"]), lambda: lc.empty((4,), tag="weights"),
                     lambda: lc.wake_up(["weights"], progressive=True)):
            with pytest.raises(CopyInFlightError, match="wait()"):
                call()
        assert lc.state() == {"weights": "waking", "kv_cache": "discarded"}  # nothing changed
        lc.wake_up(["kv_cache"])  # another tag wakes while the weights are in flight
        assert not kv.any()
        with pytest.raises(CopyInFlightError):
            lc.sleep(1, tags=["weights"])
        lc.sleep(2, tags=["kv_cache"])  # and sleeps again: only the tags in flight are refused
        lc.wake_up(["kv_cache"])
    finally:
        go.set()
    lc.wait()
    assert lc.state() == {"weights": "awake", "kv_cache": "awake"}
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
    lc.sleep(1)  # allowed again
    lc.wake_up()
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))


def test_steps_are_taken_in_use_order_by_several_readers(lc):
    assert lc.driver.config.progressive_workers > 1 or os.cpu_count() == 1
    m = make_model()
    lc.adopt(m)
    ref = [p.detach().clone() for p in m.parameters()]
    lc.sleep(1)
    seen, mu = [], threading.Lock()

    def hook(va, n):
        with mu:
            seen.append(va)
        time.sleep(0.01)

    lc.driver.hooks.restore = hook
    lc.wake_up(["weights"], progressive=True, order=list(reversed(list(m))))
    lc.ready(m[11])
    assert torch.equal(m[11].weight, ref[11])
    lc.wait()
    want = [p.data_ptr() for p in m.parameters()][::-1]
    assert sorted(seen) == sorted(want)
    # taken in order: a step starts at most (readers - 1) places before its turn
    pos = {va: i for i, va in enumerate(seen)}
    assert all(abs(pos[va] - i) < lc.driver.config.progressive_workers for i, va in enumerate(want))
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))


def test_progressive_wake_of_a_corrupt_backup_exposes_nothing(lc):
    m = make_model()
    lc.adopt(m)
    lc.sleep(1)
    a = lc._state.all()[0]
    path = lc.backup_store.path((a.id, 0))
    with open(path, "r+b") as f:  # flip one byte of the 7th chunk
        f.seek(6 * CHUNK + 100)
        b = f.read(1)
        f.seek(6 * CHUNK + 100)
        f.write(bytes([b[0] ^ 1]))
    pw = lc.wake_up(["weights"], progressive=True)
    lc.ready(m[0])  # its chunk is sound
    with pytest.raises(BackupError):
        pw.ready(m[6])
    with pytest.raises(BackupCorruptError):
        lc.wait()
    assert lc.state() == {"weights": "offloaded"} and lc.resident_bytes("weights") == 0
    lc.discard(["weights"])  # the way out, as after a plain wake
    lc.wake_up(["weights"])
    assert not any(p.any() for p in m.parameters())


def test_background_sleep_frees_the_kv_cache_before_returning(lc):
    m = make_model()
    lc.adopt(m)
    kv = lc.empty((4 << 20,), torch.uint8, tag="kv_cache")
    kv.fill_(7)
    ref = [p.detach().clone() for p in m.parameters()]
    go = threading.Event()
    lc.driver.hooks.backup = lambda va, end: go.wait(10)
    rep = lc.sleep(1, background=True)
    try:
        assert rep.tags == ["kv_cache"] and rep.bytes_released >= 4 << 20
        assert lc.resident_bytes("kv_cache") == 0  # freed before sleep() returned
        assert lc.resident_bytes("weights") == LAYERS * CHUNK  # still being copied out
        with pytest.raises(CopyInFlightError):
            lc.wake_up(["weights"])  # reusing the region before its copy is done
        with pytest.raises(CopyInFlightError):
            lc.sleep(1)
        with pytest.raises(CopyInFlightError):
            lc.discard(["weights"])
    finally:
        go.set()
    done = lc.wait()
    assert done.operation == "sleep(level=1)" and done.bytes_copied == LAYERS * CHUNK
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}
    assert lc.resident_bytes() == 0
    lc.wake_up()
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref)) and not kv.any()


def test_failed_background_sleep_gives_the_weights_back(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, chunk_bytes=CHUNK, host_budget_bytes=CHUNK)
    try:
        m = make_model()
        lc.adopt(m)
        kv = lc.empty((1 << 16,), torch.uint8, tag="kv_cache")
        ref = [p.detach().clone() for p in m.parameters()]
        lc.sleep(1, background=True)  # the budget check runs behind the call
        with pytest.raises(HostBudgetError):
            lc.wait()
        assert lc.state() == {"weights": "awake", "kv_cache": "discarded"}
        assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
        del kv
    finally:
        lc.close()


def test_ready_is_a_no_op_without_a_wake_in_flight(lc):
    m = make_model()
    lc.adopt(m)
    lc.ready(m[3])
    hs = lc.install_ready_hooks(m)
    assert len(hs) == LAYERS
    with torch.no_grad():
        m(torch.randn(2, 128))
    for h in hs:
        h.remove()


def test_progressive_wake_of_discarded_and_preserved_memory(lc):
    m = make_model()
    lc.adopt(m)
    kv = lc.empty((3 * CHUNK,), torch.uint8, tag="kv_cache")
    kv.fill_(9)
    ref = [p.detach().clone() for p in m.parameters()]
    lc.preserve(["2.weight", "7.weight"])
    lc.sleep(2)
    lc.wake_up(["weights", "kv_cache"], progressive=True, order=[m[7]])
    lc.ready(m[7])
    assert torch.equal(m[7].weight, ref[7])
    lc.wait()
    for i, (p, r) in enumerate(zip(m.parameters(), ref)):
        assert torch.equal(p, r) if i in (2, 7) else not p.any(), i  # preserved exact, the rest zeroed
    assert not kv.any()


def test_order_must_name_modules_or_tensors(lc):
    m = make_model()
    lc.adopt(m)
    lc.sleep(1)
    with pytest.raises(ValueError, match="nn.Module"):
        lc.wake_up(["weights"], progressive=True, order=[42])
    assert lc.state() == {"weights": "offloaded"}  # nothing changed
    lc.wake_up(["weights"], progressive=True)
    lc.wait()


def test_a_hook_failing_in_a_background_sleep_changes_nothing(lc):
    m = make_model()
    lc.adopt(m)
    kv = lc.empty((1 << 16,), torch.uint8, tag="kv_cache")
    kv.fill_(4)
    woke = []

    def bad(level, tags):
        raise RuntimeError("collective teardown failed")

    lc.add_hooks(before_sleep=bad, after_wake=woke.append)
    with pytest.raises(BackupError, match="before anything was released"):
        lc.sleep(1, background=True)
    assert lc.state() == {"weights": "awake", "kv_cache": "awake"} and int(kv.sum()) == 4 << 16
    assert woke == [["kv_cache", "weights"]]  # the hooks' work was undone


def test_an_ended_wake_is_settled_by_the_next_call(lc):
    m = make_model()
    lc.adopt(m)
    lc.sleep(1)
    pw = lc.wake_up(["weights"], progressive=True)
    pw.wait_queued()  # host: every step restored
    t = lc.empty((16,), torch.float32, tag="weights")  # no wait(): the ended wake is settled here
    assert lc.state()["weights"] == "awake" and t.shape == (16,)
    assert lc.wait().operation == "wake_up(progressive)"
