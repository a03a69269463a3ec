"""The data channel's listening socket (gloo's), guarded against other users of this machine.

gloo's tcp transport gives every rank one listening socket and pairs whoever first sends the
sequence number a pair expects.  Every connection its listener accepts stays open until the
channel is destroyed — one that sends nothing, or another number, and even one that was closed
(the read of its number keeps the socket: gloo ``transport/tcp/listener.cc`` and ``helpers.h``) —
and gloo ends the process (``gloo::EnforceNotMet … listener.cc accept: Too many open files``) when
``accept`` fails for want of descriptors.  Nothing in torch's API limits who connects.
:class:`ListenerGuard`, run by a member while its data channel connects and proves itself:

* :meth:`claim` — as this rank publishes its gloo address through the channel's bootstrap store,
  before gloo waits for anyone — finds this rank's listener: a listening TCP socket of this
  process, new since the guard started, whose address (``sockaddr`` port and address, as the kernel
  lays them out) is in what this rank published; a server that something else in the process
  opened meanwhile is never touched;
* every :data:`SWEEP_S` seconds it counts the connections gloo accepted there.  A member makes at
  most one per pair; more than :data:`FLOOD_AFTER` beyond that is a flood (``flooded``), named once
  the channel is made.  It is not sealed at once: a member's connection still on its way would
  then time out, and gloo answers that by ending the process (``pair.cc``,
  ``Pair::signalException``: an exception signalled twice, tried on 2026-12-03 with torch 2.13.0).
  The listener is open only from the moment every member arrived to connect until the pairs are
  made (milliseconds), so what a flood holds is what it opens in that window;
* :meth:`seal` — once the channel's connections are made — attaches a socket filter that drops
  every packet arriving at the listener (``SO_ATTACH_FILTER`` with ``ret #0``): from then on nobody
  can connect to it at all (a connection attempt goes unanswered), while the connections already
  made are untouched (a socket accepted before keeps the filter its listener had then: none);
* :meth:`strangers` names, from ``/proc/net/tcp{,6}``, the uids at the other end of the connections
  it accepted that are not members' (for the intrusion's message).

What it cannot do: connections from another machine have no uid here (the pair's proof refuses
them); before :meth:`seal` a stranger can take a pair (the proof names it, and the update fails with
``IntrusionError``, its weights never sent) — docs/security.md.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from typing import Iterable, Optional

from .netinfo import tcp_table, user_name

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
#: one classic BPF instruction, BPF_RET | BPF_K with k = 0: keep 0 bytes of every packet (drop it)
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)
SWEEP_S = 0.002
#: connections accepted beyond one per pair before the listener is sealed as flooded
FLOOD_AFTER = 16


def _socket_fds() -> dict[str, int]:
    """inode → descriptor of every socket this process holds."""
    out = {}
    base = "/proc/self/fd"
    for fd in os.listdir(base):
        try:
            link = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[link[8:-1]] = int(fd)
    return out


def published(ip: str, port: int, blobs: Iterable[bytes]) -> bool:
    """Whether ``ip:port`` is in one of the values this rank published (its gloo address): the
    port then the address of a ``sockaddr_in``, or the port, 4 bytes of flow information and the
    address of a ``sockaddr_in6``."""
    head = struct.pack("!H", port)
    six = ":" in ip
    addr = socket.inet_pton(socket.AF_INET6 if six else socket.AF_INET, ip)
    at = 6 if six else 2
    for b in blobs:
        i = b.find(head)
        while i >= 0:
            if b[i + at: i + at + len(addr)] == addr:
                return True
            i = b.find(head, i + 1)
    return False


def _on_fd(fd: int, inode: str, fn):
    """``fn(socket)`` on a duplicate of ``fd`` if it still is the socket ``inode`` (the number may
    have been closed and reused since it was listed); None when it is not.  ``fn``'s own
    ``OSError`` is raised."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if str(os.fstat(dup).st_ino) != inode:
            os.close(dup)
            return None
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with s:  # closes the duplicate only
        return fn(s)


def drop_all(s: socket.socket) -> bool:
    """Attach the drop-everything filter to a listening socket (no new connection reaches it)."""
    prog = ctypes.create_string_buffer(_DROP_ALL, len(_DROP_ALL))
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", 1, ctypes.addressof(prog)))
    return True


