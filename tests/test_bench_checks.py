"""The benchmarks' checks as functions (no process): --transfer --sizes, the transfer's progress
lines, the host benchmark's verdicts (medians over the cycles, their range, a goal out of reach
here)."""

from __future__ import annotations

import pytest


def test_transfer_sizes():
    from unisleep.bench.transfer import GiB, MiB, parse_sizes

    chunk = 256 * MiB
    assert parse_sizes("1,8", chunk) == [GiB, 8 * GiB]
    assert parse_sizes("0.6", chunk) == [2 * chunk]  # whole tensors (the header prints what runs)
    for bad, why in (("0", "positive"), ("-1", "positive"), ("inf", "positive"), ("0.0625", "smaller than one tensor"),
                     ("a", "GiB numbers"), (",", "names no size")):
        with pytest.raises(ValueError, match=why):
            parse_sizes(bad, chunk)


def test_transfer_progress_lines(monkeypatch, capsys):
    import time

    import torch

    from unisleep.bench import transfer

    monkeypatch.setattr(transfer, "PROGRESS_EVERY_S", 0.05)
    t = torch.zeros(1024, dtype=torch.uint8)

    def slow():
        for i in range(6):
            time.sleep(0.03)
            yield f"w{i}", t

    assert [n for n, _ in transfer._with_progress(slow(), 6 * 1024, "gloo: warm-up")] == [f"w{i}" for i in range(6)]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "gloo: warm-up" in ln]
    assert lines and all(" of 0.0 GiB after " in ln and "s left" in ln for ln in lines), lines


def _samples(n=5, **over):
    base = {"sleep1": 1.0, "write": 0.9, "wake1": 0.5, "read": 0.5, "memcpy": 0.1, "sleep2": 0.04,
            "kernel_release": 0.038, "wake2": 0.06, "kernel_create": 0.058}
    base.update(over)
    return {k: (list(v) if isinstance(v, (list, tuple)) else [v] * n) for k, v in base.items()}


def test_host_verdicts_from_medians_and_ranges():
    from unisleep.bench.host import judge, missed_goals

    rows = {r["operation"]: r for r in judge(1 << 30, _samples(write=[0.5, 0.9, 0.95, 2.0, 0.92]))}
    s1 = rows["level-1 sleep (backup + free)"]
    assert s1["ratio"] == pytest.approx(0.92) and s1["ratio_range"] == [pytest.approx(0.5), pytest.approx(2.0)]
    assert s1["met"] is True  # the median, not one cycle, decides
    l2 = rows["level-2 sleep (free only)"]
    assert l2["met"] is None and "the kernel alone takes 38.0 ms" in l2["unreachable"]
    assert "level-2 sleep (free only)" not in missed_goals({"rows": list(rows.values())})
    # where the kernel is fast enough, missing the goal is a miss
    rows = {r["operation"]: r for r in judge(1 << 30, _samples(kernel_release=0.002))}
    assert rows["level-2 sleep (free only)"]["met"] is False and "unreachable" not in rows["level-2 sleep (free only)"]
    assert missed_goals({"rows": list(rows.values())}) == ["level-2 sleep (free only)"]
    rows = {r["operation"]: r for r in judge(1 << 30, _samples(kernel_release=0.002, sleep2=0.003))}
    assert rows["level-2 sleep (free only)"]["met"] is True
