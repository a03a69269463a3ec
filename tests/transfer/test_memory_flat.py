"""A weight update's extra memory does not grow with the model: two real processes on the host
paths (a Unix socket, a memfd shared over one) move a 256 MiB and a 2 GiB update, and each side's
peak memory above its level before the update — resident memory and its bucket buffers
(``buffer_bytes()``) — is the same within one bucket for both sizes.

The measurement is the benchmark's (``unisleep bench --transfer``: the same two processes, the
same sender generator reusing one source tensor under many names so the sender's data does not
grow with the model, the same sampler).  A receiver that stages the whole update
(``staged=True``) is asserted to grow by most of the difference between the sizes: the test can
tell the two apart.  The receiver's default is asserted flat (streaming is the default).
"""

from __future__ import annotations

import pytest

from unisleep.bench.transfer import GiB, MiB, _spawn

pytestmark = pytest.mark.slow  # every test here starts two processes

BUCKET = 64 * MiB
SMALL, LARGE = 256 * MiB, 2 * GiB
#: staged=False: streaming asked for; None: the receiver's default; True: the whole update staged
MODES = {"streaming": False, "default": None, "staged": True}
_runs: dict = {}


def _run(path: str, mode: str) -> dict:
    """Both sides' results of one pair of processes moving SMALL then LARGE (each update once,
    no warm-up: memory is measured, not time), cached per (path, mode)."""
    key = (path, mode)
    if key not in _runs:
        job = {"path": path, "platform": "host", "devices": [0, 0], "sizes": [SMALL, LARGE], "chunk_bytes": 64 * MiB,
               "bucket_bytes": BUCKET, "repeat": 1, "warm_up": False, "verify": True, "keep_buffers": False,
               "staged": MODES[mode], "tensors": 0, "tensor_bytes": 0, "allreduce_bytes": 0}
        out = _spawn(job, timeout=240)
        err = next((o["error"] for o in out.values() if "error" in o), None)
        assert err is None and len(out) == 2, err or f"a process did not answer: {out}"
        _runs[key] = out
    return _runs[key]


def _figures(out: dict) -> dict:
    """{(side, figure): (small, large)} in bytes, for the host figures of both sides."""
    tx, rx = out[0]["results"], out[1]["results"]
    assert [r["bytes"] for r in tx] == [SMALL, LARGE] and [r["bytes"] for r in rx] == [SMALL, LARGE]
    figs = {}
    for side, rs, mem in (("sender", tx, "sender_memory"), ("receiver", rx, "receiver_memory")):
        for fig in ("host_extra_bytes", "store_peak_bytes"):
            small, large = rs[0][mem][fig], rs[1][mem][fig]
            assert small is not None and large is not None, f"{side} {fig} not measured: {rs}"
            figs[(side, fig)] = (small, large)
        assert rs[1][mem]["samples"] > 3 or rs[1][mem]["hwm_reset"], rs[1][mem]
    return figs


def _show(figs: dict) -> str:
    return "; ".join(f"{side} {fig}: {a / MiB:.0f} -> {b / MiB:.0f} MiB" for (side, fig), (a, b) in figs.items())


@pytest.mark.parametrize("path", ["host-socket", "host-ipc"])
@pytest.mark.parametrize("mode", ["streaming", "default"])
def test_each_side_holds_the_same_memory_for_256_mib_and_2_gib(path, mode):
    out = _run(path, mode)
    if mode == "streaming":
        assert out[1]["staged"] is False
    figs = _figures(out)
    for (side, fig), (small, large) in figs.items():
        assert abs(large - small) <= BUCKET, (
            f"{path}, receiver {mode}: {side} {fig} grew from {small / MiB:.0f} to {large / MiB:.0f} MiB between a "
            f"{SMALL / MiB:.0f} MiB and a {LARGE / MiB:.0f} MiB update (more than one {BUCKET / MiB:.0f} MiB bucket); "
            f"{_show(figs)}")
        assert large <= 3 * BUCKET + 32 * MiB, (
            f"{path}, receiver {mode}: {side} {fig} peaked at {large / MiB:.0f} MiB above its level for a 2 GiB update, "
            f"more than a few {BUCKET / MiB:.0f} MiB buckets; {_show(figs)}")


@pytest.mark.parametrize("path", ["host-socket", "host-ipc"])
def test_a_staged_receiver_grows_with_the_model_and_the_sender_does_not(path):
    out = _run(path, "staged")
    assert out[1]["staged"] is True
    figs = _figures(out)
    small, large = figs[("receiver", "host_extra_bytes")]
    assert large - small >= (LARGE - SMALL) * 3 // 4, (
        f"{path}: a staged receiver held {small / MiB:.0f} MiB for {SMALL / MiB:.0f} MiB and {large / MiB:.0f} MiB "
        f"for {LARGE / MiB:.0f} MiB: the measurement does not see the staged update; {_show(figs)}")
    for fig in ("host_extra_bytes", "store_peak_bytes"):
        a, b = figs[("sender", fig)]
        assert abs(b - a) <= BUCKET, f"{path}: the sender's {fig} grew with a staged receiver; {_show(figs)}"
