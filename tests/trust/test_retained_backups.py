"""A backend that keeps backups after a wake (to skip unchanged weights, as CUDA does): the
stale backup's room counts for the new one, and "unchanged" is proven by the keyed digest.
Run on the host backend with retention switched on (real spill files, real memory)."""

from __future__ import annotations

from dataclasses import replace

import torch

from unisleep import MemoryLifecycle
from unisleep.backends.host import HostDriver

MiB = 1 << 20


class RetainingHostDriver(HostDriver):
    capabilities = replace(HostDriver.capabilities, retain_backups=True)


def test_changed_weights_reuse_the_room_of_their_stale_backup(tmp_path):
    n = 8 * MiB
    lc = MemoryLifecycle(RetainingHostDriver(), spill_dir=str(tmp_path), host_budget_bytes=n)
    w = lc.empty((n,), torch.uint8, tag="weights")
    w.fill_(7)
    assert lc.sleep(1).bytes_copied == n
    lc.wake_up()
    assert lc.backup_bytes() == n  # retained after the wake
    assert lc.sleep(1).bytes_copied == 0  # unchanged: proven, not copied
    lc.wake_up()
    w[12345] = 8  # one byte changed: the retained backup is stale
    rep = lc.sleep(1)  # needs the whole budget again: the stale backup's room is reused
    assert rep.bytes_copied == n
    lc.wake_up()
    assert w[12345].item() == 8 and w[0].item() == 7
    lc.close()


def test_cancelling_edits_are_never_taken_as_unchanged(tmp_path):
    lc = MemoryLifecycle(RetainingHostDriver(), spill_dir=str(tmp_path))
    w = lc.empty((1 << 20,), torch.int32, tag="weights")
    w.copy_(torch.arange(1 << 20, dtype=torch.int32))
    lc.sleep(1)
    lc.wake_up()
    w[100:103] += torch.tensor([1, -2, 1], dtype=torch.int32)  # fooled the former linear digest
    assert lc.sleep(1).bytes_copied == 4 << 20
    lc.wake_up()
    assert w[100:103].tolist() == [101, 99, 103]
    lc.close()
