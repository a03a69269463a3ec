"""The data channel's listening socket (gloo's), guarded against other users of this machine.

gloo's tcp transport gives every rank one listening socket and pairs whoever first sends the
sequence number a pair expects; a connection that sends nothing, or another number, stays open in
gloo's listener until the channel closes, and gloo ends the process (``gloo::EnforceNotMet …
listener.cc accept: Too many open files``) when ``accept`` fails for want of descriptors (gloo
``transport/tcp/listener.cc``, ``Listener::handleEvents``).  Nothing in torch's API limits who
connects.  :class:`ListenerGuard`, run by a member while its data channel connects and proves
itself:

* finds this rank's listener: a listening TCP socket of this process, new since the guard
  started, whose address (``sockaddr`` port and address, as the kernel lays them out) is in what
  this rank published through the channel's bootstrap store — a server that something else in the
  process opened meanwhile is never touched;
* every few milliseconds shuts down each connection gloo accepted there whose other end, listed in
  ``/proc/net/tcp{,6}``, belongs to a uid that is not a member's (named, through ``on_refused``):
  parked connections cannot pile up, and a pair such a connection took breaks at once (the pair's
  proof then fails within seconds, :mod:`.collective`);
* :meth:`seal` — once the channel's connections are made — attaches a socket filter that drops
  every packet arriving at the listener (``SO_ATTACH_FILTER`` with ``ret #0``): from then on nobody
  can connect to it at all, while the connections already made are untouched (a socket accepted
  before keeps the filter its listener had then: none).

What it cannot do: connections from another machine have no uid here (the pair's proof still
refuses them); a flood faster than one sweep (about 2 ms) still costs up to that many descriptors
until the sweep; the window before :meth:`seal` lets a stranger take a pair (the proof names it,
and the update fails with ``IntrusionError``, its weights never sent) — docs/security.md.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from typing import Callable, Iterable, Optional

from .netinfo import tcp_table, user_name

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
#: one classic BPF instruction, BPF_RET | BPF_K with k = 0: keep 0 bytes of every packet (drop it)
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)
SWEEP_S = 0.002


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


def _sockaddr_pattern(ip: str, port: int) -> bytes:
    """The bytes of ``ip:port`` inside a ``sockaddr_in`` (port, then address) or ``sockaddr_in6``
    (port, flow info, address: the flow info is skipped by matching the address alone after it)."""
    if ":" in ip:
        return struct.pack("!H", port)  # checked with the address below
    return struct.pack("!H", port) + socket.inet_aton(ip)


def published(ip: str, port: int, blobs: Iterable[bytes]) -> bool:
    """Whether ``ip:port`` is in one of the values this rank published (its gloo address)."""
    head = _sockaddr_pattern(ip, port)
    six = socket.inet_pton(socket.AF_INET6, ip) if ":" in ip else b""
    for b in blobs:
        i = b.find(head)
        while i >= 0:
            if not six or b[i + 6: i + 22] == six:
                return True
            i = b.find(head, i + 1)
    return False


def _on_fd(fd: int, inode: str, fn) -> bool:
    """``fn(socket)`` on a duplicate of ``fd`` if it still is the socket ``inode`` (the number may
    have been closed and reused since it was listed); False when it is not.  ``fn``'s own
    ``OSError`` is raised."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if str(os.fstat(dup).st_ino) != inode:
            return False
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    with s:  # closes the duplicate only
        fn(s)
    return True


def drop_all(s: socket.socket) -> None:
    """Attach the drop-everything filter to a listening socket (no new connection reaches it)."""
    prog = ctypes.create_string_buffer(_DROP_ALL, len(_DROP_ALL))
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", 1, ctypes.addressof(prog)))


class ListenerGuard:
    """Guards the listener this rank publishes through ``blobs`` (a list the bootstrap store
    appends every value it writes to) while a data channel connects; see the module's text."""

    def __init__(self, allowed_uids: Iterable[int], blobs: list, on_refused: Callable[[str], None],
                 what: str = "the data channel"):
        self.allowed = set(allowed_uids) | {os.getuid()}
        self.blobs = blobs
        self.on_refused = on_refused
        self.what = what
        self.refused: list[str] = []
        self.sealed: list[str] = []
        self.seal_error: Optional[str] = None
        self._before = {ino for *_rest, st, _uid, ino in tcp_table() if st == "LISTEN"}
        self._mine: dict[str, tuple[str, int]] = {}  # inode -> (ip, port) of this rank's listener
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="unisleep-transfer-listener-guard")
        self._thread.start()

    @property
    def ports(self) -> set[int]:
        return {p for _ip, p in self._mine.values()}

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - /proc unreadable: the proof still guards the channel
                pass

    def sweep(self) -> None:
        """Find this rank's listener (once published) and shut down every connection to it from a
        uid that is not a member's."""
        with self._lock:
            fds = _socket_fds()
            table = tcp_table()
            for la, lp, _ra, _rp, st, _uid, ino in table:
                if st == "LISTEN" and ino in fds and ino not in self._before and ino not in self._mine \
                        and published(la, lp, list(self.blobs)):
                    self._mine[ino] = (la, lp)
            if not self._mine:
                return
            addrs = set(self._mine.values())
            owner = {(la, lp, ra, rp): uid for la, lp, ra, rp, st, uid, _ino in table}
            for la, lp, ra, rp, st, _uid, ino in table:
                if st != "ESTABLISHED" or (la, lp) not in addrs or ino not in fds:
                    continue
                uid = owner.get((ra, rp, la, lp))
                if uid is None or uid in self.allowed:
                    continue  # another machine's (no uid here: the proof decides), or a member's
                try:
                    done = _on_fd(fds[ino], ino, lambda s: s.shutdown(socket.SHUT_RDWR))
                except OSError:
                    done = False  # already gone
                if done:
                    msg = (f"a connection to {self.what}'s listening port {lp} from {user_name(uid)} at {ra}:{rp}, "
                           "not a member: shut down")
                    self.refused.append(msg)
                    self.on_refused(msg)

    def seal(self) -> None:
        """The channel's connections are made: no one else may connect to its listener."""
        self.sweep()
        fds = _socket_fds()
        with self._lock:
            for ino, (ip, port) in self._mine.items():
                if ino in fds and ino not in self.sealed:
                    try:
                        if _on_fd(fds[ino], ino, drop_all):
                            self.sealed.append(ino)
                    except OSError as e:
                        self.seal_error = f"{ip}:{port}: {e}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        try:
            self.sweep()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["ListenerGuard", "drop_all", "published"]
