"""What a lifecycle holds: the state of each tag, its allocations (indexed by id, address and
tag) and what each allocation has in the backup store.

:class:`LifecycleState` is the one shared piece under every other part of the lifecycle
(adoption, planning, rollback, copies in flight); it takes no lock — the lifecycle calls it
under its own.  The argument checks every verb shares live here too.
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..backup import BackupStore
from ..driver import Driver
from ..errors import (
    CopyInFlightError,
    HostBudgetError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidTransitionError,
    UnknownTagError,
)
from ..region import Region
from ..units import human_bytes

log = logging.getLogger("unisleep")

AWAKE, OFFLOADED, DISCARDED, LOST = "awake", "offloaded", "discarded", "lost"
WAKING, SLEEPING = "waking", "sleeping"  # a progressive wake / background sleep is copying
CLOSED = "closed"  # every tag of a closed lifecycle (its memory is released)
LEVELS = (1, 2)


@dataclass
class Report:
    """What the last operation did."""

    operation: str
    tags: list[str]
    bytes_released: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # what the backend wants said (e.g. memory it kept)
    #: a budgeted sleep's account (``sleep(free_at_least=)``): ``{"asked", "freed", "order",
    #: "moved": [{"tag", "to", "regions", "bytes"}], "stayed": [{"tag", "state", "regions",
    #: "bytes"}]}`` — what it put to sleep and what stayed resident at the same addresses
    budget: Optional[dict] = None

    @property
    def gbps(self) -> float:
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "operation": self.operation,
            "tags": list(self.tags),
            "bytes_released": self.bytes_released,
            "bytes_copied": self.bytes_copied,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "notes": list(self.notes),
            "budget": None if self.budget is None else dict(self.budget),
        }

    def __str__(self) -> str:
        return (
            f"{self.operation} {','.join(self.tags) or '-'}: released {human_bytes(self.bytes_released)}, "
            f"copied {human_bytes(self.bytes_copied)} in {self.seconds * 1e3:.1f} ms"
            + (f" ({self.gbps:.1f} GB/s)" if self.bytes_copied else "")
            + "".join(f"; {n}" for n in self.notes)
            + (self._budget_text() if self.budget is not None else "")
        )

    def _budget_text(self) -> str:
        b = self.budget
        moved = ", ".join(f"{m['tag']} {m['regions']} region(s) {human_bytes(m['bytes'])} {m['to']}" for m in b["moved"])
        stayed = ", ".join(f"{s['tag']} {s['regions']} region(s) {human_bytes(s['bytes'])}" for s in b["stayed"])
        return (f"; asked to free {human_bytes(b['asked'])}: moved {moved or 'nothing'}; stayed resident "
                f"{stayed or 'nothing'}")


@dataclass
class Allocation:
    id: int
    tag: str
    region: Region
    nbytes: int  # bytes in use (<= region.size)
    names: dict[str, tuple[int, int]] = field(default_factory=dict)  # adopted name -> (offset, nbytes)
    kept: set[str] = field(default_factory=set)  # adopted names kept across level 2 (a module's buffers)
    saved: list[tuple[int, int]] = field(default_factory=list)  # ranges in the backup now
    digest: Any = None  # (HashKey, Digest) of the retained full backup (skip-unchanged)
    external: bool = False  # created by the framework's allocator through pool()
    pending_digest: Any = None  # (HashKey, Digest) taken by the sleep in progress
    corrupt: bool = False  # the backup failed verification on wake
    keeper: Any = None  # weakref to the Keeper that every handed-out tensor of this allocation holds

    @property
    def fully_saved(self) -> bool:
        """The backup holds the whole region."""
        return self.saved == [(0, self.region.size)]


class Keeper:
    """Held by the storage of every tensor that ``empty``/``adopt`` hand out: it keeps the
    lifecycle (so its memory) alive while any such tensor lives, and tells ``close()`` which
    allocations are still in use."""

    __slots__ = ("lifecycle", "__weakref__")

    def __init__(self, lifecycle):
        self.lifecycle = lifecycle

    @staticmethod
    def of(alloc: Allocation, lifecycle) -> "Keeper":
        """The keeper of ``alloc``, made when no live tensor holds one."""
        keeper = alloc.keeper() if alloc.keeper is not None else None
        if keeper is None:
            keeper = Keeper(lifecycle)
            alloc.keeper = weakref.ref(keeper)
        return keeper

    def attach(self, t, driver: Driver):
        """Make ``t`` hold this keeper where the driver's views cannot carry it themselves
        (``views_hold_owner``): as an attribute of the tensor.  Returns ``t``."""
        if not driver.capabilities.views_hold_owner:
            try:
                t._unisleep_keeper = self
            except (AttributeError, RuntimeError):
                pass
        return t


class LifecycleState:
    """The driver, the backup store, each tag's state and the allocations of one lifecycle."""

    def __init__(self, driver: Driver, store: BackupStore, chunk_bytes: Optional[int]):
        self.driver = driver
        self.store = store
        self.chunk_bytes = chunk_bytes
        #: host backups after a wake: kept (True: the driver may retain a full backup, and the
        #: store its room) or released (False: dropped, and the store gives its memory back)
        self.keep_backups = True
        self.tags: dict[str, str] = {}  # tag -> AWAKE, OFFLOADED, ...
        self._ids = itertools.count(1)
        self._by_id: dict[int, Allocation] = {}
        self._by_va: dict[int, Allocation] = {}
        self._by_tag: dict[str, list[Allocation]] = {}
        #: called as ``fn(va, size)`` when an allocation's records and backup are dropped
        #: (see ``MemoryLifecycle.on_free``)
        self.free_listeners: list = []

    # ---- allocations ----------------------------------------------------------------------
    def all(self) -> list[Allocation]:
        """Every allocation, oldest first."""
        return list(self._by_id.values())

    def get(self, alloc_id: int) -> Optional[Allocation]:
        return self._by_id.get(alloc_id)

    def at(self, va: int) -> Optional[Allocation]:
        """The allocation whose region starts at ``va``."""
        return self._by_va.get(va)

    def of(self, *tags: str) -> list[Allocation]:
        """The allocations of ``tags``, tag by tag, oldest first in each."""
        return [a for t in tags for a in self._by_tag.get(t, ())]

    def containing(self, ptr: int, nbytes: int, tag: Optional[str] = None) -> Optional[Allocation]:
        """The allocation (of ``tag``) that ``[ptr, ptr + nbytes)`` lies inside."""
        for a in self.of(tag) if tag is not None else self._by_id.values():
            if a.region.va <= ptr and ptr + nbytes <= a.region.va + max(a.nbytes, 1):
                return a
        return None

    def add(self, tag: str, region: Region, nbytes: int, external: bool = False) -> Allocation:
        """Record ``region`` as a new allocation of ``tag`` (a new tag starts awake)."""
        a = Allocation(next(self._ids), tag, region, nbytes, external=external)
        self._by_id[a.id] = a
        self._by_va[region.va] = a
        self._by_tag.setdefault(tag, []).append(a)
        self.tags.setdefault(tag, AWAKE)
        return a

    def new(self, tag: str, nbytes: int) -> Allocation:
        """A new region of ``nbytes`` (zeroed) recorded under ``tag``."""
        region = Region.allocate(self.driver, nbytes, self.chunk_bytes)
        if not self.driver.capabilities.fresh_memory_is_zero:
            self.driver.zero(region.va, region.size)
        return self.add(tag, region, nbytes)

    def forget(self, a: Allocation) -> None:
        """Drop ``a`` from the records and its backup from the store (its memory is the caller's)."""
        self._by_id.pop(a.id, None)
        self._by_va.pop(a.region.va, None)
        same = self._by_tag.get(a.tag, [])
        if a in same:
            same.remove(a)
        self.drop_backup(a)
        for fn in list(self.free_listeners):
            try:
                fn(a.region.va, a.region.size)
            except Exception as e:  # a listener never breaks a free
                log.error("a free listener failed for the region at %#x: %s", a.region.va, e)

    def free(self, a: Allocation, drop_tag: bool) -> None:
        """Forget ``a`` and free its region; with ``drop_tag``, a tag left empty goes too."""
        self.forget(a)
        try:
            a.region.free(self.driver)
        finally:
            if drop_tag and not self._by_tag.get(a.tag):
                self.tags.pop(a.tag, None)
                self._by_tag.pop(a.tag, None)

    # ---- backups --------------------------------------------------------------------------
    def drop_backup(self, a: Allocation) -> None:
        for off, _ in a.saved:
            self.store.drop((a.id, off))
        a.saved = []
        a.digest = None

    def is_corrupt(self, tag: str) -> bool:
        return any(a.corrupt for a in self.of(tag))

    def ensure_backup_fits(self, need: int, keep_ids: set[int]) -> None:
        """Room for ``need`` more bytes of backup; retained backups of awake memory (which only
        speed up the next sleep) are evicted first when the store is full."""
        if need <= 0:
            return
        try:
            self.store.ensure_fits(need)
            return
        except HostBudgetError:
            pass
        for a in self.all():
            if a.saved and self.tags.get(a.tag) == AWAKE and a.id not in keep_ids:
                self.drop_backup(a)
        self.store.ensure_fits(need)

    def reserve_backups(self, saves) -> list:
        """Take the room of every backup ``saves`` will write; on failure give it all back and
        re-raise.  Returns the keys reserved."""
        reserved = []
        try:
            for job in saves:
                if job.skip_copy:
                    continue
                for off, n in job.ranges:
                    self.store.reserve((job.key, off), n)
                    reserved.append((job.key, off))
        except BaseException:
            for key in reserved:
                self.store.drop(key)
            raise
        return reserved

    def forget_pending_digests(self, saves) -> None:
        for job in saves:
            a = self.get(job.key)
            if a is not None:
                a.pending_digest = None

    def restored(self, a: Allocation) -> None:
        """``a``'s bytes are back and verified: its backup is dropped unless backups are kept
        after a wake and the driver retains it (a full backup with its digest); a failure of
        that bookkeeping never makes the restored memory look asleep — it is logged, the backup
        stays recorded."""
        try:
            if not (self.keep_backups and a.fully_saved and self.driver.capabilities.retain_backups
                    and a.digest is not None):
                self.drop_backup(a)
        except Exception as e:  # the wake succeeded; a store's failure to drop is logged, not the wake's
            log.warning("tag %r is awake (its bytes were restored and verified), but dropping its backup failed: "
                        "%s: %s; the backup stays recorded", a.tag, type(e).__name__, e)

    def drop_retained(self) -> int:
        """Drop the backups retained for awake memory (they only speed up the next sleep);
        returns their bytes."""
        dropped = 0
        for a in self.all():
            if a.saved and self.tags.get(a.tag) == AWAKE:
                dropped += sum(n for _, n in a.saved)
                self.drop_backup(a)
        return dropped

    def give_back_host(self) -> int:
        """Give back what the store holds beyond its backups (best effort: a failure is logged);
        returns the bytes given back."""
        try:
            return self.store.release_unused()
        except Exception as e:  # best effort after a wake: the memory stays with the store
            log.warning("giving back the backup store's unused host memory failed: %s: %s", type(e).__name__, e)
            return 0

    def release(self, tags: list[str]) -> int:
        """Release the memory of awake ``tags`` with no backup: they are discarded.  Returns the
        bytes released."""
        released, _ = self.driver.suspend([], [a.region for a in self.of(*tags)], self.store)
        for a in self.of(*tags):
            self.drop_backup(a)
        for t in tags:
            self.tags[t] = DISCARDED
        return released

    def write_off(self, tags: Iterable[str]) -> int:
        """Corrupt or lost ``tags`` become discarded: their backups are dropped and what is
        still mapped is released.  Returns the bytes released."""
        released = 0
        for a in self.of(*tags):
            released += a.region.release(self.driver)
            self.drop_backup(a)
            a.corrupt = False
        return released

    # ---- checks shared by the verbs (nothing changes when one raises) ----------------------
    def check_tags(self, tags: Iterable[str]) -> None:
        unknown = [t for t in tags if t not in self.tags]
        if unknown:
            known = ", ".join(repr(t) for t in self.tags) or "none yet"
            raise UnknownTagError(f"unknown tag(s) {', '.join(map(repr, unknown))}; known tags: {known}")

    def check_can_allocate(self, tag: str) -> None:
        check_tag_name(tag)
        st = self.tags.get(tag, AWAKE)
        if st in (WAKING, SLEEPING):
            raise CopyInFlightError(
                f"tag {tag!r} is {st} (its copies are in flight); call wait() before allocating into it. "
                "Nothing was allocated."
            )
        if st != AWAKE:
            raise InvalidTransitionError(
                f"tag {tag!r} is asleep ({st}); wake it (wake_up([{tag!r}])) before allocating into it"
            )

    def check_room(self, nbytes: int, tag: str) -> None:
        """Refuse, before anything is committed, an allocation larger than the free memory."""
        if nbytes <= 0:
            return
        self.driver.wait_releases()  # its error is raised, not taken for "cannot tell"
        try:
            free, total = self.driver.memory_info()
        except Exception:  # a backend that cannot tell: let the allocation itself fail
            return
        if free and nbytes > free:
            raise InsufficientMemoryError(
                f"{human_bytes(nbytes)} asked for tag {tag!r}, but only {human_bytes(free)} of "
                f"{human_bytes(total)} {self.driver.name} memory is free. Ask for less, or free memory "
                "first (e.g. sleep another lifecycle). Nothing was allocated."
            )

    # ---- the end --------------------------------------------------------------------------
    def free_all(self, exiting: bool) -> None:
        """Free every allocation (best effort).  One whose tensors are still referenced keeps
        its address reserved and inaccessible until the last of them dies (its memory is
        released now); a segment the framework's allocator holds keeps its address until the
        allocator frees it; at interpreter exit everything else goes."""
        for a in self.all():
            keeper = a.keeper() if a.keeper is not None else None
            try:
                if a.external:
                    # the framework's allocator still holds this segment (pool(), whole-process
                    # capture): its memory goes now, its address when the allocator frees the
                    # segment (the pool's or the capture's free hook) — never before, or a new
                    # reservation could take the same address while torch still knows the old
                    # block there; at exit the process takes it
                    a.region.release(self.driver)
                elif keeper is None or exiting:
                    a.region.free(self.driver)
                else:  # live tensors point here: free the memory, keep the addresses fenced
                    a.region.release(self.driver)
                    weakref.finalize(keeper, _free_address, self.driver, a.region.va, a.region.size)
            except Exception:  # best effort at shutdown
                pass
        self._by_id.clear()
        self._by_va.clear()
        self._by_tag.clear()

    def resident_bytes(self, tag: Optional[str] = None, racing: bool = False) -> int:
        """Physical bytes the driver holds for the allocations (of ``tag``), read from the
        driver.  ``racing``: a background sleep releases chunks while this reads (without the
        lock): a chunk released under the read counts as released."""
        if tag is not None:
            self.check_tags([tag])
        if not racing:
            return sum(a.region.physical_bytes(self.driver) for a in self.all() if tag in (None, a.tag))
        total = 0
        for a in self.all():
            if tag in (None, a.tag):
                for c in list(a.region.chunks):
                    h = c.handle
                    try:
                        total += self.driver.physical_bytes(h) if h is not None else 0
                    except OSError:  # released under us
                        pass
        return total

    def live_tags(self) -> list[str]:
        """Tags with tensors (from ``empty``/``adopt``) still referenced somewhere."""
        return sorted({a.tag for a in self.all() if a.keeper is not None and a.keeper() is not None})


