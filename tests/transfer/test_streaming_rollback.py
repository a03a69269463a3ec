"""A streaming update that fails part-way stays all or nothing without a second copy: rolled back
byte-exact from a retained level-1 backup (host backend, real memfd and spill files), or marked
torn where none exists until a complete update arrives; and the coverage check with preserved
names.  Sender and receiver on two threads (real gloo over 127.0.0.1)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.errors import IncompleteUpdateError, TornWeightsError, TransferError
from unisleep.transfer import WeightReceiver, WeightSender

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import FaultySender  # noqa: E402
from test_transfer_units import _both, _pair  # noqa: E402


def _w(v):
    g = torch.Generator().manual_seed(v)
    return {f"l{i}": torch.randn(64, 64, generator=g) for i in range(6)}


@pytest.fixture(scope="module")
def pair():
    g0, g1 = _pair()
    yield g0, g1
    g0.close(), g1.close()


def _engine(tmp_path, retain):
    lc = MemoryLifecycle("host", retain_backups=retain, spill_dir=str(tmp_path))
    model = torch.nn.Module()
    for k, t in _w(1).items():
        model.register_parameter(k, torch.nn.Parameter(t.clone(), requires_grad=False))
    lc.adopt(model, tag="weights")
    return lc, model


@pytest.mark.parametrize("retain", [True, False])
def test_corrupt_bucket_part_way_rolls_back_or_tears(pair, tmp_path, retain):
    g0, g1 = pair
    lc, model = _engine(tmp_path, retain)
    lc.sleep(1)
    lc.wake_up()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    rx = WeightReceiver(g1, target=model, guard=lc, initial_version=1)
    tx = FaultySender(g0, bucket_bytes=40000, path="collective", corrupt={2})  # buckets 0 and 1 are applied first
    s, r = _both(lambda: tx.send(_w(2), 2), rx.receive)
    tx.corrupt = set()
    assert isinstance(r, TransferError) and rx.version == 1
    if retain:
        assert r.outcome == "rolled_back" and "rolled back" in str(r)
        assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
        rx.check_serving(), lc.check_serving()
    else:
        assert r.outcome == "torn" and "torn" in str(r)
        assert not all(torch.equal(p, before[k]) for k, p in model.named_parameters())
        for check in (rx.check_serving, lc.check_serving):
            with pytest.raises(TornWeightsError) as ei:
                check()
            assert ei.value.version == 2 and ei.value.previous == 1 and ei.value.names
    s, r = _both(lambda: tx.send(_w(3), 3), rx.receive)
    assert not isinstance(r, Exception), r
    rx.check_serving(), lc.check_serving()
    assert all(torch.equal(p, _w(3)[k]) for k, p in model.named_parameters())
    lc.close()


def test_apply_running_out_of_memory_on_the_third_bucket_rolls_back(pair, tmp_path):
    g0, g1 = pair
    lc, model = _engine(tmp_path, True)
    lc.sleep(1)
    lc.wake_up()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    params = dict(model.named_parameters())
    calls = []

    def apply(pairs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("no room for the bucket")
        with torch.no_grad():
            for n, t in pairs:
                params[n].copy_(t)

    rx = WeightReceiver(g1, apply=apply, guard=lc, initial_version=1)
    tx = WeightSender(g0, bucket_bytes=40000, path="collective")
    s, r = _both(lambda: tx.send(_w(2), 2), rx.receive)
    assert isinstance(r, TransferError) and r.outcome == "rolled_back", r
    assert "OutOfMemoryError" in str(r)
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    lc.close()


def test_coverage_accepts_exactly_the_preserved_names_and_refuses_others(pair, tmp_path):
    g0, g1 = pair
    lc, model = _engine(tmp_path, False)
    lc.preserve(["l5"])
    rx = WeightReceiver(g1, target=model, guard=lc, initial_version=1, require_complete=True)
    tx = WeightSender(g0, path="collective")
    upd = {k: v for k, v in _w(2).items() if k != "l5"}
    s, r = _both(lambda: tx.send(upd, 2), rx.receive)
    assert not isinstance(r, Exception), r
    assert r.omitted == ["l5"]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    upd = {k: v for k, v in _w(3).items() if k not in ("l5", "l0")}
    s, r = _both(lambda: tx.send(upd, 3), rx.receive)
    assert isinstance(r, IncompleteUpdateError) and r.missing == ["l0"] and r.outcome == "untouched"
    assert "before any byte moved" in str(r) and rx.version == 2
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    lc.close()


def test_a_written_update_drops_the_stale_retained_backup(pair, tmp_path):
    """After an update wrote the weights, their retained backup holds older bytes: it is dropped,
    so the next update's restore point (and the next sleep's unchanged check) need no digest
    pass to learn it; a later level-1 sleep backs the new bytes up and rolls back to them."""
    g0, g1 = pair
    lc, model = _engine(tmp_path, True)
    lc.sleep(1)
    lc.wake_up()
    p = next(iter(model.parameters()))
    probe = torch.empty(p.numel() * p.element_size(), dtype=torch.uint8)
    assert lc.read_backup(p.data_ptr(), probe) and lc.restore_point() is not None
    rx = WeightReceiver(g1, target=model, guard=lc, initial_version=1)
    tx = FaultySender(g0, bucket_bytes=40000, path="collective")
    s, r = _both(lambda: tx.send(_w(2), 2), rx.receive)
    assert not isinstance(r, Exception), r
    assert not lc.read_backup(p.data_ptr(), probe) and lc.restore_point() is None
    lc.sleep(1)
    lc.wake_up()
    assert lc.restore_point() is not None
    tx.corrupt = {2}
    s, r = _both(lambda: tx.send(_w(3), 3), rx.receive)
    tx.corrupt = set()
    assert isinstance(r, TransferError) and r.outcome == "rolled_back"
    assert all(torch.equal(q, _w(2)[k]) for k, q in model.named_parameters())
    lc.close()


def test_a_new_receiver_s_complete_update_clears_its_guard_s_torn_mark(pair, tmp_path):
    """After a sender dies its group goes with it, so the next update comes to a new receiver
    guarded by the same lifecycle: its complete update makes the weights whole, and the torn mark
    the lifecycle carries goes (the new receiver never was torn itself)."""
    g0, g1 = pair
    lc, model = _engine(tmp_path, False)
    lc.sleep(1)
    lc.wake_up()
    rx = WeightReceiver(g1, target=model, guard=lc, initial_version=1)
    tx = FaultySender(g0, bucket_bytes=40000, path="collective", corrupt={2})
    s, r = _both(lambda: tx.send(_w(2), 2), rx.receive)
    tx.corrupt = set()
    assert isinstance(r, TransferError) and r.outcome == "torn"
    with pytest.raises(TornWeightsError):
        lc.check_serving()
    rx2 = WeightReceiver(g1, target=model, guard=lc, initial_version=1)
    assert rx2.torn is None
    s, r = _both(lambda: tx.send(_w(3), 3), rx2.receive)
    assert not isinstance(r, Exception), r
    lc.check_serving(), rx2.check_serving()
    assert all(torch.equal(p, _w(3)[k]) for k, p in model.named_parameters())
    lc.close()
