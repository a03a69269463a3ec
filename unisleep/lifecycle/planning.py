"""Sleep planning: what each tag becomes, and which bytes are copied out or released.

* :func:`transitions` — for a sleep of ``level``: the awake tags to put to sleep (offloaded or
  discarded) and the corrupt or lost tags to write off as discarded; an illegal move raises
  before anything changes;
* :func:`jobs` — the backend's work for those tags: a :class:`~unisleep.driver.SaveJob` per
  allocation to back up (whole, or only its preserved parameters at level 2) and the regions to
  release without a copy;
* :func:`budget` — for a sleep told to free at least so many bytes: which of those tags, and
  which of their regions, it puts to sleep (whole tags first, in a stated order, then regions of
  the next tag), the rest staying resident at the same addresses;
* :func:`unchanged` — the allocations whose bytes equal their retained backup, proven by the
  keyed digest (their copy is skipped); :func:`proven` is that proof alone (a rollback's).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

from ..driver import SaveJob
from ..errors import BackupLostError, InvalidArgumentError, InvalidTransitionError, SleepBudgetError
from ..units import human_bytes
from .state import AWAKE, DISCARDED, LOST, OFFLOADED, Allocation, LifecycleState


def transitions(state: LifecycleState, level: int, offload: set, only: Optional[set]) -> tuple[dict, dict]:
    """``(plan, write_off)``: tag -> the state a sleep of ``level`` puts it in, for the awake
    tags (``offload`` and, at level 1, ``"weights"`` are backed up; the rest discarded), and
    the corrupt or lost tags that become discarded (no memory moves).  ``only`` limits the
    sleep to those tags."""
    plan: dict[str, str] = {}
    write_off: dict[str, str] = {}
    for tag, cur in state.tags.items():
        if only is not None and tag not in only:
            continue
        want = OFFLOADED if (tag in offload or (level == 1 and tag == "weights")) else DISCARDED
        if cur == AWAKE:
            plan[tag] = want
        elif cur == want:
            if resident(state, tag):  # regions a budgeted sleep kept resident: this sleep takes them
                plan[tag] = want
            continue
        elif want == DISCARDED and (cur == LOST or (cur == OFFLOADED and state.is_corrupt(tag))):
            write_off[tag] = DISCARDED
        elif cur == LOST:
            raise BackupLostError(
                f"tag {tag!r} is lost (its memory could not be brought back); discard it "
                f"(discard([{tag!r}])), wake it and load it again — nothing was changed.", tag=tag
            )
        else:
            raise InvalidTransitionError(
                f"tag {tag!r} is already asleep as {cur!r}; a level-{level} sleep would make it {want!r}. "
                f"Wake it first (wake_up([{tag!r}])) — nothing was changed."
            )
    return plan, write_off


def discards(state: LifecycleState, tags: list[str]) -> tuple[list[str], list[str]]:
    """``(todo, write_off)`` for ``discard(tags)``: the awake tags to release, and the lost or
    corrupt ones to write off; an offloaded tag is refused (its backup would be lost)."""
    write_off = []
    for t in tags:
        if state.tags[t] == LOST or (state.tags[t] == OFFLOADED and state.is_corrupt(t)):
            write_off.append(t)
        elif state.tags[t] == OFFLOADED:
            raise InvalidTransitionError(
                f"tag {t!r} is offloaded (its backup is kept); discarding it would lose the backup. "
                f"Wake it first — nothing was changed."
            )
    todo = [t for t in tags if state.tags[t] == AWAKE or (state.tags[t] == DISCARDED and resident(state, t))]
    return todo, write_off


def wakes(state: LifecycleState, tags: Optional[list[str]]) -> list[str]:
    """The tags ``wake_up(tags)`` brings back (None: every tag that is not awake); a lost tag
    is refused — it has to be discarded first."""
    if tags is None:
        todo = [t for t, s in state.tags.items() if s != AWAKE]
    else:
        state.check_tags(tags)
        todo = [t for t in tags if state.tags[t] != AWAKE]
    lost = [t for t in todo if state.tags[t] == LOST]
    if lost:
        raise BackupLostError(
            f"tag(s) {', '.join(map(repr, lost))} are lost (their memory could not be brought back after a "
            f"failure); discard them (discard({lost!r})), then wake them (zeros) and load them again — "
            "nothing was changed.", tag=lost[0]
        )
    return todo


def match_preserve(names: list[str], patterns: list[str]) -> list[str]:
    """The adopted ``names`` matched by the globs ``patterns``; a pattern matching nothing raises."""
    matched = []
    for p in patterns:
        hit = [n for n in names if fnmatch.fnmatchcase(n, p)]
        if not hit:
            raise InvalidArgumentError(
                f"preserve pattern {p!r} matches no adopted name; adopted names start with: "
                + ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            )
        matched += hit
    return sorted(set(matched))


def preserved_ranges(a: Allocation, patterns: list[str]) -> list[tuple[int, int]]:
    """The byte ranges of ``a`` kept across a level-2 sleep (overlaps merged): the adopted
    module buffers (``a.kept``) and the parameters that ``patterns`` match."""
    if not a.names or not (patterns or a.kept):
        return []
    spans = sorted(
        (off, n) for name, (off, n) in a.names.items()
        if name in a.kept or any(fnmatch.fnmatchcase(name, p) for p in patterns)
    )
    merged: list[list[int]] = []
    for off, n in spans:  # merge overlaps (tied names)
        if merged and off <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], off + n - merged[-1][0])
        else:
            merged.append([off, n])
    return [(o, n) for o, n in merged if n]


def split_background(state: LifecycleState, plan: dict[str, str], patterns: list[str]) -> tuple[set, dict]:
    """``(now, later)`` for a background sleep: the tags only discarded (nothing of theirs
    preserved) are released before the call returns; the others (``later``: tag -> state) are
    copied out behind it."""
    now = {t for t, want in plan.items()
           if want == DISCARDED and not any(preserved_ranges(a, patterns) for a in state.of(t))}
    return now, {t: want for t, want in plan.items() if t not in now}


def jobs(state: LifecycleState, plan: dict[str, str], patterns: list[str],
         only: Optional[set] = None) -> tuple[list[SaveJob], list]:
    """``(saves, discards)`` for the resident allocations of the tags of ``plan`` (those whose
    id is in ``only``, when given: a budgeted sleep's choice): offloaded allocations are saved
    whole (their copy skipped when a retained backup is proven equal); discarded ones keep only
    their preserved ranges, or are released outright."""
    saves, discards, offloads = [], [], []
    for a in state.all():
        want = plan.get(a.tag)
        if want is None or not a.region.mapped or (only is not None and a.id not in only):
            continue
        if want == OFFLOADED:
            offloads.append(a)
        else:
            keep = preserved_ranges(a, patterns)
            if keep:
                state.drop_backup(a)
                saves.append(SaveJob(a.id, a.region, keep))
            else:
                discards.append(a.region)
    retain = state.driver.capabilities.retain_backups
    skip = unchanged(state, offloads) if retain else set()
    for a in offloads:
        copy = a.id not in skip
        saves.append(SaveJob(a.id, a.region, [(0, a.region.size)], skip_copy=not copy, want_digest=retain and copy))
    return saves, discards


def resident(state: LifecycleState, tag: str) -> list[Allocation]:
    """The allocations of ``tag`` whose memory is mapped: every one of an awake tag; of an asleep
    tag, those a budgeted sleep kept resident (at the same addresses, bytes untouched)."""
    return [a for a in state.of(tag) if a.region.mapped]


@dataclass
class Budget:
    """What a sleep told to free at least ``asked`` bytes puts to sleep: ``plan`` (tag -> the
    state it goes to, as :func:`transitions`), ``only`` (the ids of the allocations released),
    ``moved`` and ``stayed`` (per tag: regions and bytes), ``order`` (the tags in the order
    they were considered)."""

    asked: int
    plan: dict
    only: set
    order: list
    moved: list = field(default_factory=list)
    stayed: list = field(default_factory=list)

    def detail(self, released: int) -> dict:
        """The report's account: asked, freed, what moved and what stayed resident."""
        return {"asked": self.asked, "freed": released, "order": list(self.order),
                "moved": [dict(m) for m in self.moved], "stayed": [dict(s) for s in self.stayed]}


#: the default order a budgeted sleep frees tags in, stated: tags this sleep discards (nothing
#: to copy out or back), then tags it backs up; within each, the tag holding most memory first
#: (fewest tags touched); ties in the order the tags were made
DEFAULT_ORDER = "discarded tags first, then backed-up tags; largest first within each"


def budget(state: LifecycleState, plan: dict[str, str], asked: int, order: list[str], level: int) -> Budget:
    """Choose what a sleep of ``plan`` must release to free at least ``asked`` bytes of
    physical memory (read from the driver): the tags in ``order`` first (the caller's
    priority), then the others in :data:`DEFAULT_ORDER`; a tag that holds no more than what is
    still needed goes whole, and of the first tag that holds more, regions are taken newest
    first (adoption order is use order: what stays resident is what a forward needs first)
    until the rest is met.  Raises :class:`~unisleep.errors.SleepBudgetError` (nothing
    changed) when the tags of ``plan`` hold less than ``asked``."""
    driver = state.driver
    cands = {t: [(a, a.region.physical_bytes(driver)) for a in resident(state, t)] for t in plan}
    held = {t: sum(n for _, n in v) for t, v in cands.items()}
    available = sum(held.values())
    if asked > available:
        shown = ", ".join(f"{t!r} {human_bytes(n)} ({plan[t]})" for t, n in held.items()) or "none"
        raise SleepBudgetError(
            f"sleep(level={level}, free_at_least={human_bytes(asked)}) cannot be met: the tags this sleep may put to "
            f"sleep hold {human_bytes(available)} ({shown}). Ask for less, widen tags=, or sleep without "
            "free_at_least. Nothing was changed.", asked=asked, available=available)
    made = {t: i for i, t in enumerate(state.tags)}
    default = sorted(plan, key=lambda t: (plan[t] != DISCARDED, -held[t], made[t]))
    ordered = list(order) + [t for t in default if t not in order]
    out = Budget(asked, {}, set(), ordered)
    need = asked
    for t in ordered:
        if need <= 0 or held[t] == 0:
            continue
        take = cands[t] if held[t] <= need else []
        if not take:  # regions of this tag, newest first, until the rest is met
            for a, n in reversed(cands[t]):
                if need <= 0:
                    break
                take.append((a, n))
                need -= n
        else:
            need -= held[t]
        out.plan[t] = plan[t]
        out.only |= {a.id for a, _ in take}
        out.moved.append({"tag": t, "to": plan[t], "regions": len(take), "bytes": sum(n for _, n in take)})
    for t, v in cands.items():
        rest = [(a, n) for a, n in v if a.id not in out.only]
        if rest:
            out.stayed.append({"tag": t, "state": plan[t] if t in out.plan else state.tags[t], "regions": len(rest),
                               "bytes": sum(n for _, n in rest)})
    for t in state.tags:  # the tags this sleep does not touch
        rest = resident(state, t) if t not in cands else []
        if rest:
            out.stayed.append({"tag": t, "state": state.tags[t], "regions": len(rest),
                               "bytes": sum(a.region.physical_bytes(driver) for a in rest)})
    return out


def unchanged(state: LifecycleState, allocs: list[Allocation]) -> set:
    """Ids of the allocations whose bytes equal their retained full backup, proven by the
    keyed digest under that backup's key (one batch, one device wait); those keep their
    digest (``pending_digest``).  Every other one is copied, and its save job gets a fresh
    key: the driver digests it while the copies run (:meth:`Driver.take_digests`)."""
    same = proven(state, allocs)
    for a in allocs:
        a.pending_digest = a.digest if a.id in same else None
    return same


def proven(state: LifecycleState, allocs: list[Allocation]) -> set:
    """Ids of the allocations whose bytes equal their retained full backup, proven by the keyed
    digest under that backup's key (one batch, one device wait); changes nothing."""
    driver = state.driver
    retained = [a for a in allocs if a.digest is not None and a.fully_saved and not a.corrupt]
    if not retained:
        return set()
    views = [driver.view(a.region.va, a.region.size) for a in retained]
    now = driver.keyed_digests(views, [a.digest[0] for a in retained])
    return {a.id for a, d in zip(retained, now) if d == a.digest[1]}
