"""Progressive wake and background sleep on a real GPU (marker ``cuda``; CPU CI skips these).

Copies are delayed on the device itself: the driver's ``hooks.restore`` runs on the copy stream
before each step, and ``torch.cuda._sleep`` there holds that step's copy back for ~10 ms, so a
layer whose kernels did not wait for its bytes reads memory still in flight."""

import time

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")

from unisleep import CopyInFlightError, MemoryLifecycle  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
LAYERS = 8
SPIN = 20_000_000  # GPU clock cycles (~10 ms on an H200) before each step's copy


class Layer(torch.nn.Module):
    def __init__(self, rows=4096, cols=8192):  # 64 MiB of bf16: one progressive step each
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02,
                                         requires_grad=False)

    def forward(self, x):
        y = x @ self.weight.t()  # 4096 features, doubled back to 8192
        return torch.tanh(torch.cat([y, y], 1))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Layer() for _ in range(LAYERS)])


def test_bytes_exact_in_adoption_and_given_order(lc):
    m = model()
    lc.adopt(m)
    ref = [p.detach().clone() for p in m.parameters()]
    ptrs = [p.data_ptr() for p in m.parameters()]
    for order in (None, list(reversed(list(m)))):
        with torch.no_grad():
            for p in m.parameters():
                p.view(-1)[:16].mul_(-1)  # changed: the copy runs
        ref = [p.detach().clone() for p in m.parameters()]
        lc.sleep(1)
        seen = []
        lc.driver.hooks.restore = lambda va, n: seen.append(va)
        pw = lc.wake_up(["weights"], progressive=True, order=order)
        assert lc.state()["weights"] in ("waking", "awake")
        rep = lc.wait()
        lc.driver.hooks.restore = None
        assert rep.bytes_copied == LAYERS * 64 * MiB and len(pw.steps) == LAYERS
        want = [p.data_ptr() for p in m.parameters()]
        assert seen == (want if order is None else want[::-1])
        assert [p.data_ptr() for p in m.parameters()] == ptrs
        assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
        assert lc.state() == {"weights": "awake"}


def _checked_forward(m, ref, x):
    """Forward with a pre-hook per layer that compares, on the stream, the layer's weight with
    the reference at the moment its kernels run (after any ready hook)."""
    flags = []
    hs = [layer.register_forward_pre_hook(lambda mod, a, i=i: flags.append((mod.weight == ref[i]).all()))
          for i, layer in enumerate(m)]
    with torch.no_grad():
        y = m(x)
    for h in hs:
        h.remove()
    return y, flags


def test_a_layer_never_runs_on_a_step_in_flight(lc):
    m = model()
    lc.adopt(m)
    x = torch.randn(8, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref_out = m(x)
    ref = [p.detach().clone() for p in m.parameters()]
    ready_hooks = lc.install_ready_hooks(m)
    lc.sleep(1)
    lc.driver.hooks.restore = lambda va, n: torch.cuda._sleep(SPIN)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pw = lc.wake_up(["weights"], progressive=True)
    y, flags = _checked_forward(m, ref, x)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert all(bool(f) for f in flags), [bool(f) for f in flags]
    assert torch.equal(y, ref_out)
    assert pw.done  # the forward could only finish after every copy
    lc.wait()
    assert took > LAYERS * 0.004  # the delays were really in the way

    # the control: the same wake, forward queued without the ready hooks once every step is
    # mapped and queued -> its kernels run ahead of the delayed copies
    for h in ready_hooks:
        h.remove()
    lc.sleep(1)
    pw = lc.wake_up(["weights"], progressive=True)
    pw.wait_queued()
    with torch.no_grad():
        m(x)
    lc.driver.fence_sync(lc.driver.fence())  # the forward is done ...
    assert not pw.done  # ... while the copies are still in flight
    lc.wait()
    lc.driver.hooks.restore = None
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))


def test_guards_while_copies_are_in_flight(lc):
    m = model()
    lc.adopt(m)
    kv = lc.empty((256 * MiB,), torch.uint8, tag="kv_cache")
    kv.fill_(3)
    ref = [p.detach().clone() for p in m.parameters()]
    lc.sleep(1)
    lc.driver.hooks.restore = lambda va, n: torch.cuda._sleep(SPIN * 2)
    pw = lc.wake_up(["weights"], progressive=True)
    pw.wait_queued()
    assert not pw.done
    for call in (lambda: lc.sleep(1), lambda: lc.wake_up(["weights"]), lambda: lc.wake_up(),
                 lambda: lc.discard(["weights"]), lambda: lc.empty((4,), tag="weights")):
        with pytest.raises(CopyInFlightError):
            call()
    lc.wake_up(["kv_cache"])  # another tag wakes meanwhile
    lc.wait()
    lc.driver.hooks.restore = None
    assert lc.state() == {"weights": "awake", "kv_cache": "awake"}
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref)) and int(kv.count_nonzero()) == 0


def test_background_sleep_frees_the_kv_cache_at_once():
    lc = MemoryLifecycle("cuda")  # a cold arena: the copies take a while behind the call
    try:
        torch.manual_seed(1)
        m = torch.nn.Sequential(*[Layer() for _ in range(32)])  # 2 GiB
        lc.adopt(m)
        kv = lc.empty((4 * GiB,), torch.uint8, tag="kv_cache")
        kv.fill_(5)
        ref = [p.detach().clone() for p in m.parameters()]
        torch.cuda.synchronize()
        free0 = lc.driver.memory_info()[0]
        rep = lc.sleep(1, background=True)
        freed = lc.driver.memory_info()[0] - free0
        assert rep.tags == ["kv_cache"] and freed >= 4 * GiB - 256 * MiB  # the worker may cache a little
        assert lc.resident_bytes("kv_cache") == 0
        with pytest.raises(CopyInFlightError):
            lc.wake_up(["weights"])  # its region is still being copied out
        done = lc.wait()
        assert done.bytes_copied == 2 * GiB
        assert lc.state() == {"weights": "offloaded", "kv_cache": "discarded"} and lc.resident_bytes() == 0
        pw = lc.wake_up(["weights"], progressive=True)
        lc.wake_up(["kv_cache"])
        pw.wait()
        assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref)) and int(kv.count_nonzero()) == 0
        del kv
    finally:
        lc.close()
