"""Releasing a sleep's physical memory behind its return (``MemoryLifecycle(release_behind=True)``).

Giving device memory back costs the driver per byte, far more than unmapping the same memory
(docs/benchmarks.md has the figures).  With ``release_behind`` a sleep unmaps what it frees (the
addresses stay reserved; nothing can touch the memory any more), hands the handles to one
thread of the driver's and returns; that thread releases them in order.

The memory is back by the time anything *of unisleep* needs it: the driver's ``create`` (every
wake and every new region) and ``memory_info`` wait for the releases still queued, and so do
``MemoryLifecycle.resident_bytes``, ``wait`` and ``close``.  Another allocator — torch's in this
process, or another process — sees the memory come back over the next milliseconds; a caller that must hand the memory on at once calls
``lc.wait()`` first, or keeps the default (release before returning).

A release that fails behind the return is raised, as :class:`ReleaseBehindError`, by the next
call that waits for the queue.

Releases never run while a graph is being captured (:mod:`unisleep.graph_capture`): a capture
first waits for the queue to empty, and releases queued during a capture wait for it to end.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Optional

from . import graph_capture
from .errors import InvalidArgumentError, UnisleepError

log = logging.getLogger("unisleep.release_behind")


ENV = "UNISLEEP_RELEASE_BEHIND"


def release_behind_setting(asked: Optional[bool], driver) -> bool:
    """Whether a lifecycle on ``driver`` releases behind its sleeps: ``asked`` (True/False), or
    for None the ``UNISLEEP_RELEASE_BEHIND`` environment variable (``1`` = True).  True for a
    driver without release behind is refused (:class:`~unisleep.errors.InvalidArgumentError`);
    from the variable, set for a whole fleet, it is ignored with a warning."""
    from_env = asked is None
    if from_env:
        env = os.environ.get(ENV, "").strip()
        if env not in ("", "0", "1"):
            raise InvalidArgumentError(f"{ENV} must be 0 or 1, got {env!r}")
        asked = env == "1"
    if not isinstance(asked, bool):
        raise InvalidArgumentError(f"release_behind must be True, False or None, got {asked!r}")
    if asked and not driver.capabilities.supports_release_behind:
        if not from_env:
            raise InvalidArgumentError(
                f"release_behind=True is not supported by the {driver.name} backend; leave it False")
        log.warning("%s=1 is ignored: the %s backend releases memory before sleep() returns", ENV, driver.name)
        return False
    return asked


class ReleaseBehindError(UnisleepError):
    """Releasing memory behind a sleep's return failed (the handles named stay held)."""


class ReleaseBehind:
    """One driver's release thread: :meth:`submit` queues handles (already unmapped),
    :meth:`wait` waits until every queued handle is released."""

    def __init__(self, driver):
        self._driver = driver
        self._cond = threading.Condition()
        self._queue: list = []
        self._busy = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.released_bytes = 0
        _INSTANCES.add(self)
        graph_capture.add_drainer(self.drain)

    def _forget_after_fork(self) -> None:
        """In a child made by ``fork()``: no release thread came along, and its lock may have
        been held at the fork.  The queued handles are the parent's to release (the child's
        copies, e.g. host file descriptors, go when the child exits); nothing is left to wait for."""
        self._cond = threading.Condition()
        self._queue, self._busy, self._thread = [], False, None

    def submit(self, handles: list) -> None:
        if not handles:
            return
        with self._cond:
            self._queue.extend(handles)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="unisleep-release-behind", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def pending(self) -> bool:
        with self._cond:
            return bool(self._queue) or self._busy

    def drain(self) -> None:
        """Wait until every queued release is done (a failure stays for :meth:`wait` to raise)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def wait(self) -> None:
        """Wait for every queued release; raise the first that failed (once)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()
            err, self._error = self._error, None
        if err is not None:
            raise ReleaseBehindError(
                f"releasing {self._driver.name} memory behind a sleep's return failed: {type(err).__name__}: {err}. "
                "The handles that failed are still held; MemoryLifecycle(release_behind=False) releases before "
                "sleep() returns, where such an error is raised by the sleep itself"
            ) from err

    def _run(self) -> None:
        try:
            self._driver.prepare_thread()
        except BaseException as e:  # every release below would fail the same way
            log.debug("release thread set-up failed: %s", e)
        while True:
            with self._cond:
                while not self._queue:
                    if not self._cond.wait(timeout=30.0) and not self._queue:
                        self._thread = None  # idle: the next submit starts a new thread
                        return
                batch, self._queue = self._queue, []
                self._busy = True
            for h in batch:
                n = self._driver.physical_bytes(h)
                try:
                    hook = self._driver.hooks.release
                    if hook is not None:
                        hook(h)
                    with graph_capture.background():
                        self._driver.release(h)
                except BaseException as e:  # kept: wait() raises it (ReleaseBehindError) to the next caller
                    log.error("releasing %d bytes behind a sleep failed: %s", n, e)
                    with self._cond:
                        if self._error is None:
                            self._error = e
                else:
                    with self._cond:
                        self.released_bytes += n
            with self._cond:
                self._busy = False
                self._cond.notify_all()


_INSTANCES: "weakref.WeakSet[ReleaseBehind]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for rb in list(_INSTANCES):
        rb._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
