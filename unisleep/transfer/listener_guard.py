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
* when every member runs on this machine (in this network namespace), the listener is narrowed
  :data:`NARROW_AFTER_S` after the claim — at once when, sooner, the process's descriptors grow
  by more than the members' connections (one directory read every :data:`SWEEP_S`: gloo's C++
  thread accepts a flood faster than anything slower could follow).  Narrowed, it first drops
  every packet arriving at it, then, every :data:`ADMIT_EVERY_S`, lets through only the
  connecting sockets of members' uids (read from ``/proc/net/tcp{,6}``; the strangers seen
  connecting are kept for the intrusion's message).  A member whose connection attempt was
  dropped is let in at its kernel's retry, about 1 s later.  Sealing for good at that point would
  not do: a member's connection still on its way would then time out, and gloo answers that by
  ending the process (``pair.cc``, ``Pair::signalException``: an exception signalled twice, tried
  on 2026-12-03 with torch 2.13.0).  With a member on another machine (whose sockets cannot be
  seen here) nothing is narrowed: the listener is open from the moment every member arrived to
  connect until the pairs are made (tens of milliseconds on a loaded 2-core machine), and what a
  flood holds is what it opens then.  A flood is named once the channel is made (:meth:`flood`);
* :meth:`seal` — once the channel's connections are made — attaches a socket filter that drops
  every packet arriving at the listener (``SO_ATTACH_FILTER`` with ``ret #0``): from then on nobody
  can connect to it at all (a connection attempt goes unanswered), while the connections already
  made are untouched (a socket accepted before keeps the filter its listener had then: none, or
  the narrowing one, which lets its member's packets through);
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
import time
from typing import Iterable, Optional

from .netinfo import tcp_table, user_name

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
# classic BPF (<linux/filter.h>): the codes used here, and the offset of the network header
_LD_W, _LD_H, _JEQ, _RET = 0x20, 0x28, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, …|BPF_H|…, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
_SKF_NET_OFF = -0x100000
_KEEP = 0x40000  # a packet let through is kept whole
#: one classic BPF instruction, BPF_RET | BPF_K with k = 0: keep 0 bytes of every packet (drop it)
_DROP_ALL = struct.pack("HBBI", _RET, 0, 0, 0)
_KEEP_ALL = struct.pack("HBBI", _RET, 0, 0, _KEEP)
#: the states of a socket that connects or is connected (``/proc/net/tcp``)
_LIVE = ("ESTABLISHED", "SYN_SENT")
#: the most sources one narrowing filter lets through (its jumps are 8-bit)
MAX_ADMITTED = 24
#: how long after this rank published its address the listener is narrowed to its members (when
#: they are all on this machine): they connect within it; one that does not is let in at its
#: kernel's retry, about 1 s later
NARROW_AFTER_S = 0.005
#: while narrowed, how often the members' connecting sockets are read again (a member's dropped
#: connection attempt is tried again by its kernel after about 1 s)
ADMIT_EVERY_S = 0.05
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


def _attach(s: socket.socket, code: bytes) -> bool:
    prog = ctypes.create_string_buffer(code, len(code))
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(code) // 8, ctypes.addressof(prog)))
    return True


def drop_all(s: socket.socket) -> bool:
    """Attach the drop-everything filter to a listening socket (no new connection reaches it)."""
    return _attach(s, _DROP_ALL)


def admit_only(sources: Iterable[tuple[str, int]]) -> bytes:
    """A classic BPF program for a TCP socket that keeps the packets whose source address and port
    are one of ``sources`` and drops every other.  A TCP socket's filter sees the packet from its
    TCP header (the source port is the half-word at 0); the source address is read relative to the
    network header (``SKF_NET_OFF``: 12 in an IPv4 header, 8 to 24 in an IPv6 one).  At most
    :data:`MAX_ADMITTED` sources."""
    blocks = []
    for ip, port in sources:
        if ":" in ip:
            raw = socket.inet_pton(socket.AF_INET6, ip)
            words = [(_SKF_NET_OFF + 8 + 4 * i, raw[4 * i: 4 * i + 4]) for i in range(4)]
        else:
            words = [(_SKF_NET_OFF + 12, socket.inet_aton(ip))]
        block = [(_LD_W, off & 0xFFFFFFFF, int.from_bytes(w, "big")) for off, w in words]
        blocks.append(block + [(_LD_H, 0, port)])
    if len(blocks) > MAX_ADMITTED:
        raise ValueError(f"at most {MAX_ADMITTED} sources, not {len(blocks)}")
    total = sum(2 * len(b) for b in blocks)  # each condition: a load and a jump
    accept = total + 1  # after every block: ``ret #0`` (drop), then ``ret #KEEP``
    ins = []
    for b in blocks:
        nxt = len(ins) + 2 * len(b)  # where the next block (or the drop) starts
        for j, (code, k, value) in enumerate(b):
            ins.append((code, 0, 0, k))
            at = len(ins) + 1  # a jump counts from the instruction after it
            if j == len(b) - 1:
                ins.append((_JEQ, accept - at, nxt - at, value))
            else:
                ins.append((_JEQ, 0, nxt - at, value))
    ins += [(_RET, 0, 0, 0), (_RET, 0, 0, _KEEP)]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


class ListenerGuard:
    """Guards the listener this rank publishes through ``blobs`` (the values the bootstrap store
    wrote for this rank) while a data channel of ``world_size`` members connects.
    ``members_local``: every member runs on this machine, in this network namespace (their
    connecting sockets can be read here, so a flood narrows the listener to them)."""

    def __init__(self, allowed_uids: Iterable[int], blobs: list, world_size: int, members_local: bool = False):
        self.allowed = set(allowed_uids) | {os.getuid()}
        self.members_local = members_local
        self.blobs = blobs
        self.limit = (world_size - 1) + FLOOD_AFTER
        # the process's own new sockets while the channel connects: one listener, one connection
        # per pair each way; more than that (and FLOOD_AFTER) is a flood
        self._fd_limit = 2 * (world_size - 1) + 1 + FLOOD_AFTER
        self.flooded = False
        #: the sources the listener lets through while it is narrowed (None: not narrowed)
        self.narrowed: Optional[frozenset] = None
        self.sealed: list[str] = []
        self.seal_error: Optional[str] = None
        self._before = set(_socket_fds())
        self._base = len(os.listdir("/proc/self/fd"))  # the process's descriptors before the channel
        self._mine: dict[str, tuple[str, int]] = {}  # inode -> (ip, port) of this rank's listener
        self._accepted: dict[str, tuple] = {}  # inode -> (ours, theirs) of each connection it accepted
        self._seen: set[str] = set()
        self._checked: set[str] = set()  # sockets that are not a listener
        self._claimed_at: Optional[float] = None
        self._tried: dict[tuple, int] = {}  # (ip, port) -> uid of the strangers seen connecting
        self._next_admit = 0.0
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
        """This rank published its address: its listener is the listening TCP socket this process
        opened since the guard started whose address it published (see the module's text)."""
        with self._lock:
            self._find_locked()
            for ino in [i for i, a in self._mine.items() if not published(a[0], a[1], list(self.blobs))]:
                del self._mine[ino]  # another rank's of this process, or a server that is not gloo's
            if self._claimed_at is None and self._mine:
                self._claimed_at = time.monotonic()

    def _find_locked(self) -> None:
        """Take every listening TCP socket this process opened since the guard started."""
        def what(s: socket.socket):
            if s.family not in (socket.AF_INET, socket.AF_INET6):
                return "other"
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return s.getsockname()[:2]
            try:
                s.getpeername()
                return "other"  # connected: never a listener
            except OSError:
                return None  # not yet listening, perhaps

        for ino, fd in _socket_fds().items():
            if ino in self._before or ino in self._checked or ino in self._mine:
                continue
            try:
                got = _on_fd(fd, ino, what)
            except OSError:
                continue
            if got == "other":
                self._checked.add(ino)
            elif got:
                self._mine[ino] = (got[0], got[1])

    def sweep(self) -> None:
        """While the listener is open and every member is on this machine: :data:`NARROW_AFTER_S`
        after the claim, or at once at the first sign of a flood (more new descriptors than the
        members make), drop everything arriving at the listener, then let the members' connecting
        sockets through (read again every :data:`ADMIT_EVERY_S`)."""
        with self._lock:
            if self.sealed or not self.members_local:
                return
            if self.narrowed is None:
                due = self._claimed_at is not None and time.monotonic() >= self._claimed_at + NARROW_AFTER_S
                if not due and len(os.listdir("/proc/self/fd")) - self._base <= self._fd_limit:
                    return
                if not self._mine:
                    return
                self._attach_locked(_DROP_ALL)  # at once; the members are let through below
                self.narrowed = frozenset()
            now = time.monotonic()
            if now >= self._next_admit:  # a dropped member tries again after about 1 s
                self._next_admit = now + ADMIT_EVERY_S
                sources = self._members_connecting()
                if sources is None:  # more than a filter holds: open again rather than keep a member out
                    self._attach_locked(_KEEP_ALL)
                    self.members_local = False
                elif sources != self.narrowed:
                    self._attach_locked(admit_only(sources))
                    self.narrowed = sources

    def _count_locked(self) -> None:
        """Name the connections this rank's listener accepted (for :attr:`accepted`, ``flooded``
        and :meth:`strangers`)."""
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
            self.flooded = True

    def _members_connecting(self) -> Optional[frozenset]:
        """(address, port) of every socket on this machine of a member's uid that connects, or is
        connected, to this rank's listener; None when they are more than one filter holds."""
        ports = {p: ip for ip, p in self._mine.values()}
        out = set()
        for la, lp, ra, rp, st, uid, ino in tcp_table(remote_ports=ports):
            if st not in _LIVE or ino == "0" or rp not in ports:
                continue  # (a closed connection's TIME_WAIT entry says uid 0, whoever made it)
            if not (ra == ports[rp] or ports[rp] in ("0.0.0.0", "::")):
                continue
            if uid in self.allowed:
                out.add((la, lp))
            else:  # who it was, while its socket is there to say (a flood closes what it opened)
                self._tried[(la, lp)] = uid
        return frozenset(out) if len(out) <= MAX_ADMITTED else None

    def _attach_locked(self, code: bytes) -> None:
        for ino in list(self._mine):
            self._attach_one_locked(ino, code)

    def _attach_one_locked(self, ino: str, code: bytes) -> None:
        fds = _socket_fds()
        if ino in fds:
            try:
                _on_fd(fds[ino], ino, lambda s: _attach(s, code))
            except OSError as e:
                ip, port = self._mine[ino]
                self.seal_error = f"{ip}:{port}: {e}"

    def seal(self) -> None:
        """The channel's connections are made: no one else may connect to its listener."""
        with self._lock:
            fds = _socket_fds()
            for ino, (ip, port) in self._mine.items():
                if ino in fds and ino not in self.sealed:
                    try:
                        if _on_fd(fds[ino], ino, drop_all):
                            self.sealed.append(ino)
                    except OSError as e:
                        self.seal_error = f"{ip}:{port}: {e}"
            self._count_locked()

    def flood(self) -> str:
        """What the listener took while it was open when it was flooded (more connections than its
        members make, or a narrowing that let in connections of other users), else ``""``."""
        strangers = self.strangers()
        with self._lock:
            tried: dict[int, int] = {}
            for uid in self._tried.values():
                tried[uid] = tried.get(uid, 0) + 1
        if not self.flooded and not (self.narrowed is not None and (strangers or tried)):
            return ""
        if self.narrowed is None:
            return (f"its listening socket took {self.accepted} connections while it was open, more than its members "
                    f"make: {'; '.join(strangers) or 'not from this machine'}")
        kept = "; ".join(f"{user_name(u)} (at least {n} connection attempts)" for u, n in tried.items())
        return (f"its listening socket was flooded while it was open and narrowed to its members' connections at "
                f"once ({self.accepted} connections accepted): {'; '.join(strangers + [kept] if kept else strangers)}")

    def strangers(self) -> list[str]:
        """``uid 65534 (nobody) from 127.0.0.1:40112 to port 36755 (and 311 more)`` for the accepted
        connections whose other end is a local socket of a uid that is not a member's."""
        with self._lock:
            self._count_locked()
            accepted = list(self._accepted.values())
            tried = dict(self._tried)
        if not accepted:
            return []
        owner = {(la, lp, ra, rp): uid for la, lp, ra, rp, st, uid, ino in tcp_table() if st in _LIVE and ino != "0"}
        by_uid: dict[int, list] = {}
        for ours, theirs in accepted:
            uid = owner.get((theirs[0], theirs[1], ours[0], ours[1]), tried.get((theirs[0], theirs[1])))
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


__all__ = ["ListenerGuard", "admit_only", "drop_all", "published", "FLOOD_AFTER", "MAX_ADMITTED"]
