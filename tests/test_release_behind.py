"""``MemoryLifecycle(release_behind=True)`` on the host backend (real memfd/mmap memory): a
sleep returns once its memory is unmapped, the handles are released on the driver's thread
after it, and nothing of unisleep runs ahead of those releases."""

import os
import threading
import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from unisleep import InvalidArgumentError, MemoryLifecycle  # noqa: E402
from unisleep.release_behind import ReleaseBehindError  # noqa: E402

from backends.host.driver import HostDriver  # noqa: E402

MiB = 1 << 20


def _lifecycle(**kw):
    drv = HostDriver()
    return MemoryLifecycle(drv, release_behind=True, **kw), drv


def _fill(lc):
    w = lc.empty((8 * MiB,), torch.uint8, tag="weights")
    w.copy_(torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    kv = lc.empty((16 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(7)
    return w, kv, w.clone()


@pytest.mark.slow
def test_sleep_returns_before_the_releases_and_a_wake_waits_for_them():
    lc, drv = _lifecycle()
    w, kv, ref = _fill(lc)
    gate, seen = threading.Event(), []

    def hold(handle):
        seen.append(threading.get_ident())
        assert gate.wait(10), "the test never opened the gate"

    drv.hooks.release = hold
    rep = lc.sleep(1)
    assert rep.bytes_released >= 24 * MiB  # reported as released: unmapped, no longer the lifecycle's
    time.sleep(0.05)
    assert drv._behind.pending and drv._behind.released_bytes == 0  # held by the gate: not released yet
    assert seen and seen[0] != threading.get_ident()  # on the driver's release thread

    woke = threading.Event()
    t = threading.Thread(target=lambda: (lc.wake_up(), woke.set()))
    t.start()
    assert not woke.wait(0.3), "wake_up created memory while releases behind the sleep were still queued"
    gate.set()
    t.join(10)
    assert woke.is_set()
    # the KV cache (discarded) went behind the return; the weights' chunks are released as
    # their writes end, under the copy (the host pipeline), as without release_behind
    assert drv._behind.released_bytes >= 16 * MiB and not drv._behind.pending
    assert torch.equal(w, ref) and int(kv.max()) == 0  # bytes exact; discarded memory comes back zeroed
    lc.close()


def test_resident_bytes_memory_info_and_wait_see_the_releases_done():
    lc, drv = _lifecycle()
    _fill(lc)
    gate = threading.Event()
    drv.hooks.release = lambda h: gate.wait(10)
    lc.sleep(2)
    for read in (lc.resident_bytes, drv.memory_info, lc.wait):
        threading.Timer(0.1, gate.set).start()
        t0 = time.perf_counter()
        read()
        assert time.perf_counter() - t0 >= 0.08, f"{read.__name__} returned before the queued releases ended"
        assert not drv._behind.pending
        gate.clear()
        lc.wake_up()
        lc.sleep(2)
    gate.set()
    assert lc.resident_bytes() == 0
    lc.close()


def test_a_release_that_fails_behind_the_return_is_raised_by_the_next_wake_and_changes_nothing():
    lc, drv = _lifecycle()
    w, kv, ref = _fill(lc)
    failures = []

    def fail_once(handle):
        if not failures:
            failures.append(handle)
            raise OSError("injected: the release of this handle failed")

    drv.hooks.release = fail_once
    lc.sleep(1)
    with pytest.raises(ReleaseBehindError, match="injected.*release_behind=False"):
        lc.wake_up()
    assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}  # still asleep, as before
    lc.wake_up()  # the error was raised once; the rest were released
    assert torch.equal(w, ref) and int(kv.max()) == 0
    drv.release(failures[0])  # the handle that failed is still held: give it back
    lc.close()


def test_default_releases_before_sleep_returns():
    drv = HostDriver()
    lc = MemoryLifecycle(drv)
    _fill(lc)
    drv.hooks.release = lambda h: pytest.fail("nothing is released behind the return by default")
    lc.sleep(1)
    assert drv._behind is None and lc.resident_bytes() == 0
    lc.close()


def test_release_behind_arguments_are_checked(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="release_behind must be"):
        MemoryLifecycle("host", release_behind="yes")
    monkeypatch.setenv("UNISLEEP_RELEASE_BEHIND", "on")
    with pytest.raises(InvalidArgumentError, match="UNISLEEP_RELEASE_BEHIND must be 0 or 1"):
        MemoryLifecycle("host")
    monkeypatch.setenv("UNISLEEP_RELEASE_BEHIND", "1")
    lc = MemoryLifecycle("host")
    assert lc.driver.config.release_behind
    lc.close()

    class NoBehind(HostDriver):
        capabilities = replace(HostDriver.capabilities, supports_release_behind=False)

    with pytest.raises(InvalidArgumentError, match="not supported by the host backend"):
        MemoryLifecycle(NoBehind(), release_behind=True)
    # set in the environment (for a whole fleet): a backend without it releases before returning
    lc = MemoryLifecycle(NoBehind())
    assert not lc.driver.config.release_behind
    lc.close()


def test_a_child_forked_while_releases_are_queued_does_not_wait_for_them():
    """fork() copies no release thread (and maybe a held lock): the child's settle returns at
    once instead of hanging; the parent's releases go on."""
    lc, drv = _lifecycle()
    _fill(lc)
    gate = threading.Event()
    drv.hooks.release = lambda h: gate.wait(10)
    lc.sleep(2)
    assert drv._behind.pending
    pid = os.fork()
    if pid == 0:  # the child: must not hang, must exit 0
        code = 1
        try:
            t0 = time.monotonic()
            drv.wait_releases()
            code = 0 if time.monotonic() - t0 < 2 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the forked child hung or failed in settle"
    gate.set()
    lc.wait()
    assert not drv._behind.pending and lc.resident_bytes() == 0
    lc.close()
