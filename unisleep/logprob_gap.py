"""Watch the gap between the engine's logprobs and the trainer's, step after step.

The trainer scores the tokens the engine sampled and compares its logprobs with the ones the
engine returned.  They never match exactly (different kernels), so a *small steady* gap is
normal — about 0.005 median absolute with raw logprobs at top-p 0.9 in the reference run.  What
matters is the shape of the gap over steps:

``growing``
    the median gap rises step after step (robust slope + rank test over a window): the new
    weights are not reaching the engine, which keeps sampling from an old policy.
``processed_logprobs``
    a constant positive offset ≈ −log(kept mass): the engine returned logprobs *after* top-p
    (renormalised over the kept tokens) while the trainer scored the full vocabulary.  In the
    reference run this was a median shift of about 0.053 at top-p 0.9.
``non_finite``
    NaN/inf logprobs from the engine (e.g. calibrated FP8 KV scales cleared by a level-2 sleep).
``large_gap``
    a steady gap far above what kernels explain (wrong checkpoint, dtype or quantisation).

Each finding carries a message that says what to change.  Feed the monitor once per step::

    mon = LogprobGapMonitor()
    step = mon.observe(engine_lps, trainer_lps, top_p=0.9)
    for f in step.findings:
        print(f.message)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .errors import InvalidArgumentError

GROWING = "growing"
PROCESSED = "processed_logprobs"
NON_FINITE = "non_finite"
LARGE = "large_gap"
KINDS = (GROWING, PROCESSED, NON_FINITE, LARGE)


@dataclass
class GapFinding:
    kind: str
    step: int
    message: str
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"[step {self.step}] {self.kind}: {self.message}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "message": self.message, "details": dict(self.details)}


@dataclass
class GapStep:
    """The gap statistics of one step (engine − trainer, per token)."""

    step: int
    n_tokens: int
    median_abs_gap: float
    median_gap: float  # signed: engine − trainer
    max_abs_gap: float
    positive_fraction: float
    non_finite: int
    expected_offset: Optional[float] = None  # median −log(kept mass), when known
    version: Optional[str] = None
    findings: list[GapFinding] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "step", "n_tokens", "median_abs_gap", "median_gap", "max_abs_gap", "positive_fraction",
            "non_finite", "expected_offset", "version")}
        d["findings"] = [f.as_dict() for f in self.findings]
        return d


# ---------------------------------------------------------------------- small statistics
def _flatten(x: Any) -> list[float]:
    if x is None:
        return []
    if hasattr(x, "detach"):  # torch tensor
        return [float(v) for v in x.detach().reshape(-1).cpu().tolist()]
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):  # numpy
        return _flatten(x.tolist())
    if isinstance(x, (int, float)):
        return [float(x)]
    out: list[float] = []
    for v in x:
        out.extend(_flatten(v) if not isinstance(v, (int, float)) else [float(v)])
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def theil_sen_slope(ys: Sequence[float]) -> float:
    """Median of the pairwise slopes: a line fit that one outlier step cannot move."""
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return _median(slopes) if slopes else 0.0


def kendall_tau(ys: Sequence[float]) -> float:
    """Mann–Kendall trend statistic in [-1, 1]: +1 when every later step is higher."""
    n = len(ys)
    pairs = n * (n - 1) // 2
    if pairs == 0:
        return 0.0
    s = sum((ys[j] > ys[i]) - (ys[j] < ys[i]) for i in range(n) for j in range(i + 1, n))
    return s / pairs


# ---------------------------------------------------------------------- the monitor
class LogprobGapMonitor:
    """Per-step logprob-gap statistics and the findings drawn from them.

    Parameters
    ----------
    window:
        steps the trend test looks back over.
    min_steps:
        steps needed before the trend test speaks.
    min_growth:
        smallest rise of the median gap over the window (fitted slope × span) that counts as
        growth; below it, a trend is kernel noise.
    min_tau:
        how consistently the gap must rise (Mann–Kendall tau).
    large_gap:
        a median absolute gap above this, for ``large_steps`` steps in a row and not explained
        by a processed-logprobs offset, is reported as ``large_gap``.
    min_offset:
        smallest median signed gap that can be a processed-logprobs offset.
    """

    def __init__(
        self,
        *,
        window: int = 6,
        min_steps: int = 4,
        min_growth: float = 0.02,
        min_tau: float = 0.6,
        large_gap: float = 0.1,
        large_steps: int = 2,
        min_offset: float = 0.01,
        min_tokens: int = 8,
    ):
        if window < 3 or min_steps < 3 or min_steps > window:
            raise InvalidArgumentError("need 3 <= min_steps <= window")
        self.window, self.min_steps = window, min_steps
        self.min_growth, self.min_tau = min_growth, min_tau
        self.large_gap, self.large_steps = large_gap, large_steps
        self.min_offset, self.min_tokens = min_offset, min_tokens
        self.history: list[GapStep] = []
        self.findings: list[GapFinding] = []
        self._active: set[str] = set()

    @property
    def ok(self) -> bool:
        return not self.findings

    def medians(self) -> list[float]:
        return [s.median_abs_gap for s in self.history]

    def observe(
        self,
        engine_logprobs: Any,
        trainer_logprobs: Any,
        *,
        top_p: Optional[float] = None,
        kept_mass: Any = None,
        step: Optional[int] = None,
        version: Optional[str] = None,
    ) -> GapStep:
        """Record one step.  ``engine_logprobs`` and ``trainer_logprobs`` are the logprobs of the
        same sampled tokens (flat or per sequence, lists or tensors).  ``top_p`` is the sampling
        top-p the engine used; ``kept_mass`` (per token, same shape) is the probability mass the
        top-p filter kept, if the trainer computed it.  Returns the step with its new findings."""
        eng, tr = _flatten(engine_logprobs), _flatten(trainer_logprobs)
        if len(eng) != len(tr):
            raise InvalidArgumentError(
                f"engine and trainer logprobs differ in length ({len(eng)} vs {len(tr)}); "
                "pass the logprobs of the same sampled tokens"
            )
        kept = _flatten(kept_mass)
        if kept and len(kept) != len(eng):
            raise InvalidArgumentError(f"kept_mass has {len(kept)} values for {len(eng)} tokens")
        if top_p is not None and not (0.0 < top_p <= 1.0):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
        step = len(self.history) if step is None else int(step)

        bad_engine = sum(1 for e in eng if not math.isfinite(e))
        bad_trainer = sum(1 for t in tr if not math.isfinite(t))
        idx = [i for i in range(len(eng)) if math.isfinite(eng[i]) and math.isfinite(tr[i])]
        d = [eng[i] - tr[i] for i in idx]
        absd = [abs(x) for x in d]
        expected = None
        if kept:
            offs = [-math.log(kept[i]) for i in idx if kept[i] > 0]
            expected = _median(offs) if offs else None
        gs = GapStep(
            step=step,
            n_tokens=len(d),
            median_abs_gap=_median(absd) if d else float("nan"),
            median_gap=_median(d) if d else float("nan"),
            max_abs_gap=max(absd) if d else float("nan"),
            positive_fraction=(sum(1 for x in d if x > 0) / len(d)) if d else float("nan"),
            non_finite=bad_engine + bad_trainer,
            expected_offset=expected,
            version=version,
        )
        self.history.append(gs)

        new: list[GapFinding] = []
        if bad_engine or bad_trainer:
            who = "engine" if bad_engine else "trainer"
            msg = (
                f"{bad_engine} engine and {bad_trainer} trainer logprob(s) are NaN/inf. "
                + (
                    "If this follows a level-2 wake with an FP8 KV cache, the sleep cleared the calibrated "
                    "KV scales (vLLM 0.31): upgrade to vLLM >= 0.32, sleep at level 1, or use "
                    "--kv-cache-dtype auto; discard this step's rollouts."
                    if bad_engine
                    else "The trainer's own forward pass overflowed: check its dtype and loss scaling."
                )
            )
            new.append(GapFinding(NON_FINITE, step, msg, {"engine": bad_engine, "trainer": bad_trainer, "who": who}))

        offset_explained = False
        if len(d) >= self.min_tokens:
            f = self._offset_finding(gs, d, kept, idx, top_p)
            if f is not None:
                offset_explained = True
                new.append(f)
        if not offset_explained:
            f = self._large_finding()
            if f is not None:
                new.append(f)
        f = self._trend_finding()
        if f is not None:
            new.append(f)

        # each kind is reported once when it starts, and again only after it went away
        fired = {f.kind for f in new}
        out = [f for f in new if f.kind not in self._active]
        self._active = fired
        gs.findings = out
        self.findings.extend(out)
        return gs

    # ------------------------------------------------------------------ tests
    def _offset_finding(self, gs: GapStep, d, kept, idx, top_p) -> Optional[GapFinding]:
        if not (kept or (top_p is not None and top_p < 1.0)):
            return None  # no top-p in play: nothing to be processed by
        med = gs.median_gap
        if not (med >= self.min_offset and gs.positive_fraction >= 0.9):
            return None
        if kept:
            # per token, the gap must equal −log(kept mass) of that token
            resid = [abs(d[k] - (-math.log(kept[i]))) for k, i in enumerate(idx) if kept[i] > 0]
            if not resid or _median(resid) > max(0.25 * med, 0.005):
                return None
            why = f"it matches −log(kept mass) per token (median {gs.expected_offset:.3f})"
        else:
            bound = -math.log(top_p)
            if med > 1.1 * bound + 0.005:
                return None  # larger than top-p can explain
            why = f"it lies within (0, −log(top_p)={bound:.3f}] as top-p renormalisation predicts"
        return GapFinding(
            PROCESSED,
            gs.step,
            f"engine logprobs are higher than the trainer's by a constant offset (median +{med:.3f}, "
            f"{gs.positive_fraction:.0%} of tokens positive); {why}. The engine returned processed "
            "logprobs (after top-p) while the trainer scored the full vocabulary: start vLLM with "
            "--logprobs-mode raw_logprobs, or score with the same top-p in the trainer.",
            {"median_gap": med, "expected_offset": gs.expected_offset, "top_p": top_p},
        )

    def _large_finding(self) -> Optional[GapFinding]:
        recent = self.history[-self.large_steps:]
        if len(recent) < self.large_steps or not all(s.median_abs_gap > self.large_gap for s in recent):
            return None
        cur = recent[-1]
        return GapFinding(
            LARGE,
            cur.step,
            f"the median absolute logprob gap is {cur.median_abs_gap:.3f} for {self.large_steps} steps "
            f"(kernel noise is ~0.005): the engine does not serve the trainer's model — check that it "
            "loaded the trainer's checkpoint, the same dtype/quantisation, and the weight version.",
            {"median_abs_gap": cur.median_abs_gap},
        )

    def _trend_finding(self) -> Optional[GapFinding]:
        ys = [s.median_abs_gap for s in self.history[-self.window:]]
        ys = [y for y in ys if math.isfinite(y)]
        if len(ys) < self.min_steps:
            return None
        slope = theil_sen_slope(ys)
        tau = kendall_tau(ys)
        growth = slope * (len(ys) - 1)
        if slope <= 0 or tau < self.min_tau or growth < self.min_growth:
            return None
        cur = self.history[-1]
        return GapFinding(
            GROWING,
            cur.step,
            f"the logprob gap grows: median {ys[0]:.4f} -> {ys[-1]:.4f} over {len(ys)} steps "
            f"(slope {slope:+.4f}/step, tau {tau:.2f}). The new weights are not reaching the engine: "
            "check that the weight update finished (finish_weight_update / the version the engine "
            "reports), that it was not sent while the engine slept, and that names/dtypes match.",
            {"slope": slope, "tau": tau, "growth": growth, "window": ys},
        )

    def summary(self) -> dict:
        return {
            "steps": [s.as_dict() for s in self.history],
            "findings": [f.as_dict() for f in self.findings],
            "ok": self.ok,
        }


__all__ = ["LogprobGapMonitor", "GapStep", "GapFinding", "theil_sen_slope", "kendall_tau", "KINDS"]
