"""Helpers shared by the in-process vLLM adapters (:mod:`.vllm_inprocess` over ``vllm.LLM``,
:mod:`.vllm_async` over ``AsyncLLM``): argument checks, sampling parameters, turning a vLLM
``RequestOutput`` into a :class:`~unisleep.engines.base.Generation`, the adapter's own record of
sleeping tags, and the sleep-mode allocator reading.  vLLM is imported inside the functions only.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import EngineError, InvalidArgumentError
from .base import Generation

SLEEP_TAGS = ("weights", "kv_cache")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")


def import_error(what: str, e: BaseException) -> EngineError:
    return EngineError(f"cannot import {what} ({type(e).__name__}: {e}); "
                       "pip install 'unisleep[vllm]'")


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_level(level: Any) -> int:
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise InvalidArgumentError(f"sleep level must be 0, 1 or 2, got {level!r}")
    return int(level)


def check_mode(mode: Any, what: str = "pause") -> str:
    if mode not in PAUSE_MODES:
        raise InvalidArgumentError(f"{what} mode must be one of {PAUSE_MODES}, got {mode!r}")
    return str(mode)


def check_wake_tags(tags: Optional[Sequence[str]]) -> Optional[list[str]]:
    """None (wake everything) or a non-empty list of known tags."""
    if tags is None:
        return None
    tags = list(tags)
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad or not tags:
        raise InvalidArgumentError(
            f"wake_up tags must be a non-empty subset of {WAKE_TAGS}, got {tags!r}")
    return tags


def record_sleep(asleep: set[str], level: int) -> None:
    """Update an adapter's own record after ``sleep(level)``: level >= 1 puts every memory tag to
    sleep, unless the weights already sleep (vLLM's executor then ignores the call)."""
    if level >= 1 and "weights" not in asleep:
        asleep |= set(SLEEP_TAGS)


def record_wake(asleep: set[str], tags: Optional[Sequence[str]], fully_awake: bool) -> None:
    """Update the record after ``wake_up(tags)`` answered ``fully_awake``.  vLLM's executor wakes
    nothing when one of the requested memory tags is not asleep."""
    if tags is None or fully_awake:
        asleep.clear()
        return
    mem = [t for t in tags if t in SLEEP_TAGS]
    if all(t in asleep for t in mem):
        asleep -= set(mem)


def sampling_params(*, max_tokens: int, temperature: float, top_p: float, seed: Optional[int],
                    logprobs: bool, ignore_eos: bool = False, final_only: bool = False):
    """vLLM ``SamplingParams`` for one completion (logprob of the sampled token when asked)."""
    from vllm import SamplingParams

    kw: dict[str, Any] = {}
    if final_only:
        from vllm.sampling_params import RequestOutputKind

        kw["output_kind"] = RequestOutputKind.FINAL_ONLY
    return SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature),
                          top_p=float(top_p), seed=seed, logprobs=0 if logprobs else None,
                          ignore_eos=bool(ignore_eos), **kw)


def to_generation(prompt: Sequence[int], output: Any, logprobs: bool) -> Generation:
    """A :class:`Generation` from a finished vLLM ``RequestOutput`` (its first completion)."""
    c = output.outputs[0]
    lps: list[float] = []
    if logprobs and c.logprobs:
        for tok, d in zip(c.token_ids, c.logprobs):
            lp = d.get(tok)
            lps.append(float("-inf") if lp is None else float(lp.logprob))
    return Generation(prompt_ids=list(prompt), token_ids=list(c.token_ids), logprobs=lps,
                      text=c.text)


def takes_version(fn) -> bool:
    """Whether vLLM's ``finish_weight_update`` takes the weight version (vLLM >= 0.27; before,
    it takes nothing and vLLM keeps no weight version)."""
    import inspect

    try:
        return len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):  # a C or proxy callable: assume the current signature
        return True


def finish_call(fn, version: Optional[str]):
    """Call vLLM's ``finish_weight_update`` with the version where it takes one; before vLLM 0.27
    without (the version is then not recorded by vLLM: it has no weight version)."""
    if takes_version(fn):
        return fn(None if version is None else str(version))
    return fn()


def no_weight_version(version: Optional[str]) -> "UnsupportedError":
    from ..errors import UnsupportedError

    return UnsupportedError(
        f"vLLM {version or '(this version)'} keeps no weight version (get_weight_version and "
        "update_weight_version arrive in vLLM 0.27); with unisleep's worker extension read "
        "collective_rpc('unisleep_weight_version') instead")


__all__ = ["SLEEP_TAGS", "WAKE_TAGS", "PAUSE_MODES", "check_level", "check_mode",
           "check_wake_tags", "record_sleep", "record_wake", "sampling_params", "to_generation",
           "vllm_version", "import_error", "takes_version",
           "finish_call", "no_weight_version"]
