"""Sleep and wake as transactions: all the room is taken first, and a failure is rolled back.

* :func:`sleep` backs up and releases the tags of a plan; if anything fails, :func:`undo_sleep`
  puts every region back as it was (mapped, bytes exact from the complete backup) or marks its
  tag lost, and removes the partial backup;
* :func:`wake` wakes tags in one pass, and on a failure tag by tag, so one bad backup keeps
  only its own tag asleep;
* :func:`failed_wake` unmaps what a failed wake mapped (nothing unverified is exposed) and
  remembers a corrupt backup;
* :func:`backup_error` names what failed, where, and the state every tag is left in.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

import time

from ..driver import RestoreJob, _Trace
from ..errors import BackupCorruptError, BackupError, BackupLostError
from ..units import human_bytes
from . import planning
from .state import AWAKE, LOST, LifecycleState, Report

log = logging.getLogger("unisleep")


def run_hooks_quietly(hooks: list[Callable], tags: list, why: str) -> None:
    """Run ``after_wake`` hooks to undo what ``before_sleep`` hooks did; a hook failing here is
    logged (the error being handled is the one that counts)."""
    for hook in hooks:
        try:
            hook(tags)
        except Exception as e:  # pragma: no cover
            log.error("after_wake hook failed %s: %s", why, e)


def sleep(state: LifecycleState, level: int, plan: dict, write_off: dict, patterns: list[str],
          before_sleep: list[Callable], after_wake: list[Callable], t0: float,
          only: Optional[set] = None) -> Report:
    """Put the tags of ``plan`` to sleep (tag -> offloaded or discarded) and write off the tags
    of ``write_off``, all or nothing (``only``: the ids of the allocations to put to sleep, a
    budgeted sleep's choice; the others stay resident): the backup's room is checked and reserved first, then the
    ``before_sleep`` hooks run and the driver backs up and releases; a failure is undone
    (:func:`undo_sleep`, ``after_wake`` hooks for the hooks that ran) and raised as a
    :class:`~unisleep.errors.BackupError` saying what failed where — a ``KeyboardInterrupt`` or
    ``SystemExit`` is undone the same way and raised as itself."""
    driver = state.driver
    tr = _Trace("sleep")
    saves, discards = planning.jobs(state, plan, patterns, only)
    tr.mark("plan + unchanged check")
    need = sum(n for j in saves if not j.skip_copy for _, n in j.ranges)
    retained = sum(n for j in saves if j.skip_copy for _, n in j.ranges)
    for job in saves:  # a retained backup of bytes that changed since is stale: its room
        if not job.skip_copy and state.get(job.key).saved:  # counts for the new one
            state.drop_backup(state.get(job.key))
    # another process's sleep into the same room checks after this one reserved (nothing to take: no turn)
    with state.store.room_lock() if need else contextlib.nullcontext():
        try:
            state.ensure_backup_fits(need, keep_ids={j.key for j in saves})
        except BaseException:
            state.forget_pending_digests(saves)
            raise
        try:
            reserved = state.reserve_backups(saves)
        except BaseException as e:
            state.forget_pending_digests(saves)
            if not isinstance(e, Exception):  # Ctrl-C, SystemExit: themselves, not a backup failure
                raise
            raise backup_error(state, e, saves, "sleep") from e
    tr.mark("reserve")
    hooks_ran = False
    try:
        for hook in before_sleep:
            hooks_ran = True
            hook(level, sorted(plan))
        if not driver.capabilities.digests_during_copies:
            driver.take_digests(saves)
        released, copied = driver.suspend(saves, discards, state.store)
        tr.mark("suspend")
    except BaseException as e:
        undo_sleep(state, saves, discards, reserved)
        if hooks_ran:
            run_hooks_quietly(after_wake, sorted(plan), "while undoing a sleep")
        state.forget_pending_digests(saves)
        if (isinstance(e, BackupError) and e.tag is not None) or not isinstance(e, Exception):
            raise  # (Ctrl-C, SystemExit: undone as any failure, and raised as themselves)
        raise backup_error(state, e, saves, "sleep") from e
    for job in saves:
        a = state.get(job.key)
        a.saved = list(job.ranges)
        a.digest = (job.digest_key, job.digest) if job.digest is not None else a.pending_digest
        a.pending_digest = None
        a.corrupt = False
    for region in discards:
        state.drop_backup(state.at(region.va))
    released += state.write_off(write_off)
    for tag, new in {**plan, **write_off}.items():
        state.tags[tag] = new
    rep = Report(f"sleep(level={level})", sorted({**plan, **write_off}), released, copied, time.perf_counter() - t0)
    kept = driver.last_sleep_kept
    if kept:  # e.g. ROCm keeping address reservations it could not safely give back
        rep.notes.append(
            f"{human_bytes(kept.get('bytes', 0))} in {kept.get('regions', '?')} region(s) not returned to the "
            f"device: {kept.get('reason', 'the backend kept them')}"
        )
    if retained:
        log.debug("skipped copying %d unchanged bytes", retained)
    tr.mark("bookkeeping")
    tr.done(copied)
    return rep


def run_before_sleep(hooks: list[Callable], undo: list[Callable], level: int, tags: list[str]) -> None:
    """Run the ``before_sleep`` hooks ahead of a sleep that has released nothing yet; if one
    fails, the ``undo`` (``after_wake``) hooks run and :class:`~unisleep.errors.BackupError`
    is raised: every tag is as it was."""
    ran = False
    try:
        for hook in hooks:
            ran = True
            hook(level, tags)
    except BaseException as e:
        if ran:
            run_hooks_quietly(undo, tags, "while undoing a sleep")
        if not isinstance(e, Exception):
            raise
        raise BackupError(f"sleep(background=True) failed before anything was released: {type(e).__name__}: "
                          f"{e}. Every tag is as it was.", cause=e) from e


def undo_sleep(state: LifecycleState, saves, discards, reserved: list) -> None:
    """Put every region of a failed sleep back as it was: remap what was released and read
    its bytes back from the (complete) backup; remove the partial backup.  A region that
    cannot be brought back exactly marks its tag lost."""
    driver, store = state.driver, state.store
    lost: set[str] = set()
    try:
        store.flush()
    except BaseException:  # undoing: the error being undone is raised by the caller; a copy that
        pass  # did not complete shows below as a region not brought back (its tag marked lost)
    for job in saves:
        a = state.get(job.key)
        region = job.region
        released = [c for c in region.chunks if c.handle is None]
        if not released:
            continue
        full = job.ranges == [(0, region.size)]
        try:
            region.map(driver)
            if not full:
                raise BackupLostError(f"a partly saved region of tag {a.tag!r} was released")
            for c in released:
                store.load_range((job.key, 0), c.offset, driver.view(region.va + c.offset, c.size))
            store.flush()
            driver.synchronize()
        except BaseException as e:  # pragma: no cover - needs a second failure during the undo
            log.error("could not bring back tag %r after a failed sleep: %s", a.tag, e)
            lost.add(a.tag)
    for region in discards:
        if not region.mapped:
            try:
                region.map(driver)
                if not driver.capabilities.fresh_memory_is_zero:
                    driver.zero(region.va, region.size)
            except BaseException:  # pragma: no cover
                pass
            lost.add(state.at(region.va).tag)  # discarded bytes are gone
    for key in reserved:
        store.drop(key)
    for tag in lost:
        state.tags[tag] = LOST


def backup_error(state: LifecycleState, e: BaseException, saves, what: str) -> BackupError:
    """The error a failed sleep raises: what it was backing up, where, why, and every tag's state."""
    tags = sorted({state.get(j.key).tag for j in saves if state.get(j.key) is not None})
    nbytes = sum(n for j in saves if not j.skip_copy for _, n in j.ranges)
    lost = sorted(t for t, s in state.tags.items() if s == LOST)
    path = getattr(e, "path", None) or getattr(e, "filename", None)
    outcome = (
        f"tag(s) {', '.join(map(repr, lost))} could not be restored and are marked lost"
        if lost
        else "nothing was released: every tag is as it was (mapped, bytes exact) and the partial backup was removed"
    )
    cause = str(e) if isinstance(e, BackupError) else f"{type(e).__name__}: {e}"
    where = "" if (path and path in cause) else (f" to {path}" if path else f" ({state.store.where})")
    msg = (
        f"{what} failed while backing up {human_bytes(nbytes)} of tag(s) {', '.join(map(repr, tags)) or '-'}"
        f"{where}: {cause}. {outcome[0].upper() + outcome[1:]}."
    )
    return (BackupLostError if lost else BackupError)(msg, tag=(lost or tags or [None])[0], nbytes=nbytes, path=path,
                                                      cause=e)


def failed_wake(state: LifecycleState, tag: str, allocs: list, e: BaseException) -> BackupError:
    """A wake of ``tag`` failed: unmap what it mapped so nothing unverified is exposed and
    the tag stays asleep; a corrupt backup is remembered (the tag may then be discarded)."""
    try:
        for a in allocs:
            a.region.release(state.driver)
    except BaseException as e2:  # pragma: no cover
        log.error("could not unmap tag %r after a failed wake: %s", tag, e2)
        state.tags[tag] = LOST
    if isinstance(e, BackupCorruptError):
        for a in allocs:
            if a.saved:
                a.corrupt = True
        return BackupCorruptError(
            f"tag {tag!r} was not woken: {e}. It stays {state.tags[tag]!r} with its memory unmapped; discard it "
            f"(discard([{tag!r}]) or sleep(level=2)), then wake it (zeros) and load the weights again, e.g. by a "
            "weight transfer.", tag=tag, nbytes=e.nbytes, path=e.path, cause=e,
        )
    return BackupError(
        f"tag {tag!r} was not woken: {type(e).__name__}: {e}. It stays {state.tags[tag]!r}; wake it again "
        "once the cause is fixed.", tag=tag, cause=e,
    )


def wake(state: LifecycleState, todo: list[str]) -> tuple[int, list[str], list[BackupError]]:
    """Map ``todo``'s memory back and restore it: ``(bytes copied, tags woken, failures)``.
    One pass over every tag (the backend overlaps restores and mapping); if it fails, what it
    mapped is unmapped and the tags are tried one by one, so only the bad ones stay asleep
    (each with its :func:`failed_wake` error); a tag is marked awake as soon as it is mapped,
    restored and verified."""
    driver, store = state.driver, state.store
    # regions a budgeted sleep kept resident hold their bytes: not restored, never unmapped here
    by_tag = {tag: [a for a in state.of(tag) if not a.region.mapped] for tag in todo}

    def jobs_of(tags):
        return [RestoreJob(a.id, a.region, list(a.saved), zero=not a.fully_saved) for t in tags for a in by_tag[t]]

    copied, woken, failures = 0, [], []
    groups, retry = [todo], False
    try:
        copied += driver.resume(jobs_of(todo), store)
    except BaseException as e:  # an interrupt ends the wake; any failure of the one pass: tag by tag
        if not isinstance(e, Exception):
            failed_wake(state, ",".join(todo), [a for t in todo for a in by_tag[t]], e)
            raise
        for a in (a for t in todo for a in by_tag[t]):  # unmap what that pass mapped, then tag by tag
            a.region.release(driver)
        groups, copied, retry = [[t] for t in todo], 0, True
    for group in groups:
        if retry:
            tag = group[0]
            try:
                copied += driver.resume(jobs_of(group), store)
            except BaseException as e:  # recorded, the next tag tried; an interrupt ends the wake
                failures.append(failed_wake(state, tag, by_tag[tag], e))
                if not isinstance(e, Exception):
                    raise
                continue
        for tag in group:
            for a in by_tag[tag]:
                state.restored(a)
            state.tags[tag] = AWAKE  # mapped, restored and verified
            woken.append(tag)
    return copied, woken, failures


def first_failure(failures: list[BackupError]) -> Optional[BackupError]:
    """The first of ``failures``, its message naming the other tags that failed too."""
    if not failures:
        return None
    first = failures[0]
    if len(failures) > 1:
        first.args = (str(first) + f" (also failed: {', '.join(f.tag for f in failures[1:])})",)
    return first