def finalize(state: LifecycleState, lock, shut, flight) -> None:
    """A lifecycle's finalizer: free everything once — at close(), garbage collection or
    interpreter exit.  At exit another (daemon) thread may be inside sleep/wake (``lock``) or
    copying (``flight``): wait for it instead of freeing memory under it; ``shut`` is set, so
    later calls raise "closed"."""
    op = flight.op
    if op is not None:  # a progressive wake's worker maps and copies without the lock
        try:
            op.wait_queued(60)
        except Exception:  # pragma: no cover
            pass
    locked = lock.acquire(timeout=60)
    exiting = sys.is_finalizing()
    try:
        shut.set()
        driver = state.driver
        try:
            driver.synchronize()
        except Exception:  # shutting down: a device already gone must not stop the frees below
            pass
        try:
            driver.wait_releases()
        except Exception as e:  # best effort at shutdown
            log.warning("%s", e)
        state.free_all(exiting)
        try:
            state.store.close()
        finally:
            driver.close()
    finally:
        if locked:
            lock.release()


def _free_address(driver, va: int, size: int) -> None:
    try:
        driver.free_address(va, size)
    except Exception:  # pragma: no cover - best effort once the last tensor died
        pass


# ---- argument checks ------------------------------------------------------------------------
def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_tag_name(tag) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"tag must be a non-empty string, got {tag!r}")


def as_tag_list(tags, what: str = "tags") -> list[str]:
    if isinstance(tags, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a list of tags, not the string {tags!r}: write [{tags!r}]")
    try:
        out = list(tags)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a list of tag names, got {tags!r}") from None
    for t in out:
        check_tag_name(t)
    return out
