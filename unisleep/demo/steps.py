"""What one RL step of the demo records: :class:`DemoStep` (embedded engine) and
:class:`VLLMDemoStep` (``--engine vllm``); ``as_dict`` is the step's entry in ``demo.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class _StepRecord:
    """What both records share: the handoff time (release + reacquire) and ``as_dict``, the
    fields followed by the derived figures named in ``_derived``."""

    _derived: tuple = ("handoff_ms",)

    @property
    def handoff_ms(self) -> float:
        return self.release_ms + self.reacquire_ms

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for name in self._derived:
            d[name] = getattr(self, name)
        return d


@dataclass
class DemoStep(_StepRecord):
    step: int
    version: str
    level: int
    resident_before: Optional[int]
    resident_asleep: Optional[int]
    release_ms: float
    reacquire_ms: float
    transfer_ms: float
    train_ms: float
    gap: float
    probe_gap: float
    reward: float
    findings: list[str] = field(default_factory=list)
    free_at_least: Optional[int] = None  # --free-at-least: the bytes the trainer asked for
    budget: Optional[dict] = None  # the engine's account: what moved, what stayed resident

    _derived = ("released", "handoff_ms")

    @property
    def released(self) -> Optional[int]:
        if self.resident_before is None or self.resident_asleep is None:
            return None
        return self.resident_before - self.resident_asleep


@dataclass
class VLLMDemoStep(_StepRecord):
    step: int
    version: str  # as /weight_info reports it after the reacquire
    level: int
    is_sleeping: bool  # GET /is_sleeping after the release
    sleep_gauge: Optional[dict]  # /metrics vllm:engine_sleep_state after the release
    reported_asleep: list[str]
    resident_before: Optional[int]  # Engine.resident_bytes(): None when the engine cannot tell
    resident_asleep: Optional[int]
    rss_awake: Optional[int]  # host RSS of the server's processes
    rss_asleep: Optional[int]
    release_ms: float
    reacquire_ms: float
    transfer_ms: float
    train_ms: float
    gap: float
    probe_gap: float  # engine greedy probe vs the trainer's NEW weights
    stale_gap: float  # the same engine logprobs vs the trainer's PREVIOUS weights
    greedy_changed: int  # probe prompts whose greedy tokens differ from version 0's
    reward: float
    findings: list[str] = field(default_factory=list)


def reward_quarters(steps: list) -> tuple[float, float]:
    """The mean reward over the first and over the last quarter of the steps (at least one each)."""
    q = max(1, len(steps) // 4)
    first, last = steps[:q], steps[-q:]
    return sum(s.reward for s in first) / len(first), sum(s.reward for s in last) / len(last)