class ListenerGuard:
    """Guards the listener this rank publishes through ``blobs`` (the values the bootstrap store
    wrote for this rank) while a data channel of ``world_size`` members connects."""

    def __init__(self, allowed_uids: Iterable[int], blobs: list, world_size: int):
        self.allowed = set(allowed_uids) | {os.getuid()}
        self.blobs = blobs
        self.limit = (world_size - 1) + FLOOD_AFTER
        self.flooded = False
        self.sealed: list[str] = []
        self.seal_error: Optional[str] = None
        self._before = set(_socket_fds())
        self._mine: dict[str, tuple[str, int]] = {}  # inode -> (ip, port) of this rank's listener
        self._accepted: dict[str, tuple] = {}  # inode -> (ours, theirs) of each connection it accepted
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="unisleep-transfer-listener-guard")
        self._thread.start()

    @property
    def ports(self) -> set[int]:
        return {p for _ip, p in self._mine.values()}

    @property
    def accepted(self) -> int:
        return len(self._accepted)

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - /proc unreadable: the proof still guards the channel
                pass

    def claim(self, _value=None) -> None:
        """This rank published its address: find its listener (see the module's text)."""
        with self._lock:
            fds = _socket_fds()
            new = {ino for ino in fds if ino not in self._before and ino not in self._seen}
            if not new:
                return
            for la, lp, _ra, _rp, st, _uid, ino in tcp_table():
                if st == "LISTEN" and ino in new and ino not in self._mine and published(la, lp, list(self.blobs)):
                    self._mine[ino] = (la, lp)

    def sweep(self) -> None:
        """Count the connections this rank's listener accepted; seal it when they are a flood."""
        with self._lock:
            if not self._mine or self.flooded:
                return
            fds = _socket_fds()
            addrs = set(self._mine.values())
            for ino, fd in fds.items():
                if ino in self._before or ino in self._seen or ino in self._mine:
                    continue
                self._seen.add(ino)
                try:
                    names = _on_fd(fd, ino, lambda s: (s.getsockname()[:2], s.getpeername()[:2]))
                except OSError:
                    continue
                if names and (names[0][0], names[0][1]) in addrs:
                    self._accepted[ino] = names
            if len(self._accepted) > self.limit:
                self.flooded = True  # named once the channel is made; sealing now would time out a
                # member's connection still on its way, which gloo answers by ending the process
                # (pair.cc, Pair::signalException: an exception signalled twice)

    def _seal_locked(self) -> None:
        fds = _socket_fds()
        for ino, (ip, port) in self._mine.items():
            if ino in fds and ino not in self.sealed:
                try:
                    if _on_fd(fds[ino], ino, drop_all):
                        self.sealed.append(ino)
                except OSError as e:
                    self.seal_error = f"{ip}:{port}: {e}"

    def seal(self) -> None:
        """The channel's connections are made: no one else may connect to its listener."""
        with self._lock:
            self._seal_locked()

    def strangers(self) -> list[str]:
        """``uid 65534 (nobody) from 127.0.0.1:40112 to port 36755 (and 311 more)`` for the accepted
        connections whose other end is a local socket of a uid that is not a member's."""
        with self._lock:
            accepted = list(self._accepted.values())
        if not accepted:
            return []
        owner = {(la, lp, ra, rp): uid for la, lp, ra, rp, _st, uid, _ino in tcp_table()}
        by_uid: dict[int, list] = {}
        for ours, theirs in accepted:
            uid = owner.get((theirs[0], theirs[1], ours[0], ours[1]))
            if uid is not None and uid not in self.allowed:
                by_uid.setdefault(uid, []).append((ours, theirs))
        out = []
        for uid, conns in by_uid.items():
            (ours, theirs) = conns[0]
            more = f" (and {len(conns) - 1} more)" if len(conns) > 1 else ""
            out.append(f"{user_name(uid)} from {theirs[0]}:{theirs[1]} to port {ours[1]}{more}")
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


__all__ = ["ListenerGuard", "drop_all", "published", "FLOOD_AFTER"]
