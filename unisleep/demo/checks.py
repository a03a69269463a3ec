"""The demo's verdict per claim (:class:`Check`: PASS, FAIL or SKIP when not observable here) —
weights arrived, memory freed, gap steady, the policy learned (embedded engine) and, for
``--engine vllm``, weights changed, version recorded and engine slept — and
:func:`max_logprob_gap`, the probe's measure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .constants import LEARNED_MIN, LEARNED_MIN_STEPS, PROBE_TOL, RELEASED_MIN, VLLM_PROBE_PROMPTS, VLLM_PROBE_TOL
from .report import kib, mib
from .steps import DemoStep, VLLMDemoStep, reward_quarters


@dataclass
class Check:
    name: str
    ok: Optional[bool]  # None: could not be observed here (said so in detail), not a failure
    detail: str

    @property
    def label(self) -> str:
        return "SKIP" if self.ok is None else ("PASS" if self.ok else "FAIL")


def max_logprob_gap(gens, scored) -> float:
    """The largest |engine − trainer| logprob over the tokens of ``gens`` (the engine's generations)
    and ``scored`` (the trainer's logprobs of the same tokens)."""
    return max(abs(a - b) for g, r in zip(gens, scored) for a, b in zip(g.logprobs, r))


def _loop_ran(failure: Optional[str]) -> list[Check]:
    return [] if failure is None else [Check("loop ran", False, failure)]


def _gap_steady(steps: list, monitor) -> Check:
    return Check(
        "gap steady", monitor.ok,
        f"median |Δ logprob| {min(s.gap for s in steps):.1e}..{max(s.gap for s in steps):.1e}, no finding"
        if monitor.ok else " | ".join(f.message for f in monitor.findings),
    )


def learned(steps: list, target) -> Check:
    """The run learned something: the reward rose by at least LEARNED_MIN from the first quarter
    of the steps to the last (SKIP with fewer than LEARNED_MIN_STEPS steps: too few to tell)."""
    if len(steps) < LEARNED_MIN_STEPS:
        return Check("policy learned", None,
                     f"not observable in {len(steps)} step(s): run at least {LEARNED_MIN_STEPS} (--steps) to see "
                     "the reward rise")
    r0, r1 = reward_quarters(steps)
    ok = r1 >= r0 + LEARNED_MIN
    return Check(
        "policy learned", ok,
        f"reward (fraction of token {target}) rose {r0:.2f} -> {r1:.2f} from the first quarter of the steps to "
        f"the last (>= +{LEARNED_MIN:g})" if ok else
        f"reward went {r0:.2f} -> {r1:.2f} from the first quarter of the steps to the last, less than "
        f"+{LEARNED_MIN:g}: the trainer's updates did not make the engine better at the task (more --steps, a "
        "larger --lr, or weights that do not reach the engine)",
    )


def embedded_checks(steps: list[DemoStep], monitor, failure: Optional[str], target=None) -> list[Check]:
    """The checks of the embedded engine's run (``failure``: why the loop stopped, or None;
    ``target``: the rewarded token, named in the learning check)."""
    checks = _loop_ran(failure)
    if steps:
        bad = [s.step for s in steps if not s.probe_gap <= PROBE_TOL]
        checks.append(Check(
            "weights arrived", not bad,
            f"engine's greedy probe logprobs match the trainer's after every reacquire (max Δ "
            f"{max(s.probe_gap for s in steps):.1e} <= {PROBE_TOL:g})" if not bad else
            f"after steps {bad} the engine's probe logprobs differ from the trainer's by up to "
            f"{max(s.probe_gap for s in steps):.3f}: the new weights did not reach the engine",
        ))
        freed = [s for s in steps if s.resident_before]
        if freed and freed[0].free_at_least is not None:  # --free-at-least: what the trainer asked, no less
            low = [s.step for s in freed if (s.released or 0) < s.free_at_least]
            checks.append(Check(
                "memory freed", not low,
                f"every budgeted sleep released >= the {kib(freed[0].free_at_least)} KiB asked (first: "
                f"{kib(freed[0].released)} KiB of {kib(freed[0].resident_before)} KiB; the rest stayed resident)"
                if not low else f"steps {low} released less than the {kib(freed[0].free_at_least)} KiB asked"))
            checks.append(_gap_steady(steps, monitor))
            checks.append(learned(steps, target))
            return checks
        low = [s.step for s in freed if (s.released or 0) < RELEASED_MIN * s.resident_before]
        checks.append(Check(
            "memory freed", bool(freed) and not low,
            (f"every sleep released >= {RELEASED_MIN:.0%} of the engine's resident bytes "
             f"({kib(freed[0].resident_before)} KiB -> {kib(freed[0].resident_asleep)} KiB)") if freed and not low
            else f"steps {low} released less than {RELEASED_MIN:.0%} of the resident bytes",
        ))
        checks.append(_gap_steady(steps, monitor))
        checks.append(learned(steps, target))
    return checks


def vllm_checks(steps: list[VLLMDemoStep], monitor, failure: Optional[str], base_gap: float, level: int,
                is_accelerator: bool) -> tuple[list[Check], str]:
    """The checks of the ``--engine vllm`` run and the table's note on where the freed memory comes
    from (``base_gap``: the probe's gap before the first step)."""
    checks = _loop_ran(failure)
    memory_note = "n/a"
    if steps:
        bad = [s.step for s in steps if not s.probe_gap <= VLLM_PROBE_TOL]
        checks.append(Check(
            "weights arrived", not bad and base_gap <= VLLM_PROBE_TOL,
            (f"the engine's greedy probe logprobs (/v1/completions) match the trainer's full-vocabulary logprobs "
             f"of the new weights after every reacquire (max Δ {max(s.probe_gap for s in steps):.1e}; "
             f"{base_gap:.1e} before the first step; tolerance {VLLM_PROBE_TOL:g})") if not bad and
            base_gap <= VLLM_PROBE_TOL else
            (f"after steps {bad} the engine's probe logprobs differ from the trainer's new weights by up to "
             f"{max(s.probe_gap for s in steps):.3f} (before the first step: {base_gap:.1e}): the new weights did "
             "not reach the engine"),
        ))
        flat = [s.step for s in steps if not s.stale_gap > 10 * VLLM_PROBE_TOL]
        checks.append(Check(
            "weights changed", not flat,
            (f"every step moved the engine's logprobs away from the previous weights by more than "
             f"{10 * VLLM_PROBE_TOL:g} (min {min(s.stale_gap for s in steps):.1e}), so the probe can tell old "
             f"weights from new; greedy output differs from version 0 on "
             f"{steps[-1].greedy_changed}/{len(VLLM_PROBE_PROMPTS)} probes at the end") if not flat else
            f"steps {flat}: the engine's logprobs are within {10 * VLLM_PROBE_TOL:g} of the previous weights",
        ))
        wrong = [(s.step, s.version) for s in steps if s.version != str(s.step)]
        checks.append(Check(
            "version recorded", not wrong,
            f"/weight_info reported {', '.join(s.version for s in steps)} after the steps" if not wrong else
            f"/weight_info reported {wrong} (step, version) instead of the versions sent",
        ))
        slept = [s.step for s in steps if s.is_sleeping and s.sleep_gauge is not None and s.sleep_gauge.get("awake") == 0
                 and sorted(s.reported_asleep) == ["kv_cache", "weights"]]
        gauge_key = "discard_all" if level == 2 else "weights_offloaded"
        checks.append(Check(
            "engine slept", len(slept) == len(steps),
            (f"after every release the engine reported sleeping: /is_sleeping true and /metrics "
             f"vllm:engine_sleep_state awake=0, {gauge_key}={steps[0].sleep_gauge.get(gauge_key)} "
             f"(level {level}); weights and KV cache asleep") if len(slept) == len(steps) else
            f"steps {[s.step for s in steps if s.step not in slept]}: the engine did not report sleeping",
        ))
        if all(s.resident_before is not None for s in steps):
            low = [s.step for s in steps if (s.resident_before - (s.resident_asleep or 0)) < RELEASED_MIN * s.resident_before]
            memory_note = "from the engine's resident_bytes()"
            checks.append(Check("memory freed", not low,
                                f"every sleep released >= {RELEASED_MIN:.0%} of the engine's bytes" if not low else
                                f"steps {low} released less than {RELEASED_MIN:.0%} of the engine's bytes"))
        else:
            rss = [(s.rss_awake, s.rss_asleep) for s in steps if s.rss_awake and s.rss_asleep]
            rss_txt = (f"; the server's host RSS went {mib(rss[0][0])} -> {mib(rss[0][1])} MiB across the first "
                       "sleep") if rss else ""
            if is_accelerator:
                memory_note = "not observable: vLLM's HTTP API reports no memory figures"
                detail = ("not observable: vLLM's HTTP API reports no device-memory figures (give VLLMHTTPEngine a "
                          "memory_probe= to check it)" + rss_txt)
            else:
                memory_note = ("not observable on CPU — vLLM refuses sleep mode on CPU and its CPU worker treats "
                               "sleep/wake as no-ops, so a sleep frees no memory here")
                detail = ("not observable on CPU: vLLM refuses sleep mode on CPU and its CPU worker treats sleep/wake "
                          "as no-ops, so nothing is freed (state flags only)" + rss_txt +
                          ". The memory check runs for the embedded engine (unisleep demo without --engine) and on "
                          "accelerators.")
            checks.append(Check("memory freed", None, detail))
        checks.append(_gap_steady(steps, monitor))
    return checks, memory_note
