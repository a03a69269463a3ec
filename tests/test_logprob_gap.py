"""The logprob-gap monitor on synthetic runs: a healthy run raises nothing; a growing gap, a
processed-logprobs offset, NaN logprobs and a large steady gap are each detected with a message
that says what to change."""

from __future__ import annotations

import math
import random

import pytest

from unisleep.errors import InvalidArgumentError
from unisleep.logprob_gap import (
    GROWING,
    LARGE,
    NON_FINITE,
    PROCESSED,
    LogprobGapMonitor,
    kendall_tau,
    theil_sen_slope,
)

N_TOK = 256


def _trainer_lps(rng):
    return [math.log(rng.uniform(0.02, 0.95)) for _ in range(N_TOK)]


def _kept(rng, top_p=0.9):
    # top-p keeps at least top_p of the mass and rarely much more
    return [min(1.0, top_p + abs(rng.gauss(0, 0.03))) for _ in range(N_TOK)]


def _noise(rng, scale=0.007):
    # kernel noise: median |gap| ~ 0.005, symmetric
    return [rng.gauss(0, scale) for _ in range(N_TOK)]


def _kinds(mon):
    return [f.kind for f in mon.findings]


def test_healthy_raw_run_raises_nothing():
    rng = random.Random(0)
    mon = LogprobGapMonitor()
    for step in range(20):
        tr = _trainer_lps(rng)
        eng = [t + n for t, n in zip(tr, _noise(rng))]
        s = mon.observe(eng, tr, top_p=0.9, kept_mass=_kept(rng), step=step)
        assert 0.002 < s.median_abs_gap < 0.01
        assert s.findings == []
    assert mon.ok and mon.findings == []


def test_healthy_run_with_drifting_policy_raises_nothing():
    # the policy changes every step (logprobs shift), the gap stays kernel noise
    rng = random.Random(1)
    mon = LogprobGapMonitor()
    for step in range(15):
        tr = [x - 0.05 * step for x in _trainer_lps(rng)]
        eng = [t + n for t, n in zip(tr, _noise(rng))]
        mon.observe(eng, tr, top_p=1.0)
    assert mon.ok, [str(f) for f in mon.findings]


def test_growing_gap_means_weights_did_not_arrive():
    rng = random.Random(2)
    mon = LogprobGapMonitor()
    first = None
    for step in range(10):
        tr = _trainer_lps(rng)
        drift = 0.01 * step  # the trainer moves away from the stale engine
        eng = [t + n + rng.choice((-1, 1)) * drift * rng.uniform(0.5, 1.5) for t, n in zip(tr, _noise(rng))]
        s = mon.observe(eng, tr, step=step)
        if s.findings and first is None:
            first = step
    assert _kinds(mon) == [GROWING]
    assert first is not None and first <= 6
    msg = mon.findings[0].message
    assert "not reaching the engine" in msg and "finish_weight_update" in msg


def test_one_outlier_step_is_not_a_trend():
    rng = random.Random(3)
    mon = LogprobGapMonitor()
    for step in range(12):
        tr = _trainer_lps(rng)
        scale = 0.2 if step == 8 else 0.007
        mon.observe([t + n for t, n in zip(tr, _noise(rng, scale))], tr)
    assert GROWING not in _kinds(mon)


def test_processed_logprobs_offset_with_kept_mass():
    rng = random.Random(4)
    mon = LogprobGapMonitor()
    for step in range(5):
        tr = _trainer_lps(rng)
        kept = _kept(rng)
        # processed logprobs: renormalised over the kept set -> + (−log kept)
        eng = [t - math.log(k) + n for t, k, n in zip(tr, kept, _noise(rng, 0.002))]
        s = mon.observe(eng, tr, top_p=0.9, kept_mass=kept, step=step)
        assert 0.03 < s.median_gap < 0.11
        assert s.expected_offset == pytest.approx(s.median_gap, abs=0.01)
    assert _kinds(mon) == [PROCESSED]  # reported once, not every step
    msg = mon.findings[0].message
    assert "--logprobs-mode raw_logprobs" in msg and "same top-p" in msg


def test_processed_logprobs_offset_from_top_p_alone():
    rng = random.Random(5)
    mon = LogprobGapMonitor()
    tr = _trainer_lps(rng)
    eng = [t - math.log(k) for t, k in zip(tr, _kept(rng))]
    s = mon.observe(eng, tr, top_p=0.9)
    assert [f.kind for f in s.findings] == [PROCESSED]


def test_offset_larger_than_top_p_explains_is_not_called_processed():
    rng = random.Random(6)
    mon = LogprobGapMonitor()
    for _ in range(3):
        tr = _trainer_lps(rng)
        mon.observe([t + 0.5 + n for t, n in zip(tr, _noise(rng))], tr, top_p=0.9)
    assert PROCESSED not in _kinds(mon)
    assert LARGE in _kinds(mon)
    assert "checkpoint" in next(f for f in mon.findings if f.kind == LARGE).message


def test_offset_without_top_p_is_not_claimed():
    rng = random.Random(7)
    mon = LogprobGapMonitor()
    tr = _trainer_lps(rng)
    mon.observe([t + 0.05 for t in tr], tr, top_p=1.0)
    assert mon.ok


def test_nan_engine_logprobs_point_at_kv_scales():
    rng = random.Random(8)
    mon = LogprobGapMonitor()
    tr = _trainer_lps(rng)
    eng = [t + n for t, n in zip(tr, _noise(rng))]
    eng[0] = float("nan")
    s = mon.observe(eng, tr)
    assert [f.kind for f in s.findings] == [NON_FINITE]
    assert s.non_finite == 1 and s.n_tokens == N_TOK - 1
    assert "KV scales" in s.findings[0].message and "0.32" in s.findings[0].message


def test_accepts_nested_lists_and_tensors_and_rejects_mismatch():
    torch = pytest.importorskip("torch")
    mon = LogprobGapMonitor()
    s = mon.observe(torch.zeros(4, 3), [[0.0] * 3] * 4)
    assert s.n_tokens == 12 and s.median_abs_gap == 0.0
    with pytest.raises(InvalidArgumentError):
        mon.observe([0.0, 1.0], [0.0])
    with pytest.raises(InvalidArgumentError):
        mon.observe([0.0], [0.0], kept_mass=[0.9, 0.9])


def test_robust_statistics():
    assert theil_sen_slope([0, 1, 2, 3, 100]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4]) == 1.0
    assert kendall_tau([4, 3, 2, 1]) == -1.0
