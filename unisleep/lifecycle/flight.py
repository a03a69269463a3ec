"""Copies in flight: the one progressive wake (:class:`~.progressive.ProgressiveWake`) or
background sleep (:class:`BackgroundSleep`) a lifecycle may have running, held by a
:class:`Flight`.

``sleep(level, background=True)`` releases the discarded tags (the KV cache) before it returns
and copies the backed-up tags out behind it, in a :class:`BackgroundSleep`.  While copies are
in flight their tags are ``"waking"`` / ``"sleeping"``; a call touching them is refused
(:meth:`Flight.refuse`), and once the copies are complete the next call under the lifecycle's
lock settles the tags (:meth:`Flight.settle`): awake, or as a failure left them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from .. import graph_capture
from ..errors import CopyInFlightError
from . import transaction
from .progressive import ProgressiveWake, plan_steps
from .state import AWAKE, SLEEPING, WAKING, LifecycleState, Report

log = logging.getLogger("unisleep")


class BackgroundSleep:
    """A level-1 sleep whose backup copies run behind the caller (``sleep(..., background=True)``):
    the discarded tags were released before ``sleep`` returned; ``run`` does the rest."""

    def __init__(self, tags: list[str], work: Callable[[], Any]):
        self.tags = list(tags)
        self._work = work
        self.error: Optional[BaseException] = None
        self.report = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unisleep-sleep", daemon=True)

    def start(self) -> None:
        graph_capture.add_drainer(self.wait_copies)  # a capture waits for the copies to be done
        self._thread.start()

    def _run(self) -> None:
        try:
            with graph_capture.background():
                self.report = self._work()
        except BaseException as e:  # kept for the lifecycle: settle() records it, wait() hands it over
            self.error = e
        finally:
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait_queued(self, timeout: Optional[float] = None) -> bool:
        """Block until the worker has ended (its copies are complete then); False on timeout."""
        return self._finished.wait(timeout)

    def wait_copies(self) -> None:
        self._finished.wait()


class Flight:
    """A lifecycle's copies in flight: at most one :class:`ProgressiveWake` or
    :class:`BackgroundSleep` (``op``), and what the last one that ended left for ``wait()`` —
    its ``report`` and its ``error``.  The lifecycle calls it under its lock, except
    :meth:`refuse` (a first check before the lock) and the waits."""

    def __init__(self):
        self.op = None
        self.report = None
        self.error: Optional[BaseException] = None

    def wake(self, owner, state: LifecycleState, todo: list[str], order, t0: float) -> ProgressiveWake:
        """Start a progressive wake of ``todo`` (``owner``: the lifecycle, whose ``ready`` and
        ``wait`` the wake's own methods call): its tags are ``"waking"`` until it is settled."""
        allocs = [a for a in state.of(*todo) if not a.region.mapped]  # not those kept resident
        steps = plan_steps(allocs, state.driver.config.progressive_piece, order)
        pw = ProgressiveWake(owner, state.driver, state.store, todo, allocs, steps, t0)
        pw.previous = {t: state.tags[t] for t in todo}
        for t in todo:
            state.tags[t] = WAKING
        self.begin(pw)
        pw.returned_s = time.perf_counter() - t0
        return pw

    def sleep_behind(self, state: LifecycleState, later: dict[str, str], lock, sleep: Callable[[dict], Report]) -> None:
        """Start a background sleep of the tags of ``later`` (tag -> offloaded/discarded): they are
        ``"sleeping"`` until its worker, holding ``lock``, runs ``sleep(later)`` (the lifecycle's
        transactional sleep); a failure puts them back awake (or lost, as the undo left them)."""
        for t in later:
            state.tags[t] = SLEEPING

        def work():
            with lock:
                for t in later:
                    state.tags[t] = AWAKE
                try:
                    return sleep(later)
                except BaseException:
                    for t in later:
                        if state.tags.get(t) == SLEEPING:
                            state.tags[t] = AWAKE
                    raise

        self.begin(BackgroundSleep(sorted(later), work))

    def begin(self, op) -> None:
        self.op = op
        if isinstance(op, ProgressiveWake):
            self.error = None
        op.start()

    def refuse(self, tags, what: str) -> None:
        """Raise :class:`~unisleep.errors.CopyInFlightError`, before anything changes, for a call
        touching tags whose copies are in flight (``tags`` None: every tag)."""
        op = self.op
        if op is None or op.done:
            return
        hit = sorted(op.tags) if tags is None else sorted(set(tags) & set(op.tags))
        if hit:
            kind = "a progressive wake" if isinstance(op, ProgressiveWake) else "a background sleep"
            raise CopyInFlightError(
                f"{what}() touches tag(s) {', '.join(map(repr, hit))} while {kind} is still copying them; "
                "call wait() first (or let the copies finish). Nothing was changed."
            )

    def ended(self, block: bool = False):
        """The op whose copies are complete, taken out of flight for the lifecycle to settle its
        tags (with ``block``, waiting for them); None when there is none."""
        op = self.op
        if op is None:
            return None
        if not op.done:
            if not block:
                return None
            op.wait_copies()
        self.op = None
        self.report = None
        return op

    def wait_copies(self) -> None:
        """Wait for the copies of the op in flight, if any (never under the lifecycle's lock)."""
        op = self.op
        if op is not None:
            op.wait_copies()

    def settle(self, state: LifecycleState, after_wake: list[Callable], block: bool = False) -> Optional[Report]:
        """Under the lifecycle's lock: settle the tags of the op whose copies are complete
        (with ``block``, waiting for them) and keep its report and error for ``wait()``.
        A progressive wake's tags become awake (``after_wake`` hooks run), or after a failure
        go back to what they were, memory unmapped; a background sleep's worker settled its
        tags itself (after a failure ``after_wake`` hooks undo its ``before_sleep`` ones)."""
        op = self.ended(block)
        if op is None:
            return None
        if isinstance(op, BackgroundSleep):
            self.report = op.report
            if op.error is not None:
                self.error = op.error
                transaction.run_hooks_quietly(after_wake, list(op.tags), "after a failed background sleep")
            return op.report
        if op.error is not None:
            for t in op.tags:
                state.tags[t] = op.previous[t]
            self.error = transaction.failed_wake(state, ", ".join(op.tags), op.allocs, op.error)
            log.error("%s", self.error)
            return None
        copied = sum(hi - lo for step in op.steps for _, lo, hi in step.loads)
        for a in op.allocs:
            if not a.region.mapped:  # a chunk no step covered (cannot happen: every chunk has one)
                a.region.map(state.driver)
            state.restored(a)
        for t in op.tags:
            state.tags[t] = AWAKE
        for hook in after_wake:
            hook(list(op.tags))
        rep = Report("wake_up(progressive)", list(op.tags), 0, copied, time.perf_counter() - op.started)
        rep.notes.append(f"returned after {1e3 * (op.returned_s or 0):.2f} ms; {len(op.steps)} steps")
        self.report = rep
        return rep

    def take(self):
        """``(report, error)`` of the last op that ended, once: both are cleared."""
        out = (self.report, self.error)
        self.report = self.error = None
        return out
