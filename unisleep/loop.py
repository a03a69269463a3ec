"""The guarded RL step: hand the engine's memory to the trainer, and take it back with new weights.

Two calls wrap every training step::

    handoff = Handoff(engine)
    handoff.release(level=2)          # pause -> sleep(level) -> verify the engine REPORTS sleeping
    train()                           # the trainer uses the freed memory
    handoff.reacquire(send_weights, version="3")
        # wake weights -> verify -> start/update/finish the transfer, check the version
        # -> wake KV cache -> reset prefix cache -> reload the draft (after a level-2 release,
        # engines that can) -> read acceptance (warn on collapse) -> resume

The order is the one vLLM's RL transaction needs (pause, sleep, train, wake weights, update,
wake KV cache, reset the prefix cache, resume) and it is the same for every engine.  Two rules
are never bent:

* weights are never sent into an engine whose weights are asleep (vLLM #57853: a weight update
  during sleep segfaults the engine; on host memory the process dies with SIGSEGV) — the check
  runs before ``send_weights`` is called, so nothing moves;
* every check reads the engine's *reported* state (:meth:`Engine.is_sleeping`,
  :meth:`Engine.sleeping_tags`, :meth:`Engine.weight_version`), never this object's own
  bookkeeping, so an engine that silently failed to sleep or wake is caught.

Every verb is public (:meth:`Handoff.pause`, :meth:`Handoff.sleep`, ...), for loops that need a
different order; each phase is timed and each step yields a :class:`StepReport`.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .engines.base import Engine
from .errors import EngineError, InvalidArgumentError, InvalidTransitionError, SleepBudgetError, TransferError, UnsupportedError

log = logging.getLogger("unisleep.loop")

MEMORY_TAGS = ("weights", "kv_cache")


class SpeculationWarning(UserWarning):
    """Speculative acceptance collapsed after a wake (the draft was probably not reloaded)."""


@dataclass
class StepReport:
    """What one release + reacquire did."""

    step: int
    level: int
    version: Optional[str] = None
    resident_before: Optional[int] = None  # engine bytes before release
    resident_asleep: Optional[int] = None  # engine bytes while the trainer ran
    resident_after: Optional[int] = None  # engine bytes after reacquire
    release_s: float = 0.0
    reacquire_s: float = 0.0
    transfer_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    reported_asleep: Optional[list[str]] = None  # tags the engine reported asleep after sleep()
    free_at_least: Optional[int] = None  # a budgeted release: the bytes asked for
    budget: Optional[dict] = None  # the engine's account of it: what moved, what stayed resident
    spec_acceptance: Optional[float] = None
    warnings: list[str] = field(default_factory=list)
    completed: bool = False

    @property
    def bytes_released(self) -> Optional[int]:
        if self.resident_before is None or self.resident_asleep is None:
            return None
        return self.resident_before - self.resident_asleep

    @property
    def handoff_s(self) -> float:
        """Time the engine spent handing memory over and taking it back (not the training)."""
        return self.release_s + self.reacquire_s

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "step", "level", "version", "resident_before", "resident_asleep", "resident_after", "bytes_released",
            "release_s", "reacquire_s", "transfer_s", "handoff_s", "reported_asleep", "spec_acceptance", "completed",
            "free_at_least", "budget")}
        d["timings"] = dict(self.timings)
        d["warnings"] = list(self.warnings)
        return d


SendWeights = Callable[[Engine], Any]


class Handoff:
    """Guarded release/reacquire of one engine.  See the module docstring.

    Parameters
    ----------
    engine:
        any :class:`~unisleep.engines.base.Engine`.
    pause_mode:
        how :meth:`pause` treats running requests: ``"wait"`` drains them, ``"abort"`` drops them,
        ``"keep"`` keeps them for after the resume.
    min_acceptance:
        speculative acceptance below this after a wake raises a :class:`SpeculationWarning`.
    verify_memory:
        when the engine can tell its resident bytes, require that a sleep lowered them.
    """

    def __init__(self, engine: Engine, *, pause_mode: str = "wait", min_acceptance: float = 0.3,
                 verify_memory: bool = True):
        self.engine = engine
        self.pause_mode = pause_mode
        self.min_acceptance = min_acceptance
        self.verify_memory = verify_memory
        self.history: list[StepReport] = []
        self.current: Optional[StepReport] = None

    # ------------------------------------------------------------------ reported state
    def resident_bytes(self) -> Optional[int]:
        """The engine's resident bytes as it reports them, or None when it cannot tell."""
        fn = getattr(self.engine, "resident_bytes", None)
        if fn is None:
            return None
        try:
            n = fn()
        except NotImplementedError:
            return None
        return None if n is None else int(n)

    def reported_asleep(self) -> Optional[set[str]]:
        tags = self.engine.sleeping_tags()
        return None if tags is None else set(tags)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self.current is not None:
                self.current.timings[name] = self.current.timings.get(name, 0.0) + time.perf_counter() - t0

    def _warn(self, msg: str, category=RuntimeWarning) -> None:
        log.warning("%s", msg)
        warnings.warn(msg, category, stacklevel=3)
        if self.current is not None:
            self.current.warnings.append(msg)

    # ------------------------------------------------------------------ low-level verbs
    def pause(self, mode: Optional[str] = None) -> None:
        """Stop generation (drain/abort/keep running requests)."""
        eng = self.engine
        self._timed("pause", lambda: eng.pause(mode or self.pause_mode))
        if type(eng).is_paused is not Engine.is_paused and not eng.is_paused():
            raise EngineError(f"{eng.kind} engine reports it is not paused after pause(); nothing was put to sleep")

    def sleep(self, level: int) -> set[str]:
        """Put the engine to sleep and check that it *reports* sleeping.  Returns the tags it
        reports asleep (empty when it cannot tell per tag)."""
        if level not in (1, 2):
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        eng = self.engine
        self._timed("sleep", lambda: eng.sleep(level))
        return self.verify_sleeping(level)

    def sleep_to_free(self, level: int, nbytes: int) -> set[str]:
        """A budgeted sleep (:meth:`Engine.sleep_to_free`): the engine frees at least ``nbytes``
        and keeps the rest resident; checks that it reports sleeping (``nbytes`` > 0) and, when
        it can tell its resident bytes, that they fell by at least ``nbytes``.  Returns the tags
        it reports asleep."""
        if level not in (1, 2):
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        eng = self.engine
        before = self.resident_bytes()
        budget = self._timed("sleep", lambda: eng.sleep_to_free(level, nbytes))
        if self.current is not None:
            self.current.budget = budget
        if nbytes == 0:
            return self.reported_asleep() or set()
        if not eng.is_sleeping():
            raise EngineError(f"{eng.kind} engine reports it is awake after a sleep to free {nbytes} bytes: nothing "
                              "was released. Do not start training on that memory.")
        after = self.resident_bytes()
        if self.verify_memory and before is not None and after is not None and before - after < nbytes:
            raise EngineError(f"the {eng.kind} engine freed {before - after} bytes, fewer than the {nbytes} asked "
                              "(its resident bytes, as it reports them): do not start training on that memory.")
        return self.reported_asleep() or set()

    def verify_sleeping(self, level: int) -> set[str]:
        eng = self.engine
        if not eng.is_sleeping():
            raise EngineError(
                f"{eng.kind} engine reports it is awake after sleep(level={level}): its memory was not "
                "released (is sleep mode enabled — vLLM: --enable-sleep-mode?). Do not start training on "
                "that memory."
            )
        tags = self.reported_asleep()
        if tags is not None:
            # both levels release the weights (level 1 backs them up) and the KV cache
            missing = [t for t in MEMORY_TAGS if t not in tags]
            if not tags:
                raise EngineError(
                    f"{eng.kind} engine reports no memory asleep after sleep(level={level}) (it says it is "
                    "sleeping, e.g. only because it is paused): nothing was released for the trainer."
                )
            if missing:
                raise EngineError(
                    f"{eng.kind} engine reports {sorted(tags)} asleep after sleep(level={level}); "
                    f"{missing} should be asleep too — its memory was only partly released."
                )
        return tags or set()

    def wake_weights(self) -> None:
        """Wake the weights only (the KV cache stays asleep while the weights arrive).  An engine
        that cannot report per-tag state is woken completely, so the transfer is provably safe."""
        eng = self.engine
        tags = self.reported_asleep()
        if tags is None:
            if eng.is_sleeping():
                self._timed("wake_weights", lambda: eng.wake_up(None))
                if eng.is_sleeping():
                    raise EngineError(f"{eng.kind} engine still reports sleeping after wake_up()")
            return
        if "weights" in tags:
            self._timed("wake_weights", lambda: eng.wake_up(["weights"]))
            after = self.reported_asleep() or set()
            if "weights" in after:
                raise EngineError(f"{eng.kind} engine still reports its weights asleep after wake_up(['weights'])")

    def check_can_receive(self) -> None:
        """Raise InvalidTransitionError unless the engine reports its weights awake."""
        eng = self.engine
        tags = self.reported_asleep()
        asleep = ("weights" in tags) if tags is not None else eng.is_sleeping()
        if asleep:
            raise InvalidTransitionError(
                f"refusing to send weights: the {eng.kind} engine reports its weights asleep "
                f"({sorted(tags) if tags is not None else 'is_sleeping() = True'}). A weight update during "
                "sleep crashes the engine (vLLM #57853: segfault; host memory: SIGSEGV). Call "
                "wake_weights() first — nothing was sent."
            )

    def transfer(self, send_weights: SendWeights, version: Any) -> float:
        """start_weight_update -> ``send_weights(engine)`` -> finish_weight_update(version), then
        check the version the engine reports.  Returns the seconds it took."""
        eng = self.engine
        version = str(version)
        self.check_can_receive()
        t0 = time.perf_counter()
        phase = "start_weight_update"
        try:
            self._timed("start_update", eng.start_weight_update)
            phase = "sending the weights"
            self._timed("send", lambda: send_weights(eng))
            phase = "finish_weight_update"
            self._timed("finish_update", lambda: eng.finish_weight_update(version))
        except Exception as e:
            aborted = False
            if phase != "finish_weight_update":
                abort = getattr(eng, "abort_weight_update", None)
                if abort is not None:
                    try:
                        aborted = abort() is True
                    except Exception:  # the original error is the one to report
                        log.debug("abort_weight_update failed", exc_info=True)
            raise TransferError(
                f"weight update to version {version!r} failed while {phase}: {e}. "
                + self._restart_advice(aborted)
            ) from e
        got = eng.weight_version()
        if str(got) != version:
            raise TransferError(
                f"the {eng.kind} engine reports weight version {got!r} after an update to {version!r}: the update "
                "did not take. " + self._restart_advice()
            )
        dt = time.perf_counter() - t0
        if self.current is not None:
            self.current.transfer_s += dt
            self.current.version = version
        return dt

    def _restart_advice(self, aborted: bool = False) -> str:
        if self.engine.kind.startswith("vllm"):
            if aborted:
                return ("The engine reports no update session left open. It stays paused with its KV cache "
                        "asleep: with the atomic unisleep transfer engine nothing was applied and it still "
                        "serves the previous weights (wake_kv_cache() + resume(), or reacquire() again with the "
                        "full set); with vLLM's built-in transfer engines a failed update leaves the model "
                        "half-loaded and the engine must be restarted.")
            return ("The vLLM engine holds a partial update and must be restarted; it stays paused and "
                    "must not serve rollouts.")
        return ("The engine stays paused with its KV cache asleep; re-send the full set of weights "
                "(reacquire() again) or restart the engine before resuming.")

    def wake_kv_cache(self) -> None:
        eng = self.engine
        tags = self.reported_asleep()
        if tags is None or "kv_cache" in tags or eng.is_sleeping():
            self._timed("wake_kv", lambda: eng.wake_up(["kv_cache"] if tags is not None else None))
        if eng.is_sleeping():
            raise EngineError(
                f"{eng.kind} engine still reports sleeping ({sorted(self.reported_asleep() or [])}) after waking "
                "the KV cache; it cannot serve rollouts."
            )

    def reset_prefix_cache(self) -> None:
        eng = self.engine
        ok = self._timed("reset_prefix_cache", eng.reset_prefix_cache)
        if ok is False:
            raise EngineError(
                f"{eng.kind} engine refused to reset its prefix cache: cached prefixes computed with the old "
                "weights would be reused. Drain running requests (pause mode 'wait') and retry."
            )

    def reload_draft(self) -> bool:
        """Reload the speculative draft after a level-2 release when speculation is on (a
        level-2 wake reloads only the target; a level-1 sleep keeps the draft).  Returns whether
        a draft was reloaded.  The vLLM adapters cannot reload a draft (vLLM has no call for it,
        #52479) and so refuse a level-2 sleep while a draft is configured: this step is then
        never reached for them."""
        eng = self.engine
        if not eng.has_draft_model() or self.current is None or self.current.level != 2:
            return False
        self._timed("reload_draft", eng.reload_draft)
        return True

    def read_acceptance(self) -> Optional[float]:
        eng = self.engine
        if not eng.has_draft_model():
            return None
        acc = self._timed("read_acceptance", eng.spec_acceptance)
        if self.current is not None:
            self.current.spec_acceptance = acc
        if acc is not None and acc < self.min_acceptance:
            self._warn(
                f"speculative acceptance is {acc:.2f} (< {self.min_acceptance:.2f}) after the wake: the target "
                "rejects the draft's tokens, so decode runs as slowly as without speculation. The draft was "
                "probably not reloaded after a level-2 wake — reload it (reload_draft / restart) or sleep at level 1.",
                SpeculationWarning,
            )
        return acc

    def resume(self) -> None:
        """Let the engine generate again — refused first (:class:`~unisleep.errors.TornWeightsError`,
        the engine stays paused) while its weights are torn: an update that failed part-way with
        nothing to roll back to must be followed by a complete one before rollouts resume."""
        eng = self.engine
        check = getattr(eng, "check_serving", None)
        if check is not None:
            check()
        self._timed("resume", eng.resume)
        if type(eng).is_paused is not Engine.is_paused and eng.is_paused():
            raise EngineError(f"{eng.kind} engine still reports paused after resume()")

    # ------------------------------------------------------------------ guarded steps
    def release(self, level: int = 2, *, free_at_least=None) -> StepReport:
        """pause -> sleep(level) -> verify the engine reports sleeping (and, when it can tell,
        that its resident bytes fell).  Returns the step's report, completed by :meth:`reacquire`.

        ``free_at_least``: what the trainer needs, in bytes — an int, or a function the trainer
        answers at the release (the other side asks): the engine frees at least that much (its
        KV cache first, then its weights region by region) and keeps the rest resident
        (:meth:`sleep_to_free`).  An engine that cannot is refused with
        :class:`~unisleep.errors.UnsupportedError` before it is paused."""
        if level not in (1, 2):
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        eng = self.engine
        asked = None
        if free_at_least is not None:
            asked = free_at_least() if callable(free_at_least) else free_at_least
            if not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
                raise InvalidArgumentError(f"free_at_least must be an int >= 0 (bytes), or a function returning one; "
                                           f"got {asked!r}. Nothing was changed.")
            if not eng.can_sleep_to_free():
                raise UnsupportedError(f"the {eng.kind} engine cannot sleep to a budget (its sleep frees all of a "
                                       "level): release without free_at_least. Nothing was changed.")
        if eng.is_sleeping():
            raise InvalidTransitionError(
                f"the {eng.kind} engine already reports sleeping ({sorted(self.reported_asleep() or [])}); "
                "call reacquire() before the next release() — nothing was changed."
            )
        if asked is not None:
            held = self.resident_bytes()
            if held is not None and asked > held:
                raise SleepBudgetError(f"free_at_least={asked} bytes: the {eng.kind} engine holds only {held}; ask for "
                                       "less, or release without free_at_least. Nothing was changed.",
                                       asked=asked, available=held)
        rep = StepReport(step=len(self.history), level=level, free_at_least=asked)
        self.current = rep
        t0 = time.perf_counter()
        rep.resident_before = self.resident_bytes()
        self.pause()
        tags = self.sleep(level) if asked is None else self.sleep_to_free(level, asked)
        rep.reported_asleep = sorted(tags)
        rep.resident_asleep = self.resident_bytes()
        if self.verify_memory and rep.resident_before and rep.resident_asleep is not None and asked != 0:
            if rep.resident_asleep >= rep.resident_before:
                raise EngineError(
                    f"the {eng.kind} engine reports sleeping but still holds {rep.resident_asleep} bytes "
                    f"(was {rep.resident_before}): no memory was freed for the trainer."
                )
        rep.release_s = time.perf_counter() - t0
        self.history.append(rep)
        return rep

    def reacquire(self, send_weights: Optional[SendWeights], version: Any = None) -> StepReport:
        """wake weights -> transfer (start, ``send_weights(engine)``, finish, check version) ->
        wake KV cache -> reset prefix cache -> reload the draft (after level 2) -> read
        acceptance -> resume.

        ``send_weights`` may be None only after a level-1 release (the weights were kept)."""
        rep = self.current
        if rep is None or rep.completed:
            rep = StepReport(step=len(self.history), level=0)
            self.current = rep
            self.history.append(rep)
        if send_weights is None and rep.level == 2:
            raise InvalidArgumentError(
                "a level-2 release discarded the engine's weights; reacquire() needs send_weights to load new ones"
            )
        if send_weights is not None and version is None:
            raise InvalidArgumentError("pass the version of the weights you send (it labels the next rollouts)")
        t0 = time.perf_counter()
        try:
            self.wake_weights()
            if send_weights is not None:
                self.transfer(send_weights, version)
            self.wake_kv_cache()
            self.reset_prefix_cache()
            self.reload_draft()
            self.read_acceptance()
            self.resume()
        finally:
            rep.reacquire_s += time.perf_counter() - t0
        rep.resident_after = self.resident_bytes()
        rep.completed = True
        self.current = rep
        return rep

    def step(self, train: Callable[[], Any], send_weights: Optional[SendWeights], version: Any, *,
             level: int = 2, free_at_least=None) -> StepReport:
        """release(level, free_at_least=...) -> ``train()`` -> reacquire(send_weights, version)."""
        rep = self.release(level, free_at_least=free_at_least)
        t0 = time.perf_counter()
        train()
        rep.timings["train"] = time.perf_counter() - t0
        return self.reacquire(send_weights, version)


__all__ = ["Handoff", "StepReport", "SpeculationWarning", "MEMORY_TAGS"]
