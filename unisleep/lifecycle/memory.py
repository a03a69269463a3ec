"""``MemoryLifecycle``: tagged memory that sleeps (freed for real) and wakes (same addresses).

Policy, in one place, for every platform:

* level 1 — tag ``"weights"`` and any ``offload_tags`` are backed up, every other tag is discarded;
* level 2 — everything is discarded, except adopted parameters matched by :meth:`preserve`,
  the buffers of adopted modules (a rotary embedding's ``inv_freq``, as vLLM's level 2 keeps
  them) and ``offload_tags``, which are backed up at any level, e.g. a CUDA-graph pool;
* wake restores backed-up bytes exactly; discarded bytes come back as zeros; no address moves;
* an illegal move raises before anything changes.

This module is the lifecycle's face, whole: the lock, the verbs that put memory under it
(``empty``, ``adopt``, ``pool``), what it reports about itself (``state``, the byte counts,
``owns``, ``read_backup``), sleep, wake, rollback and close.  The parts they use are
:mod:`.state` (tags, allocations, backups), :mod:`.adoption`, :mod:`.planning`,
:mod:`.transaction` (sleep and wake all or nothing), :mod:`.rollback`, :mod:`.flight` and
:mod:`.progressive` (copies in flight).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from .. import graph_capture, hostmem
from ..backup import BackupStore
from ..backup_encoding import ENCODINGS
from ..driver import Driver
from ..errors import (
    InvalidArgumentError,
    LifecycleClosedError,
    LiveTensorsError,
    SleepBudgetError,
    UnisleepError,
    UnsupportedError,
)
from ..hostmem import HOST_BACKUPS, host_backups_setting
from ..registry import backend_of
from ..release_behind import release_behind_setting
from . import adoption, planning, rollback, transaction
from .flight import BackgroundSleep, Flight
from .progressive import ProgressiveWake, install_ready_hooks
from .state import (
    AWAKE, CLOSED, DISCARDED, LEVELS, LOST, OFFLOADED, Keeper, LifecycleState, Report, as_tag_list, check_tag_name, finalize,
    is_int,
)

log = logging.getLogger("unisleep")

BACKUP_TO = ("disk",)
SPILL_LAYOUTS = ("private", "flat")


def _set_encoding(store: BackupStore, value: Optional[str]) -> None:
    if value is not None and value not in store.encodings:
        raise UnsupportedError(
            f"backup_encoding={value!r}: this backup store ({store.where}) writes no encoded backups; leave "
            "backup_encoding unset (plain backups). The host backend's spill files have it.")
    store.encoding = value


def _resolve_driver(platform, device: int, options: dict) -> Driver:
    from ..platform import load_driver

    return load_driver(platform, device=device, **options)


class MemoryLifecycle:
    """Tagged memory that can sleep and wake.  See the module docstring for the policy.

    Parameters
    ----------
    platform:
        ``None`` (autodetect), a platform name, a :class:`~unisleep.platform.Platform`, or a
        ready :class:`~unisleep.driver.Driver`.
    device:
        device index on accelerators.
    host_budget_bytes:
        the most host memory (or spill space) the backups may take; ``None`` = what is free.
    spill_dir:
        host backend: where level-1 backups are written (default: a temporary directory).
    chunk_bytes:
        size of the physical chunks behind each region (mapping policy); default: the driver's.
    host_backups:
        what happens to host backups after a wake: ``"keep"`` (default) — the backup of a tag
        that comes back stays where the driver retains backups (CUDA), so an unchanged tag
        skips its copy at the next sleep, and the store keeps its room (CUDA's pinned arena
        stays registered: the next sleep copies at once); ``"release"`` — every backup of a
        woken tag is dropped and the store gives back what no backup uses (the arena's
        segments are unregistered and unmapped; spill files are removed).  ``None``: the
        ``UNISLEEP_HOST_BACKUPS`` environment variable (``keep`` / ``release``), else
        ``"keep"``.  Changeable later (:attr:`host_backups`); docs/lifecycle.md has the
        measurements behind the default.
    backup_to:
        ``None`` (default): the driver's own store — pinned host memory on accelerators, spill
        files on the host backend; ``"disk"``: spill files under ``spill_dir`` on every backend
        (accelerators copy through a host staging buffer).
    spill_layout:
        ``"private"`` (default): spill files in a private mode-0700 directory made inside
        ``spill_dir``; ``"flat"``: one file per backed-up range directly in ``spill_dir``
        (torch_memory_saver's layout; created ``O_EXCL``, mode 0600, kept open and locked while
        the backup lives; ``spill_dir`` itself must pass the same safety checks).
    release_behind:
        ``True``: a sleep returns once the memory it frees is unmapped, and its physical memory
        is released by a thread of the driver's behind the return (:mod:`unisleep.release_behind`;
        docs/benchmarks.md has the figures).  unisleep's own allocations, wakes, :meth:`resident_bytes`,
        :meth:`wait` and the driver's ``memory_info`` wait for those releases first; another
        allocator (torch's, another process) sees the memory come back over the next
        milliseconds — call :meth:`wait` before handing it on at once.  ``False`` (default):
        released before ``sleep()`` returns.  ``None``: the ``UNISLEEP_RELEASE_BEHIND``
        environment variable (``1`` = True).  Backends: cuda, host.
    backup_encoding:
        ``None`` (default): backups hold the bytes as they are; ``"planes"``: the lossless
        encoding of :mod:`unisleep.backup_encoding` — floating-point data (bf16, fp16, fp32) is
        split into an exponent plane, entropy-coded, and sign/mantissa planes, decided frame by
        frame (a frame that does not compress is stored plain), byte-exact, checksummed before
        and after decoding; the store's accounting (:meth:`backup_bytes`,
        :meth:`backup_resident_bytes`) shows the encoded bytes.  Stores that cannot write it
        refuse with :class:`~unisleep.errors.UnsupportedError` (host spill files do; see
        docs/backup-encoding.md).  Changeable later (:attr:`backup_encoding`).
    """

    def __init__(
        self,
        platform=None,
        *,
        device: int = 0,
        host_budget_bytes: Optional[int] = None,
        spill_dir: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        release_behind: Optional[bool] = None,
        host_backups: Optional[str] = None,
        backup_to: Optional[str] = None,
        spill_layout: Optional[str] = None,
        backup_encoding: Optional[str] = None,
        **driver_options: Any,
    ):
        if host_budget_bytes is not None and (not is_int(host_budget_bytes) or host_budget_bytes < 0):
            raise InvalidArgumentError(f"host_budget_bytes must be an int >= 0 (bytes) or None, got {host_budget_bytes!r}")
        if chunk_bytes is not None and (not is_int(chunk_bytes) or chunk_bytes <= 0):
            raise InvalidArgumentError(
                f"chunk_bytes must be a positive int (bytes) or None for the backend's default, got {chunk_bytes!r}"
            )
        keep = host_backups_setting(host_backups)
        if backup_to is not None and backup_to not in BACKUP_TO:
            raise InvalidArgumentError(f"backup_to must be None (the driver's own store) or 'disk', got {backup_to!r}")
        if spill_layout is not None and spill_layout not in SPILL_LAYOUTS:
            raise InvalidArgumentError(f"spill_layout must be 'private' or 'flat', got {spill_layout!r}")
        if backup_encoding is not None and backup_encoding not in ENCODINGS:
            raise InvalidArgumentError(f"backup_encoding must be None or one of {', '.join(map(repr, ENCODINGS))}, "
                                       f"got {backup_encoding!r}")
        driver = platform if isinstance(platform, Driver) else _resolve_driver(platform, device, driver_options)
        driver.configure(release_behind=release_behind_setting(release_behind, driver))
        described = backend_of(driver)
        if described is not None:  # its framework's graph captures wait for our background work
            described.watch_graphs()
        self.platform_name = driver.name
        self.device = device
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else driver.config.chunk_bytes
        self.host_budget_bytes = host_budget_bytes
        self._driver = driver
        if backup_to == "disk" or spill_layout not in (None, "private"):
            store = driver.new_file_store(host_budget_bytes, spill_dir, layout=spill_layout or "private")
        else:
            store = driver.new_backup_store(host_budget_bytes, spill_dir)
        if backup_encoding is not None:
            try:
                _set_encoding(store, backup_encoding)
            except BaseException:
                store.close()
                raise
        self._state = LifecycleState(driver, store, self.chunk_bytes)
        self._state.keep_backups = keep == "keep"
        self._lock = threading.RLock()
        self._preserve: list[str] = []
        self._torn: Optional[rollback.Torn] = None
        self._closed = False
        self._shut = threading.Event()  # set by the finalizer (close, garbage collection or exit)
        self.last_report: Optional[Report] = None
        self._before_sleep: list = []
        self._after_wake: list = []
        self._flight = Flight()  # the progressive wake or background sleep in flight
        # runs once: at close(), when the lifecycle is collected, or at interpreter exit
        # (weakref.finalize's own exit hook: no per-lifecycle atexit entry)
        self._finalizer = weakref.finalize(self, finalize, self._state, self._lock, self._shut, self._flight)
        hostmem.track(self)

    # ------------------------------------------------------------------ allocation
    def empty(self, shape, dtype=None, *, tag: str):
        """A new tensor of ``shape``/``dtype`` in lifecycle memory under ``tag`` (contents zero)."""
        shape, dtype, nbytes = adoption.shape_bytes(shape, dtype)
        with self._lock:
            self._settle()  # a progressive wake / background sleep that has ended
            self._check_can_allocate(tag)
            self._state.check_room(nbytes, tag)
            alloc = self._state.new(tag, nbytes)
            keeper = Keeper.of(alloc, self)
            t = self._driver.view(alloc.region.va, max(nbytes, 1), owner=keeper)[:nbytes]
            return keeper.attach(t.view(dtype).view(shape), self._driver)

    def adopt(self, obj, *, tag: str = "weights"):
        """Move the storage of ``obj``'s tensors into lifecycle memory, in place.

        ``obj`` may be an ``nn.Module`` (parameters and buffers), an optimizer (its state), a
        tensor, a mapping or an iterable of those.  Python objects stay the same; each tensor's
        ``data_ptr()`` changes once and then stays fixed across every sleep/wake.  Tensors that
        share a storage (tied weights, views) keep sharing it.  Returns ``obj``.

        Every tensor sharing a storage must be passed (in ``obj``) together: a view whose base is
        not passed, or a tensor whose views or aliases (a held ``state_dict()``, ``.data``,
        ``.detach()``) are not, would leave the others on the old memory, silently no longer
        sharing bytes — refused with :class:`~unisleep.errors.InvalidArgumentError`, nothing moved.
        """
        self._check_open()
        named = adoption.tensors_of(obj)
        with self._lock:
            self._settle()
            self._check_can_allocate(tag)
            packing = adoption.pack(named)
            self._state.check_room(packing.total, tag)
            new_tag = tag not in self._state.tags
            alloc = self._state.new(tag, packing.total)
            try:
                keeper = Keeper.of(alloc, self)
                base = self._driver.view(alloc.region.va, alloc.region.size, owner=keeper)
                adoption.move(packing, alloc, base, self._driver.torch_device,
                              lambda t: keeper.attach(t, self._driver))
                self._driver.synchronize()
            except BaseException as e:  # all or nothing: every tensor is back, the region is freed
                self._state.free(alloc, drop_tag=new_tag)
                if isinstance(e, UnisleepError) or not isinstance(e, Exception):
                    raise
                raise InvalidArgumentError(f"adopt() failed and was undone, nothing was moved: {e}") from e
            return obj

    @contextmanager
    def pool(self, tag: str) -> Iterator[None]:
        """Route the framework's own allocations (e.g. ``torch.empty`` on the device) into ``tag``."""
        check_tag_name(tag)
        with self._lock:
            self._check_can_allocate(tag)
        with self._driver.pool(self, tag):
            yield

    # the two calls a driver's pool makes for the framework's allocator ----------------------
    def register_region(self, tag: str, region, nbytes: int):
        """Record ``region`` (made by the driver for the framework's allocator inside
        :meth:`pool`) as an allocation of ``tag``; it then sleeps and wakes with the tag."""
        with self._lock:
            self._check_can_allocate(tag)
            return self._state.add(tag, region, nbytes, external=True)

    def forget_region(self, va: int):
        """The framework freed the region at ``va``: its records and backups are dropped and the
        region returned for the caller to free (None when unknown, or when the lifecycle is
        closed and freed it already)."""
        with self._lock:
            if self._shut.is_set():
                return None
            a = self._state.at(va)
            if a is None:
                return None
            self._state.forget(a)
            return a.region

    def on_free(self, fn) -> None:
        """Call ``fn(va, size)`` whenever an allocation's memory is given up — the framework
        freed a region of :meth:`pool` (e.g. torch emptied its cache), or :meth:`free`-like
        paths dropped it — after its records and backup are dropped.  ``fn`` runs under the
        lifecycle's lock, maybe on the allocator's thread: it must not call the lifecycle, and
        it must not raise (an error is logged)."""
        if not callable(fn):
            raise InvalidArgumentError(f"on_free() takes a function of (va, size), got {type(fn).__name__}")
        with self._lock:
            self._check_open()
            self._state.free_listeners.append(fn)

    def _check_can_allocate(self, tag: str) -> None:
        check_tag_name(tag)
        self._check_open()
        self._state.check_can_allocate(tag)

    # ------------------------------------------------------------------ what it reports about itself
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
    def backup_encoding(self) -> Optional[str]:
        """The encoding new backups are written with (None: plain bytes); setting it takes
        effect at the next sleep — backups already written keep theirs and read back the same."""
        return self._state.store.encoding

    @backup_encoding.setter
    def backup_encoding(self, value: Optional[str]) -> None:
        if value is not None and value not in ENCODINGS:
            raise InvalidArgumentError(f"backup_encoding must be None or one of {', '.join(map(repr, ENCODINGS))}, "
                                       f"got {value!r}")
        with self._lock:
            self._check_open()
            _set_encoding(self._state.store, value)

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

    # ------------------------------------------------------------------ set-up
    def preserve(self, patterns: Sequence[str] | str) -> list[str]:
        """Globs over adopted names kept across a level-2 sleep (like vLLM's
        ``--sleep-preserve-parameter-names``).  Returns the names matched; a pattern matching
        nothing raises."""
        pats = [patterns] if isinstance(patterns, str) else list(patterns)
        with self._lock:
            self._check_open()
            matched = planning.match_preserve(self.names(), pats)
            self._preserve = pats
            return matched

    def preserved_patterns(self) -> list[str]:
        """The globs given to :meth:`preserve` (empty when none): the names a level-2 sleep keeps,
        which a weight update may leave out."""
        return list(self._preserve)

    def prepare_backup(self, nbytes: Optional[int] = None, *, background: bool = True) -> int:
        """Reserve backup room ahead of the first level-1 sleep (e.g. register a pinned host
        arena while the model loads), so even the first sleep copies at full speed.  ``nbytes``
        defaults to what the "weights" tag holds now.  Returns the bytes asked for."""
        if nbytes is not None and (not is_int(nbytes) or nbytes < 0):
            raise InvalidArgumentError(
                f"prepare_backup(nbytes) takes an int >= 0 (bytes) or None for what the 'weights' tag holds, got "
                f"{nbytes!r}. Nothing was reserved."
            )
        if not isinstance(background, bool):
            raise InvalidArgumentError(f"prepare_backup(background=) must be True or False, got {background!r}")
        with self._lock:
            self._check_open()
            if not background:  # waits for the arena's growth, which waits for the capture to end
                graph_capture.refuse_if_capturing("prepare_backup(background=False)")
            if nbytes is None:
                nbytes = sum(a.region.size for a in self._state.of("weights"))
            if nbytes > 0:
                self._state.store.ensure_fits(nbytes)
                self._state.store.prepare(nbytes, background=background)
            return nbytes

    def add_hooks(self, before_sleep=None, after_wake=None) -> None:
        """Run ``before_sleep(level, tags)`` after a sleep is validated and before any memory is
        released, and ``after_wake(tags)`` once woken memory is mapped and restored.  Policies
        such as the extra cleanup (collective teardown/restore, graph recapture) plug in here."""
        with self._lock:
            self._check_open()
            if before_sleep is not None:
                self._before_sleep.append(before_sleep)
            if after_wake is not None:
                self._after_wake.append(after_wake)

    # ------------------------------------------------------------------ sleep / wake
    def sleep(
        self, level: int = 1, *, offload_tags: Optional[Iterable[str]] = None, tags: Optional[Iterable[str]] = None,
        background: bool = False, free_at_least: Optional[int] = None, free_order: Optional[Iterable[str]] = None,
    ) -> Report:
        """Release memory.  Level 1 backs up ``"weights"`` (and ``offload_tags``) and discards the
        rest; level 2 discards everything but preserved parameters, adopted modules' buffers
        and ``offload_tags``.
        ``tags`` limits the sleep to those tags (the others stay as they are); ``offload_tags``
        must then be among them.

        Transactional: all the room the backup needs is taken first; if anything fails (no
        room, ENOSPC, EIO, a read-only spill directory, a driver error, a hook raising), every
        tag is put back as it was — mapped, bytes exact — the partial backup is removed, and
        :class:`~unisleep.errors.BackupError` says what failed where.

        ``background=True`` returns as soon as the discarded tags (the KV cache) are released;
        the backed-up tags are ``"sleeping"`` while their copies finish behind the call (a worker
        thread runs the same transactional sleep for them), ``wait()`` waits for it and raises
        its error, if any (the backed-up tags are then awake again, bytes exact).

        ``free_at_least=N`` (bytes) makes it a budgeted sleep: of what this sleep would put to
        sleep (the same level, ``tags`` and ``offload_tags`` rules), only enough to free at least
        ``N`` bytes of physical memory, read from the driver — whole tags first, the tags of
        ``free_order`` first and then the rest in
        :data:`~unisleep.lifecycle.planning.DEFAULT_ORDER` (discarded tags, then backed-up ones,
        largest first), then regions of the next tag, newest first — and everything else stays
        resident at the same addresses, its bytes untouched.  A tag of which some regions went
        reads asleep (``"offloaded"``/``"discarded"``); its wake restores only what went, and a
        later sleep (budgeted or not) can take what stayed.  ``last_report.budget`` says what
        moved and what stayed.  Raises :class:`~unisleep.errors.SleepBudgetError` before
        anything changes when those tags hold less than ``N``; with ``background=True`` it is
        refused (a budgeted sleep runs in the foreground)."""
        if not is_int(level) or level not in LEVELS:
            raise InvalidArgumentError(f"sleep level must be the int 1 or 2, got {level!r}")
        if not isinstance(background, bool):
            raise InvalidArgumentError(f"background must be True or False, got {background!r}")
        if free_at_least is not None and (not is_int(free_at_least) or free_at_least < 0):
            raise InvalidArgumentError(f"free_at_least must be an int >= 0 (bytes) or None, got {free_at_least!r}")
        order = as_tag_list(free_order, "free_order") if free_order is not None else []
        if free_order is not None and free_at_least is None:
            raise SleepBudgetError("free_order= orders a budgeted sleep: pass free_at_least= (bytes) with it, or drop "
                                   "it. Nothing was changed.")
        if free_at_least is not None and background:
            raise SleepBudgetError("a budgeted sleep (free_at_least=) runs in the foreground: drop background=True, or "
                                   "free_at_least. Nothing was changed.", asked=free_at_least)
        offload = set(as_tag_list(offload_tags, "offload_tags")) if offload_tags is not None else set()
        only = set(as_tag_list(tags, "tags")) if tags is not None else None
        if only is not None and not offload <= only:
            raise InvalidArgumentError(
                f"offload_tags {sorted(offload - only)} are not among tags {sorted(only)}; add them to tags"
            )
        self._flight.refuse(only, "sleep")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("sleep()")
            self._state.check_tags(offload if only is None else only)
            self._flight.refuse(only, "sleep")
            self.state()  # an awake tag that lost its mapping is reported as lost
            plan, write_off = planning.transitions(self._state, level, offload, only)
            if free_at_least is not None:
                return self._sleep_budgeted(level, plan, write_off, free_at_least, order)
            if background:
                return self._sleep_background(level, plan, write_off)
            return self._sleep(level, plan, write_off)

    def _sleep(self, level: int, plan: dict, write_off: dict, run_hooks: bool = True, t0=None) -> Report:
        """The transactional sleep of the tags in ``plan`` (validated by :meth:`sleep`)."""
        rep = transaction.sleep(self._state, level, plan, write_off, self._preserve,
                                self._before_sleep if run_hooks else [], self._after_wake,
                                time.perf_counter() if t0 is None else t0)
        self._after_host()
        return self._done(rep)

    def _sleep_budgeted(self, level: int, plan: dict, write_off: dict, asked: int, order: list[str]) -> Report:
        """``sleep(free_at_least=asked)``: choose (:func:`~.planning.budget`), then the same
        transactional sleep of what was chosen; the report carries the account."""
        outside = [t for t in order if t not in plan]
        if outside:
            self._state.check_tags(outside)
            raise SleepBudgetError(
                f"free_order names tag(s) {', '.join(map(repr, outside))} that this sleep does not put to sleep (awake "
                f"tags it covers: {', '.join(map(repr, plan)) or 'none'}); drop them from free_order or widen tags=. "
                "Nothing was changed.", asked=asked)
        t0 = time.perf_counter()
        chosen = planning.budget(self._state, plan, asked, order, level)
        rep = transaction.sleep(self._state, level, chosen.plan, write_off, self._preserve, self._before_sleep,
                                self._after_wake, t0, only=chosen.only)
        self._after_host()
        rep.budget = chosen.detail(rep.bytes_released)
        if rep.bytes_released < asked:  # cannot happen: what is chosen is read from the driver
            rep.notes.append(f"freed {rep.bytes_released} bytes of the {asked} asked")
        return self._done(rep)

    def kept_resident(self) -> dict[str, int]:
        """Per asleep tag, the bytes that a budgeted sleep (``sleep(free_at_least=)``) kept
        resident — mapped at the same addresses, bytes untouched — read from the driver; tags
        wholly asleep are left out."""
        with self._lock:
            self._check_open()
            st = self._state
            out = {}
            for t, s in st.tags.items():
                if s in (OFFLOADED, DISCARDED):
                    n = sum(a.region.physical_bytes(self._driver) for a in planning.resident(st, t))
                    if n:
                        out[t] = n
            return out

    def _sleep_background(self, level: int, plan: dict, write_off: dict) -> Report:
        """Release the tags that are only discarded now; copy the others out behind the call."""
        st = self._state
        t0 = time.perf_counter()
        now, later = planning.split_background(st, plan, self._preserve)
        transaction.run_before_sleep(self._before_sleep, self._after_wake, level, sorted(plan))
        released = st.release(sorted(now)) + st.write_off(write_off)
        for t in write_off:
            st.tags[t] = DISCARDED
        rep = Report(f"sleep(level={level}, background)", sorted(now | set(write_off)), released, 0,
                     time.perf_counter() - t0)
        if not later:
            return self._done(rep)
        # its worker takes the lock once this returns
        self._flight.sleep_behind(st, later, self._lock, lambda p: self._sleep(level, p, {}, run_hooks=False, t0=t0))
        rep.notes.append(f"tag(s) {', '.join(map(repr, sorted(later)))} are copied out behind this call; wait() waits")
        return self._done(rep)

    def discard(self, tags: Iterable[str]) -> Report:
        """Release the memory of ``tags`` now, with no backup (e.g. the KV cache only).  An
        offloaded tag is refused (its backup would be lost) unless its backup failed
        verification or the tag is lost: then discarding it is the way out."""
        tags = as_tag_list(tags, "tags")
        self._flight.refuse(tags, "discard")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("discard()")
            st = self._state
            st.check_tags(tags)
            self._flight.refuse(tags, "discard")
            self.state()
            todo, write_off = planning.discards(st, tags)
            t0 = time.perf_counter()
            released = st.release(todo) + st.write_off(write_off)
            for t in write_off:
                st.tags[t] = DISCARDED
            self._after_host()
            return self._done(Report("discard", todo + write_off, released, 0, time.perf_counter() - t0))

    def wake_up(self, tags: Optional[Iterable[str]] = None, *, progressive: bool = False, order=None):
        """Map memory back at the same addresses: all tags, or only ``tags`` (e.g. ``["weights"]``
        then ``["kv_cache"]``).  Waking an awake tag is a no-op.

        ``progressive=True`` returns at once with a :class:`~unisleep.lifecycle.progressive.ProgressiveWake`:
        the tags are ``"waking"`` while a worker maps and restores them piece by piece in the
        order the model uses them (adoption order, or first the tensors of ``order``, a list of
        modules or tensors); :meth:`ready` (or the hooks of :meth:`install_ready_hooks`) makes
        the caller's work wait for the pieces it needs, :meth:`wait` for all of them.

        Backups are verified before their bytes are exposed: a tag whose backup fails (corrupt,
        truncated or missing spill file) is left ``"offloaded"`` with its memory unmapped and
        :class:`~unisleep.errors.BackupCorruptError` is raised after the other tags are woken."""
        if not isinstance(progressive, bool):
            raise InvalidArgumentError(f"progressive must be True or False, got {progressive!r}")
        if tags is not None:
            tags = as_tag_list(tags, "tags")
        self._flight.refuse(tags, "wake_up")
        with self._lock:
            self._check_open()
            graph_capture.refuse_if_capturing("wake_up()")
            self._driver.wait_releases()  # a failed release behind the last sleep: raised before any change
            self._flight.refuse(tags, "wake_up")
            self._settle()
            st = self._state
            todo = planning.wakes(st, tags)
            t0 = time.perf_counter()
            if progressive:
                return self._flight.wake(self, st, todo, order, t0)
            copied, woken, failures = transaction.wake(st, todo)
            if woken:
                for hook in self._after_wake:
                    hook(None if (tags is None and not failures) else list(woken))
            self._after_host()
            rep = self._done(Report("wake_up", woken, 0, copied, time.perf_counter() - t0))
            if failures:
                raise transaction.first_failure(failures)
            return rep

    # ------------------------------------------------------------------ rollback of a write, torn weights
    def restore_point(self, tags: Optional[Iterable[str]] = None) -> Optional[rollback.RestorePoint]:
        """Before writing ``tags`` (default ``["weights"]``) in place: a point to roll them back to
        — their retained level-1 backups, proven by keyed digest to equal their memory now
        (:mod:`.rollback`) — or None where they have none (the backend retains no backups, the
        tag never slept at level 1 or slept at level 2, backups are released after a wake, or
        the memory was written since).  Costs one digest pass over the tags' memory."""
        tags = as_tag_list(tags if tags is not None else ["weights"], "tags")
        with self._lock:
            self._check_open()
            self._state.check_tags(tags)
            return rollback.take_point(self._state, tags)

    def roll_back(self, point: rollback.RestorePoint) -> int:
        """Put the memory of ``point`` back as it was when the point was taken, byte-exact
        (proven by the keyed digest afterwards); returns the bytes restored.  Raises
        :class:`~unisleep.errors.BackupLostError` when a backup of the point was dropped or
        renewed meanwhile (nothing is written then)."""
        self._flight.refuse(list(point.tags), "roll_back")
        with self._lock:
            self._check_open()
            return rollback.roll_back(self._state, point)

    def mark_written(self, tags: Optional[Iterable[str]] = None) -> None:
        """The memory of ``tags`` (default ``["weights"]``) was written in place (a weight update
        applied part or all of itself): their retained level-1 backups hold older bytes and are
        dropped — the next :meth:`restore_point` and the next sleep's unchanged check then know
        it without a digest pass.  A later level-1 sleep backs the new bytes up."""
        tags = as_tag_list(tags if tags is not None else ["weights"], "tags")
        with self._lock:
            self._check_open()
            self._state.check_tags(tags)
            rollback.written(self._state, tags)

    def mark_torn(self, *, version: Any, previous: Any, names: Sequence[str] = (), why: str = "",
                  needs: Iterable[str] = ()) -> None:
        """Record that the weights are torn (an update wrote part of ``version`` — ``names`` — and
        the previous one could not be restored; ``needs``: what a repairing update must cover):
        :meth:`check_serving` refuses until :meth:`clear_torn`.  Sleep and wake stay allowed."""
        self._torn = rollback.Torn(version, previous, tuple(names), why, frozenset(needs))

    def clear_torn(self) -> None:
        """A complete update arrived: the weights serve again."""
        self._torn = None

    @property
    def torn(self) -> Optional[rollback.Torn]:
        """What :meth:`mark_torn` recorded (None: the weights are whole)."""
        return self._torn

    def check_serving(self) -> None:
        """Raise :class:`~unisleep.errors.TornWeightsError` (naming the incomplete version and the
        fix) while the weights are torn; call it before generating from or reading them."""
        torn = self._torn
        if torn is not None:
            raise torn.error("MemoryLifecycle")

    # ------------------------------------------------------------------ copies in flight
    def ready(self, obj) -> None:
        """Make the caller's later work wait until the tensors of ``obj`` (a module, a tensor,
        or a list of tensors) are restored by the progressive wake in flight; a no-op when none
        is (or it does not hold them).  Accelerators: the current stream waits on the device
        (the host thread does not block); host: blocks until the bytes are read back and
        verified.  Takes no lock: call it from the forward pass."""
        if self.closed:
            self._check_open()
        op = self._flight.op
        if isinstance(op, ProgressiveWake):
            op.ready(obj)

    def install_ready_hooks(self, model) -> list:
        """Install a forward pre-hook on every module of ``model`` holding tensors of its own,
        calling :meth:`ready` for them, so a forward pass right after a progressive wake waits,
        layer by layer, for that layer's bytes only (a no-op when no wake is in flight).
        Returns the handles (``h.remove()``)."""
        self._check_open()
        return install_ready_hooks(self, model)

    def wait(self) -> Optional[Report]:
        """Wait for the progressive wake or background sleep in flight, settle its tags and
        return its report (also when it already ended and was settled by another call; None
        when there is nothing to wait for); with ``release_behind``, also wait until the memory
        the last sleep freed is released.  Raises its error, if it failed:
        a failed progressive wake leaves its tags asleep as before (memory unmapped), a failed
        background sleep leaves its tags awake with their bytes (or lost, as a plain sleep)."""
        self._check_open()
        self._flight.wait_copies()
        self._driver.wait_releases()  # memory released behind the last sleep is back
        with self._lock:
            self._settle(block=True)
            rep, err = self._flight.take()
            if err is not None:
                raise err
            return rep

    def _settle(self, block: bool = False) -> Optional[Report]:
        """Under the lock: settle the tags of copies in flight that are complete (:class:`Flight`)."""
        rep = self._flight.settle(self._state, self._after_wake, block)
        if rep is not None and rep.operation == "wake_up(progressive)":
            self._after_host()
            self._done(rep)
        return rep

    # ------------------------------------------------------------------ close
    def close(self, *, strict: bool = False) -> None:
        """Free every region and backup.  Idempotent; also runs when the lifecycle is collected
        and at interpreter exit.

        Tensors handed out by :meth:`empty`/:meth:`adopt` keep the lifecycle alive, so it is
        never collected under them.  ``close()`` while some of them are still referenced frees
        the memory anyway (and logs which tags were live), but the address ranges of those
        tensors stay reserved and inaccessible until they die: touching one faults
        (SIGSEGV on the host, an illegal-address error on a device) instead of reading or
        corrupting memory that a later allocation got.  ``close(strict=True)`` refuses instead,
        with :class:`~unisleep.errors.LiveTensorsError` listing the live tags.  A progressive
        wake or background sleep in flight is waited for first."""
        if not self._closed:
            self._flight.wait_copies()
        with self._lock:
            if self._closed:
                return
            live = self.live_tags()
            if live and strict:
                raise LiveTensorsError(
                    f"tensors of tag(s) {', '.join(map(repr, live))} are still referenced; drop them (del, or let "
                    "them go out of scope) before close(strict=True), or call close(): their memory is then freed "
                    "and their addresses stay reserved and inaccessible until they die. Nothing was changed."
                )
            if live:
                log.info("close(): tensors of tag(s) %s are still referenced; their addresses stay fenced "
                         "(inaccessible) until they die", ", ".join(live))
            self._closed = True
            self._finalizer()

    def live_tags(self) -> list[str]:
        """Tags with tensors (from :meth:`empty`/:meth:`adopt`) still referenced somewhere."""
        with self._lock:
            return self._state.live_tags()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _done(self, rep: Report) -> Report:
        self.last_report = rep
        log.info("%s", rep)
        return rep

    def _check_open(self) -> None:
        if self._closed or self._shut.is_set():
            raise LifecycleClosedError(
                "this MemoryLifecycle is closed (close(), garbage collection or interpreter exit): its memory was "
                "released and every tag reads 'closed'. Create a new MemoryLifecycle; nothing was touched."
            )
