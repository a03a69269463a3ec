"""Undo a weight write from the lifecycle's retained level-1 backup, and the torn mark.

A backend that retains backups after a wake (``Capabilities.retain_backups``: CUDA always, the
host backend with ``retain_backups=True``) still holds, once the weights are woken, a full copy
of their bytes as they were at the last level-1 sleep — the copy a writer of the weights (a
streaming weight update) can roll back to if it fails part-way, without a second copy of its own.

* :func:`take_point` — before the write: the retained backups of the tags, each proven by its
  keyed digest to equal the memory *now* (:func:`~.planning.proven`); None when some allocation
  of the tags has no such backup (never slept at level 1, a level-2 sleep, backups released,
  bytes changed since the wake).  The proof has to come first: once the write has started the
  memory no longer equals the backup and nothing could show that it did before.
* :func:`written` — after a write that changed the memory (an update applied, or torn): the
  retained backups of the tags hold older bytes; they are dropped, so the next point (one per
  update: OpenRLHF sends one tensor per update) and the next sleep's unchanged check find none
  at once instead of digesting the memory to learn it.  A failed proof drops them the same way.
* :func:`roll_back` — after a failed write: the memory of the point's allocations is loaded from
  those same backups (checked first to be still recorded, unchanged, for all of them: nothing is
  written otherwise) and then proven equal to them by the same keyed digests.
* the torn mark (:class:`Torn`): a write that failed part-way and could not be rolled back;
  :meth:`Torn.error` is the :class:`~unisleep.errors.TornWeightsError` every read refuses with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import BackupCorruptError, BackupLostError, TornWeightsError
from . import planning
from .state import AWAKE, LifecycleState


@dataclass(frozen=True)
class RestorePoint:
    """The retained backups of ``tags`` proven equal to their memory when the point was taken:
    ``(allocation id, its digest record)`` per allocation.  Valid while those backups stay
    recorded with the same digest (a sleep, an eviction or ``host_backups="release"`` ends it)."""

    tags: tuple
    entries: tuple
    nbytes: int


@dataclass(frozen=True)
class Torn:
    """Weights an update wrote in part: ``version`` is incomplete, ``previous`` was served
    before it, ``names`` were (or may have been) overwritten, ``why`` what broke the update,
    ``needs`` the tensors a later update must cover to make the weights whole again (the torn
    update's own; empty: any complete update)."""

    version: Any
    previous: Any
    names: tuple = field(default_factory=tuple)
    why: str = ""
    needs: frozenset = field(default_factory=frozenset)

    def error(self, where: str = "the engine") -> TornWeightsError:
        """The error a read of these weights raises; ``where`` names who refuses."""
        shown = ", ".join(self.names[:6]) + (f" and {len(self.names) - 6} more" if len(self.names) > 6 else "")
        return TornWeightsError(
            f"{where}: the weights are torn: the update to version {self.version!r} failed part-way ({self.why}) after "
            f"overwriting {len(self.names)} tensor(s) ({shown or 'names not known'}), and version {self.previous!r} "
            "could not be restored (no retained level-1 backup held it). Send a complete update (the whole "
            f"version {self.version!r} or a newer one): it clears this. Nothing was generated or read.",
            version=self.version, previous=self.previous, names=list(self.names))


def take_point(state: LifecycleState, tags: Sequence[str]) -> Optional[RestorePoint]:
    """A :class:`RestorePoint` for the allocations of ``tags``, or None (see the module)."""
    if not state.driver.capabilities.retain_backups or not state.keep_backups:
        return None
    if any(state.tags.get(t) != AWAKE for t in tags):
        return None
    allocs = state.of(*tags)
    if not allocs or not all(a.digest is not None and a.fully_saved and not a.corrupt
                             and state.store.has((a.id, 0)) for a in allocs):
        return None
    same = planning.proven(state, allocs)
    if same != {a.id for a in allocs}:
        for a in allocs:  # written since the backup was taken: older bytes, not to be proven again
            if a.id not in same:
                state.drop_backup(a)
        return None
    return RestorePoint(tuple(tags), tuple((a.id, a.digest) for a in allocs), sum(a.region.size for a in allocs))


def written(state: LifecycleState, tags: Sequence[str]) -> None:
    """The memory of ``tags`` was written in place: drop the retained backups of their awake
    allocations (they hold the bytes from before the write)."""
    for a in state.of(*tags):
        if a.saved and state.tags.get(a.tag) == AWAKE:
            state.drop_backup(a)


def roll_back(state: LifecycleState, point: RestorePoint) -> int:
    """Load the memory of ``point``'s allocations from their backups and prove it equal to them;
    returns the bytes restored.  Raises :class:`~unisleep.errors.BackupLostError` (a backup is no
    longer the point's: nothing was written) or :class:`~unisleep.errors.BackupCorruptError` (the
    restored bytes fail the digest)."""
    allocs = []
    for aid, rec in point.entries:
        a = state.get(aid)
        if (a is None or a.digest is not rec or not a.fully_saved or not state.store.has((a.id, 0))
                or state.tags.get(a.tag) != AWAKE):
            raise BackupLostError(
                f"the retained backup of tag {a.tag if a is not None else point.tags[0]!r} changed or was dropped "
                "since the update began (a sleep, an eviction, or host_backups='release'); nothing was restored",
                tag=a.tag if a is not None else None)
        allocs.append(a)
    store, driver = state.store, state.driver
    store.flush()
    for a in allocs:
        store.load((a.id, 0), driver.view(a.region.va, a.region.size))
    store.flush()
    driver.synchronize()
    ok = planning.proven(state, allocs)
    bad = [a for a in allocs if a.id not in ok]
    if bad:
        raise BackupCorruptError(
            f"the weights restored from the retained backup of tag {bad[0].tag!r} fail its keyed digest",
            tag=bad[0].tag)
    return point.nbytes
