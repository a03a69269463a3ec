"""What a :class:`~unisleep.lifecycle.memory.MemoryLifecycle` reports about itself: its
state per tag, resident, allocated and backup bytes, the host backups' policy, ownership of an
address range and reads of a backup — the read-only half of the lifecycle, as its base class
(the verbs and the lock stay in :mod:`.memory`)."""

from __future__ import annotations

import logging
from typing import Optional

from ..driver import BackupStore, Driver
from ..errors import InvalidArgumentError
from ..hostmem import HOST_BACKUPS
from .flight import BackgroundSleep
from .state import AWAKE, CLOSED, LOST

log = logging.getLogger("unisleep")


class LifecycleIntrospection:
    """The introspection of :class:`~unisleep.lifecycle.memory.MemoryLifecycle` (see the module)."""

    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def torch_device(self):
        return self._driver.torch_device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the lifecycle was finalized at garbage collection or
        interpreter exit): every tag then reads ``"closed"`` and every verb raises
        :class:`~unisleep.errors.LifecycleClosedError`."""
        return self._closed or self._shut.is_set()

    def state(self) -> dict[str, str]:
        """Each tag's state: ``"awake"``, ``"offloaded"``, ``"discarded"`` or ``"lost"`` (and
        ``"waking"`` / ``"sleeping"`` while a progressive wake / background sleep copies it;
        ``"closed"`` for every tag once the lifecycle is closed).  An awake tag is checked
        against what the driver holds: one whose memory is not all mapped is reported (and
        recorded) as ``"lost"``, never as awake."""
        tags = self._state.tags
        if self.closed:
            return {t: CLOSED for t in list(tags)}
        with self._lock:
            if self.closed:
                return {t: CLOSED for t in tags}
            self._settle()
            for tag in [t for t, s in tags.items() if s == AWAKE]:
                if not all(a.region.mapped for a in self._state.of(tag)):
                    log.error("tag %r was recorded awake but its memory is not mapped: marked lost", tag)
                    tags[tag] = LOST
            return dict(tags)

    @property
    def is_sleeping(self) -> bool:
        """Some tag is not awake; a closed lifecycle raises
        :class:`~unisleep.errors.LifecycleClosedError` (it is neither awake nor asleep)."""
        with self._lock:
            self._check_open()
            return any(s != AWAKE for s in self._state.tags.values())

    @property
    def tags(self) -> list[str]:
        with self._lock:
            return list(self._state.tags)

    def resident_bytes(self, tag: Optional[str] = None) -> int:
        """Physical bytes the backend holds now, read from the backend (not from bookkeeping);
        memory still being released behind a sleep's return (``release_behind``) is waited for."""
        self._check_open()
        self._driver.wait_releases()
        op = self._flight.op
        if isinstance(op, BackgroundSleep) and not op.done:  # its copies hold the lock: read without it
            return self._state.resident_bytes(tag, racing=True)
        with self._lock:
            self._check_open()
            return self._state.resident_bytes(tag)

    def allocated_bytes(self, tag: Optional[str] = None) -> int:
        """Bytes reserved for allocations (awake or not), rounded up to the granularity."""
        with self._lock:
            self._check_open()
            return sum(a.region.size for a in self._state.all() if tag in (None, a.tag))

    def backup_bytes(self) -> int:
        """Bytes of backups the store holds now (their sizes; :meth:`backup_resident_bytes`
        says where they lie and what the store holds beyond them)."""
        return self._state.store.held_bytes

    def backup_resident_bytes(self) -> dict[str, int]:
        """What the backup store holds now, read from the store's memory and files:
        ``{"pinned", "pageable", "disk", "held"}`` — page-locked host memory (CUDA's arena:
        every registered segment, used by a backup or kept for the next sleep), ordinary host
        memory (spill files on a RAM file system), disk (spill files), and the bytes of the
        backups themselves.  With ``host_backups="release"`` the first three fall to what
        asleep tags still need once a wake returns."""
        self._check_open()
        op = self._flight.op
        if isinstance(op, BackgroundSleep) and not op.done:  # its copies hold the lock: read without it
            for _ in range(10):
                try:
                    return self._residency()
                except RuntimeError:  # the store's records changed under the read: read again
                    continue
        with self._lock:
            self._check_open()
            return self._residency()

    def _residency(self) -> dict[str, int]:
        store = self._state.store
        out = {k: int(v) for k, v in store.residency().items()}
        out["held"] = int(store.held_bytes)
        return out

    @property
    def host_backups(self) -> str:
        """``"keep"`` or ``"release"``: what happens to host backups after a wake (see the
        class docstring).  Set it to change the policy from the next wake on; setting
        ``"release"`` does not give anything back by itself (:meth:`release_host_backups`
        does)."""
        return "keep" if self._state.keep_backups else "release"

    @host_backups.setter
    def host_backups(self, value: str) -> None:
        if value not in HOST_BACKUPS:
            raise InvalidArgumentError(f"host_backups must be 'keep' or 'release', got {value!r}")
        with self._lock:
            self._check_open()
            self._state.keep_backups = value == "keep"

    def release_host_backups(self) -> int:
        """Give host memory back now, whatever :attr:`host_backups` says: drop the backups
        retained for awake tags (their next sleep copies again) and let the store give back
        what no backup uses (CUDA: unregister and unmap the arena's free segments).  Backups
        of tags that sleep stay.  Returns the bytes the store gave back (0 where it keeps
        nothing beyond its backups, as the host backend's spill files)."""
        with self._lock:
            self._check_open()
            self._settle()
            self._state.drop_retained()
            return self._state.give_back_host()

    def _after_host(self) -> None:
        """Under the lock, at the end of a wake, discard or sleep: with ``host_backups="release"``
        the store gives back what no backup uses any more."""
        if not self._state.keep_backups:
            self._state.give_back_host()

    @property
    def backup_store(self) -> BackupStore:
        """The driver's backup store of this lifecycle (e.g. the host's spill files under
        ``backup_store.dir``); read it, do not change it."""
        return self._state.store

    def owns(self, ptr: int, nbytes: int, tag: Optional[str] = None) -> bool:
        """``[ptr, ptr + nbytes)`` lies inside one allocation of this lifecycle (of ``tag``)."""
        with self._lock:
            return self._state.containing(ptr, nbytes, tag) is not None

    def read_backup(self, ptr: int, out) -> bool:
        """Copy the backed-up bytes at ``[ptr, ptr + out.numel())`` into the host uint8 tensor
        ``out`` (e.g. to read weights while they sleep); False when that memory has no full
        backup held (never backed up, discarded, or not retained after a wake)."""
        with self._lock:
            self._check_open()
            a = self._state.containing(ptr, out.numel())
            store = self._state.store
            if a is None or not a.fully_saved or not store.has((a.id, 0)):
                return False
            store.flush()
            store.load_range((a.id, 0), ptr - a.region.va, out)
            store.flush()
            return True

    def names(self, tag: Optional[str] = None) -> list[str]:
        with self._lock:
            return [n for a in self._state.all() if tag in (None, a.tag) for n in a.names]
