"""What becomes of the receiver's weights when an update fails: all or nothing, without a second
copy.

A streaming update writes each verified bucket into the live weights while the next arrives, so
a failure part-way (a corrupt bucket, the sender killed, ``apply`` raising out of memory, a
timeout) may leave the weights mixed.  :func:`settle` decides, once the update has failed:

* ``"untouched"`` — no bucket was applied: the previous version still serves;
* ``"rolled_back"`` — buckets were applied, and the guard :class:`~unisleep.MemoryLifecycle` held
  a retained level-1 backup of the weights that was proven equal to them when the update began
  (:func:`restore_point`): the weights are loaded back from it and proven byte-exact again;
* ``"torn"`` — buckets were applied and nothing holds the previous bytes (e.g. after a level-2
  sleep): the receiver (and its guard lifecycle) are marked torn; reads through unisleep raise
  :class:`~unisleep.errors.TornWeightsError` until an update covering the torn one's tensors
  completes.

Why the proof comes at the start: once a bucket is written the memory no longer equals the
backup, and nothing could show afterwards that it did before; a digest pass over the weights
before the first write is the only way to know the backup is the version being served.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import UnisleepError
from ..lifecycle.rollback import Torn

log = logging.getLogger("unisleep")

OUTCOMES = ("untouched", "rolled_back", "torn")


def guard_lifecycle(rx) -> Any:
    """The receiver's guard when it is a :class:`~unisleep.MemoryLifecycle` (else None)."""
    g = rx.guard
    return g if g is not None and hasattr(g, "restore_point") and hasattr(g, "mark_torn") else None


def guard_tags(rx, lc) -> list[str]:
    """The tags of ``lc`` the receiver writes: its ``guard_tags``, else ``"weights"`` when the
    lifecycle has it, else every tag."""
    if rx.guard_tags:
        return list(rx.guard_tags)
    st = lc.state()
    return ["weights"] if "weights" in st else list(st)


def restore_point(rx):
    """Before the first byte of an update is applied: the guard lifecycle's proven restore
    point for the tags the receiver writes, or None (no lifecycle guard, ``rollback=False``, no
    retained backup equal to the weights now)."""
    lc = guard_lifecycle(rx)
    if lc is None or not rx.rollback:
        return None
    try:
        return lc.restore_point(guard_tags(rx, lc))
    except UnisleepError as e:  # no point: a failure part-way will mark the weights torn
        log.info("no restore point for this update (%s: %s)", type(e).__name__, e)
        return None


def settle(rx, state, point, version, why: str) -> tuple[str, str]:
    """``(outcome, what the error says of the weights)`` for update ``version`` that failed
    with ``why``, after rolling back or marking torn (see the module)."""
    if state is None or not state.touched:
        return "untouched", f"nothing was applied: still serving version {rx.version!r}"
    n = state.touched
    failed = ""
    if point is not None:
        try:
            nbytes = guard_lifecycle(rx).roll_back(point)
            rx.consistent = True
            return "rolled_back", (f"rolled back: the {n} bucket(s) already applied were undone from the lifecycle's "
                                   f"retained level-1 backup ({nbytes} bytes restored, proven byte-exact); still "
                                   f"serving version {rx.version!r}")
        except Exception as e:  # noqa: BLE001 - the weights are torn then, and the error says why
            failed = f"; the rollback from the retained backup failed ({type(e).__name__}: {e})"
    written(rx)
    names = tuple(dict.fromkeys(state.touched_names))
    torn = Torn(version, rx.version, names, why[:300], frozenset(s.name for s in state.specs))
    rx.torn = torn
    rx.consistent = False
    lc = guard_lifecycle(rx)
    if lc is not None:
        lc.mark_torn(version=version, previous=rx.version, names=names, why=why[:300], needs=torn.needs)
    return "torn", (f"the weights are torn: {n} bucket(s) ({len(names)} tensor(s)) of version {version!r} were "
                    f"applied and version {rx.version!r} could not be restored (no retained level-1 backup held it, "
                    f"e.g. after a level-2 sleep){failed}; reads through unisleep refuse (TornWeightsError) until a "
                    f"complete update arrives: send the whole update again")


def written(rx) -> None:
    """The update wrote the weights: the guard lifecycle's retained backups of them hold older
    bytes now (dropped: see :meth:`~unisleep.MemoryLifecycle.mark_written`)."""
    lc = guard_lifecycle(rx)
    if lc is not None:
        lc.mark_written(guard_tags(rx, lc))


def clear(rx, names) -> None:
    """A complete update of ``names`` was applied: the torn mark goes when it covers every tensor
    of the torn update."""
    written(rx)
    lc = guard_lifecycle(rx)
    # a receiver made after the one that tore the weights (its sender died with the group, so a
    # new group and a new receiver) clears the mark its guard lifecycle still carries
    torn = rx.torn or (lc.torn if lc is not None else None)
    if torn is None or not torn.needs <= set(names):
        return
    rx.torn = None
    if lc is not None and lc.torn is not None:
        lc.clear_torn()
