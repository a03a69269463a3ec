"""The benchmarks' checks as functions (no process): --transfer --sizes, the transfer's progress
lines, the host benchmark's verdicts (medians over the cycles, their range, a goal out of reach
here)."""

from __future__ import annotations

import time

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


def test_peak_memory_sees_a_touched_allocation_and_a_store():
    """The sampler the transfer benchmark runs on each side: 64 MiB touched inside the block shows
    as host memory above the baseline (gone again after it), a store's largest reading is kept."""
    import torch

    from unisleep.bench.peak_memory import PeakMemory, rss_bytes

    MiB = 2**20
    held = {"n": 0}
    with PeakMemory(stores=[lambda: held["n"]], every_s=0.001) as pm:
        x = torch.ones(64 * MiB, dtype=torch.uint8)
        held["n"] = 64 * MiB
        time.sleep(0.02)
        held["n"] = 0
        del x
    r = pm.result
    if rss_bytes() is None:
        pytest.skip("no /proc here: the host figures are not measured")
    assert r["host_extra_bytes"] >= 60 * MiB, r
    assert r["store_peak_bytes"] == 64 * MiB and r["device_extra_bytes"] is None and r["samples"] >= 2
    with PeakMemory() as pm:  # nothing in the block: nothing above the baseline (a few pages of noise)
        pass
    assert pm.result["host_extra_bytes"] < 8 * MiB and pm.result["store_peak_bytes"] is None


def test_transfer_memory_table_says_whether_memory_is_flat():
    from unisleep.bench.transfer import GiB, MiB, memory_growth, memory_rows, per_tensor_result

    def entry(size, rx_host):
        mem = {"host_extra_bytes": 128 * MiB, "store_peak_bytes": 128 * MiB, "device_extra_bytes": None}
        return {"path": "host-socket", "kind": "size", "bytes": size, "bucket_bytes": 64 * MiB,
                "sender_memory": mem, "receiver_memory": {**mem, "host_extra_bytes": rx_host}}

    flat = [entry(GiB // 4, 128 * MiB), entry(2 * GiB, 150 * MiB)]
    assert memory_growth(flat)[("receiver_memory", "host_extra_bytes")] == 22 * MiB
    rows = memory_rows(flat)
    assert rows[0][2:8] == ["128", "128", "-", "128", "128", "-"] and rows[0][8] == ""
    assert "flat within one bucket (64 MiB) from 0.25 GiB: yes" in rows[1][8]
    staged = [entry(GiB // 4, 320 * MiB), entry(2 * GiB, 2112 * MiB)]
    assert "flat within one bucket (64 MiB) from 0.25 GiB: no; most growth +1792 MiB (receiver host)" in memory_rows(staged)[1][8]
    assert memory_growth(flat[:1]) == {}  # one size: nothing to compare

    pt = per_tensor_result({"many": {"tensors": 2000, "bytes": 2000 * 4096, "seconds": 0.5},
                            "few": {"tensors": 1, "bytes": 2000 * 4096, "seconds": 0.1}}, {})
    assert pt["per_tensor_s"] == pytest.approx(0.4 / 1999) and pt["tensor_bytes"] == 4096
