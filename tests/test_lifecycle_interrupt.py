"""Ctrl-C (KeyboardInterrupt) or SystemExit in the middle of a sleep: undone like any failure,
and raised as itself — not turned into a BackupError."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # (the host lifecycle's first start runs a helper process)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_during_a_sleep_is_undone_and_stays_ctrl_c(lifecycle, exc):
    """Before: a Ctrl-C (or the SystemExit of a SIGTERM) in the middle of a sleep came out as
    BackupError, so the command line printed a traceback and exit 1 instead of 130 (143)."""
    import torch

    w = lifecycle.empty((1 << 20,), torch.uint8, tag="weights")
    w.fill_(7)

    def interrupted(level, tags):
        raise exc()

    lifecycle.add_hooks(before_sleep=interrupted)
    with pytest.raises(exc):
        lifecycle.sleep(1)
    assert lifecycle.state() == {"weights": "awake"} and int(w[0]) == 7 and int(w.sum()) == 7 << 20
