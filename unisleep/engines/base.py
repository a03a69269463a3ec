"""The verbs every rollout engine adapter offers, whatever the engine (vLLM over HTTP, vLLM in
process, the plain PyTorch generator).  The guarded RL step (:mod:`unisleep.loop`) talks only to
this interface, and it checks the engine's *reported* state rather than its own bookkeeping.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import UnsupportedError


@dataclass
class Generation:
    """One completion: the prompt's token ids, the generated ids and their logprobs."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    text: Optional[str] = None


class Engine(abc.ABC):
    """A rollout engine whose memory and weights unisleep can hand over."""

    #: short name shown in reports ("vllm-http", "vllm", "torch")
    kind: str = "?"

    # ---- torn weights ----------------------------------------------------------------
    def guard_serving(self, guard: Any) -> None:
        """Refuse generation while ``guard``'s weights are torn: a
        :class:`~unisleep.transfer.WeightReceiver` or :class:`~unisleep.MemoryLifecycle` that
        writes this engine's weights (anything with a ``check_serving()`` that raises
        :class:`~unisleep.errors.TornWeightsError`).  An engine adapter asks each before it
        generates (:meth:`check_serving`)."""
        if not callable(getattr(guard, "check_serving", None)):
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"guard_serving needs a WeightReceiver or a MemoryLifecycle (an object with check_serving()), got "
                f"{type(guard).__name__}")
        guards = self.__dict__.setdefault("_serving_guards", [])
        if all(g is not guard for g in guards):
            guards.append(guard)

    def unguard_serving(self, guard: Any) -> None:
        """Stop asking ``guard`` (given to :meth:`guard_serving`); a no-op when it was not given."""
        guards = self.__dict__.get("_serving_guards", [])
        guards[:] = [g for g in guards if g is not guard]

    def serving_guards(self) -> list:
        """What :meth:`check_serving` asks: the guards given to :meth:`guard_serving`."""
        return list(self.__dict__.get("_serving_guards", ()))

    def check_serving(self) -> None:
        """Raise :class:`~unisleep.errors.TornWeightsError` — naming the incomplete version, the
        one served before it and the fix (send a complete update) — while an update that failed
        part-way left this engine's weights torn.  A flag check per guard; every ``generate``
        calls it before touching the weights."""
        for g in self.__dict__.get("_serving_guards", ()):
            g.check_serving()

    # ---- generation ----------------------------------------------------------------
    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16, temperature: float = 0.0,
        top_p: float = 1.0, seed: Optional[int] = None, logprobs: bool = True,
    ) -> list[Generation]: ...

    @abc.abstractmethod
    def pause(self, mode: str = "abort") -> None:
        """Stop generation ("abort" running requests, "wait" for them, or "keep" them)."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    def is_paused(self) -> bool:
        return False

    # ---- memory --------------------------------------------------------------------
    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None: ...

    def sleep_to_free(self, level: int, nbytes: int) -> Optional[dict]:
        """Put to sleep only enough of the engine's memory to free at least ``nbytes`` (a
        budgeted sleep: the rest stays resident at the same addresses); returns the account of
        what moved and what stayed (``MemoryLifecycle.sleep(free_at_least=)``'s ``budget``), or
        None.  Engines that cannot (vLLM's sleep frees everything of a level) raise
        :class:`~unisleep.errors.UnsupportedError`, nothing changed."""
        raise UnsupportedError(
            f"the {self.kind} engine cannot sleep to a budget: its sleep frees all of a level; release without "
            "free_at_least. Nothing was changed.")

    def can_sleep_to_free(self) -> bool:
        """Whether :meth:`sleep_to_free` is implemented."""
        return type(self).sleep_to_free is not Engine.sleep_to_free

    @abc.abstractmethod
    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None: ...

    @abc.abstractmethod
    def is_sleeping(self) -> bool:
        """True while any memory (weights or KV cache) is asleep, as the engine reports it."""

    def sleeping_tags(self) -> Optional[set[str]]:
        """Tags the engine reports asleep, when it can tell (None = unknown)."""
        return None

    def reset_prefix_cache(self) -> bool:
        return True

    def resident_bytes(self) -> Optional[int]:
        """Bytes of the engine's memory that a sleep can release, as the engine (or its memory
        backend) reports them — not this process's bookkeeping.  ``None`` (the default) means the
        engine cannot tell; :class:`~unisleep.loop.Handoff` then skips its memory check."""
        return None

    # ---- weights -------------------------------------------------------------------
    @abc.abstractmethod
    def weight_version(self) -> str: ...

    @abc.abstractmethod
    def set_weight_version(self, version: str) -> None: ...

    def init_weight_transfer(self, init_info: dict) -> Any:
        raise NotImplementedError

    def start_weight_update(self) -> None:
        raise NotImplementedError

    def update_weights(self, update_info: Any) -> None:
        raise NotImplementedError

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        raise NotImplementedError

    def abort_weight_update(self) -> bool:
        """Abandon an update begun with :meth:`start_weight_update` (a send failed part way).

        Returns True when the engine confirmed that no update session is left open (the next
        ``start_weight_update`` is accepted); False (the default) when it cannot tell."""
        return False

    # ---- speculative decoding (optional) --------------------------------------------
    def has_draft_model(self) -> bool:
        return False

    def reload_draft(self) -> None:
        pass

    def spec_acceptance(self) -> Optional[float]:
        """Fraction of draft tokens accepted since the last call (None when unknown)."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
