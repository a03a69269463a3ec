"""Graph captures and unisleep's background device work never overlap in one process.

A graph capture in the default *global* mode is invalidated when any thread of the process makes
a potentially unsafe driver call while it runs (page-locking host memory, a synchronize, a
blocking copy, releasing memory…): the captured work then fails and the framework's
``capture_end`` raises — with torch, an assertion in its caching allocator that aborts the
process.  unisleep does device work behind its callers: the backup arena grown while the model
loads, releases behind a sleep's return, the copies of a progressive wake or of a background
sleep.  So one process-wide gate orders them:

* :func:`capture` is held around every graph capture: it first lets queued work finish that the
  capture itself could need or that would otherwise stall inside it (:func:`add_drainer`: releases
  behind a sleep, which the pool's first allocation waits for; the steps of a progressive wake; a
  background sleep), then waits until no background call is in progress, and holds off new ones
  until the capture ends;
* :func:`background` is held by unisleep's own threads around each piece of device work; it waits
  while a capture is underway.  On the capturing thread itself it does not wait (that thread's
  work is part of its capture).

Captures are seen where they begin: :func:`watch` wraps a graph class's ``capture_begin`` and
``capture_end`` (a lifecycle watches the graph class its backend's descriptor names, on every
platform, before any background work can start), so a capture by any code of the process — vLLM's, the user's — goes through the gate, not
only captures into unisleep's pools.  unisleep's own capture contexts hold :func:`capture` as well.

Lifecycle verbs that touch the device (sleep, wake, discard) called on a thread that is capturing
are refused before anything changes (:func:`refuse_if_capturing`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

from .errors import InvalidTransitionError

log = logging.getLogger("unisleep.capture")

#: a capture waiting longer than this for background calls to return is logged (it keeps waiting)
SLOW_WAIT_S = 5.0


class _Gate:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.captures = 0  # captures underway or waiting for background calls to return
        self.busy = 0  # background device calls in progress
        self.capturing: dict[int, int] = {}  # thread ident -> capture depth
        self.drainers: list = []  # weak references to callables

    def reset_after_fork(self) -> None:
        """In a child made by ``fork()``: no capture and no background call came along."""
        self.cond = threading.Condition()
        self.captures = self.busy = 0
        self.capturing = {}


_GATE = _Gate()


def add_drainer(fn: Callable[[], None]) -> None:
    """Call ``fn()`` (a bound method, held weakly) before every capture begins: it waits for the
    queued work of its owner that the capture could need (e.g. releases the pool's first
    allocation would wait for).  Exceptions are logged, not raised into the capture."""
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda f=fn: f)
    with _GATE.cond:
        _GATE.drainers = [r for r in _GATE.drainers if r() is not None] + [ref]


def _drain() -> None:
    with _GATE.cond:
        fns = [r() for r in _GATE.drainers]
    for fn in fns:
        if fn is None:
            continue
        try:
            fn()
        except Exception as e:  # the owner raises it again where it is waited for
            log.debug("draining %r before a capture: %s", fn, e)


def capturing_here() -> bool:
    """Whether the calling thread is inside a capture that went through the gate."""
    return _GATE.capturing.get(threading.get_ident(), 0) > 0


def underway() -> bool:
    """Whether a capture is underway (or about to begin) anywhere in the process."""
    return _GATE.captures > 0


def _enter_capture() -> None:
    tid = threading.get_ident()
    gate = _GATE
    if gate.capturing.get(tid, 0):  # nested on this thread: already through the gate
        with gate.cond:
            gate.capturing[tid] += 1
            gate.captures += 1
        return
    _drain()
    with gate.cond:
        # no preference for the capture while it waits: a background call in progress may wait
        # for another one (a background sleep for the arena's growth) that must still get in
        t0 = time.monotonic()
        warned = False
        while gate.busy:
            gate.cond.wait(timeout=SLOW_WAIT_S)
            if gate.busy and not warned and time.monotonic() - t0 >= SLOW_WAIT_S:
                warned = True
                log.warning("a graph capture has waited %.0f s for unisleep's background device work to "
                            "return (%d call(s) in progress)", time.monotonic() - t0, gate.busy)
        gate.captures += 1
        gate.capturing[tid] = 1


def _exit_capture() -> None:
    tid = threading.get_ident()
    with _GATE.cond:
        depth = _GATE.capturing.get(tid, 0)
        if depth <= 0:
            return
        if depth == 1:
            del _GATE.capturing[tid]
        else:
            _GATE.capturing[tid] = depth - 1
        _GATE.captures -= 1
        _GATE.cond.notify_all()


@contextmanager
def capture() -> Iterator[None]:
    """Hold the gate for a capture: background device work waits until this block ends."""
    _enter_capture()
    try:
        yield
    finally:
        _exit_capture()


@contextmanager
def background() -> Iterator[None]:
    """Hold around one piece of device work done behind the caller: waits while a capture is
    underway (except on the capturing thread itself), and a capture waits for it to return."""
    gate = _GATE
    if gate.capturing.get(threading.get_ident(), 0):
        yield
        return
    with gate.cond:
        while gate.captures:
            gate.cond.wait()
        gate.busy += 1
    try:
        yield
    finally:
        with gate.cond:
            gate.busy -= 1
            gate.cond.notify_all()


@contextmanager
def background_unless_capturing() -> Iterator[bool]:
    """:func:`background` that never waits: yields False at once (and holds nothing) when a
    capture is underway, so work that can be done later (giving host memory back) is skipped
    instead of blocking a caller that may hold a lock the capture needs; yields True while
    holding the gate otherwise.  On the capturing thread itself it yields False."""
    gate = _GATE
    with gate.cond:
        if gate.captures or gate.capturing.get(threading.get_ident(), 0):
            ok = False
        else:
            gate.busy += 1
            ok = True
    try:
        yield ok
    finally:
        if ok:
            with gate.cond:
                gate.busy -= 1
                gate.cond.notify_all()


def refuse_if_capturing(what: str) -> None:
    """Raise :class:`~unisleep.errors.InvalidTransitionError` when the calling thread is capturing
    a graph: ``what`` (a sleep, a wake…) would synchronise the device and unmap or map memory the
    captured work may use, which invalidates the capture."""
    if capturing_here():
        raise InvalidTransitionError(
            f"{what} was called while this thread is capturing a graph: it would synchronise the device "
            "and invalidate the capture. Call it before the capture begins or after it ends; nothing was changed"
        )


_WATCHED = "_unisleep_capture_gate"


def watch(graph_cls) -> bool:
    """Route every capture of ``graph_cls`` (a framework's graph class with ``capture_begin`` and
    ``capture_end`` methods defined in Python, e.g. torch's) through the gate.  Idempotent;
    returns False (and leaves the class alone) where the methods cannot be wrapped."""
    if graph_cls is None or getattr(graph_cls, _WATCHED, False):
        return graph_cls is not None
    begin = getattr(graph_cls, "capture_begin", None)
    end = getattr(graph_cls, "capture_end", None)
    if not inspect.isfunction(begin) or not inspect.isfunction(end):
        log.debug("%r defines no capture_begin/capture_end in Python: its captures are not watched", graph_cls)
        return False

    @functools.wraps(begin)
    def capture_begin(self, *args, **kwargs):
        _enter_capture()
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _exit_capture()
            raise

    @functools.wraps(end)
    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            _exit_capture()

    try:
        graph_cls.capture_begin = capture_begin
        graph_cls.capture_end = capture_end
        setattr(graph_cls, _WATCHED, True)
    except (TypeError, AttributeError) as e:  # a class that refuses new attributes
        log.debug("cannot watch the captures of %r: %s", graph_cls, e)
        return False
    return True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _GATE.reset_after_fork())
