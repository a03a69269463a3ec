"""Rank 0's store server: one thread, a selector over the listening socket and the connections;
it authenticates each connection, bounds the unproven and the proven ones, answers requests and
WATCHes, and names every refused connection (the design: :mod:`.store`)."""

from __future__ import annotations

import collections
import errno
import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Optional

from ..units import human_bytes
from .fd_limit import descriptor_error
from .netinfo import describe_peer
from .store_table import _handle, _Table
from .store_wire import (ANSWER, AUTH_S, DIRECT_ANSWER, HELLO, LEN, MAGIC, MAX_FRAME, MAX_MEMBER_CONNS, MAX_PENDING,
                         MISSING, TAG, VERSION, W, WATCH, _keys, _mac)

log = logging.getLogger("unisleep.transfer")


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "deadline", "nonce", "rank", "k_in", "k_out", "n_in", "n_out", "who",
                 "waiting", "lock", "closed")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.deadline = time.monotonic() + AUTH_S
        self.nonce = secrets.token_bytes(32)
        self.rank = -1
        self.k_in = self.k_out = b""
        self.n_in = self.n_out = 0
        self.who = ""
        self.waiting: Optional[tuple] = None  # (key, limit, after, deadline) of a WATCH not answered yet
        # its output (outbuf, n_out, writes and the close of its socket): the server's thread and
        # a thread that answers its WATCH on a change share it; always taken after the table's lock
        self.lock = threading.Lock()
        self.closed = False


class StoreServer:
    """Rank 0's store, served by a thread from ``listener`` (bound already) until :meth:`close`.

    ``key``: the store key (derived from the group secret); ``world_size`` bounds the proven
    connections; ``on_intrusion(msg)`` hears every refused connection (aggregated under a flood)."""

    def __init__(self, listener: socket.socket, key: bytes, world_size: int,
                 on_intrusion: Optional[Callable[[str], None]] = None):
        self.table = _Table()
        self._key = key
        self._world = world_size
        self.on_intrusion = on_intrusion
        self._listener = listener
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: dict[socket.socket, _Conn] = {}
        self._members: dict[socket.socket, _Conn] = {}
        # WATCHes waiting for a change (both under the table's lock: registered in the same hold as
        # the look that found nothing new, so no change can slip between them)
        self._waiters: dict[socket.socket, _Conn] = {}
        self._wanted: dict[str, list[_Conn]] = {}  # key -> the connections waiting for it
        self._handoff: collections.deque = collections.deque()  # (conn, answer or None) for the server's thread
        self.table.on_change = self._on_change
        self._listen_paused_until = 0.0
        self._refused: dict[str, int] = {}
        self._refused_reported = 0.0
        self._refused_unreported = 0
        self._last_who = "an unknown peer"
        self._closed = False
        self.address = listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._run, daemon=True, name="unisleep-transfer-store")
        self._thread.start()

    # -- loop
    def _run(self) -> None:
        try:
            while not self._closed:
                for k, mask in self._sel.select(timeout=0.02 if self._waiters else 0.25):
                    if k.data == "listen":
                        self._accept()
                    elif k.data == "wake":
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                        self._take_handoff()
                    else:
                        c = k.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(c)
                        if mask & selectors.EVENT_READ and (c.sock in self._pending or c.sock in self._members):
                            self._read(c)
                self._tick()
        except Exception as e:  # noqa: BLE001 - never silently: every member then sees the store gone
            log.error("the transfer group's store stopped: %s: %s", type(e).__name__, e)
        finally:
            for c in list(self._pending.values()) + list(self._members.values()):
                self._drop(c)
            for s in (self._listener, self._wake_r, self._wake_w):
                try:
                    s.close()
                except OSError:
                    pass
            self._sel.close()

    def _tick(self) -> None:
        now = time.monotonic()
        if self._waiters:
            self._expire(now)
        for c in [c for c in self._pending.values() if c.deadline < now]:
            self._refuse(c, f"it did not prove the group secret within {AUTH_S:.0f} s")
        if self._listen_paused_until and now >= self._listen_paused_until:
            self._listen_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        if self._refused_unreported and now - self._refused_reported >= 2.0:
            self._report_refusals(now)

    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, _addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    err = descriptor_error(e, "accepting a connection to the group's store", "rank 0")
                    log.warning("%s", err)
                    if self.on_intrusion is not None:
                        self.on_intrusion(f"the group's store could not accept a connection: {err}")
                    self._sel.unregister(self._listener)
                    self._listen_paused_until = time.monotonic() + 0.2
                return
            sock.setblocking(False)
            try:  # answers go out at once (Nagle would hold one behind the last, unacknowledged)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if len(self._pending) < 8 and time.monotonic() - self._refused_reported >= 2.0:
                who = describe_peer(sock)  # while its socket is surely there (not under a flood: costly)
            else:
                who = f"{_addr[0]}:{_addr[1]}"
            if len(self._pending) >= MAX_PENDING:
                oldest = next(iter(self._pending.values()))
                self._refuse(oldest, f"{MAX_PENDING} newer connections came before it proved the group secret")
            c = _Conn(sock)
            c.who = who
            c.outbuf += HELLO.pack(MAGIC, VERSION, 0, c.nonce)
            self._pending[sock] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            self._flush(c)

    def _read(self, c: _Conn) -> None:
        pending = c.sock in self._pending
        want = ANSWER.size - len(c.inbuf) if pending else 1 << 20
        try:
            data = c.sock.recv(want)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if pending:
                self._refuse(c, "it closed the connection without proving the group secret")
            else:
                self._drop(c)
            return
        c.inbuf += data
        if pending:
            if len(c.inbuf) >= ANSWER.size:
                self._answer(c)
            return
        while True:
            if len(c.inbuf) < LEN.size:
                return
            (n,) = LEN.unpack_from(c.inbuf)
            if n > MAX_FRAME:
                self._drop(c, f"member rank {c.rank} sent a frame of {human_bytes(n)}, over the limit")
                return
            if len(c.inbuf) < LEN.size + n + TAG:
                return
            payload = bytes(c.inbuf[LEN.size: LEN.size + n])
            tag = bytes(c.inbuf[LEN.size + n: LEN.size + n + TAG])
            del c.inbuf[: LEN.size + n + TAG]
            if not hmac.compare_digest(tag, _mac(c.k_in, c.n_in, payload)):
                self._drop(c, f"a frame on the store connection of rank {c.rank} failed authentication "
                              "(injected or altered on the way)")
                return
            c.n_in += 1
            if payload[:1] == bytes([WATCH]) and self._wait(c, payload):
                return  # answered when the key changes, or when the wait is over
            self._reply(c, _handle(self.table, payload))

    def _wait(self, c: _Conn, payload: bytes) -> bool:
        """Register a WATCH that finds nothing new and may wait (True); False: answer it now."""
        try:
            limit, wait_ms, after = W.unpack_from(payload, 1)
            key = payload[1 + W.size:].decode()
        except (struct.error, UnicodeDecodeError):
            return False
        if not wait_ms:
            return False
        with self.table.lock:
            if self.table._look(key, limit, after)[0] != MISSING:
                return False
            c.waiting = (key, limit, after, time.monotonic() + min(wait_ms, 60_000) / 1000)
            self._waiters[c.sock] = c
            self._wanted.setdefault(key, []).append(c)
        return True

    def _unwait(self, c: _Conn) -> None:
        """(the table's lock held) ``c`` no longer waits."""
        if c.waiting is not None:
            ws = self._wanted.get(c.waiting[0])
            if ws is not None and c in ws:
                ws.remove(c)
                if not ws:
                    del self._wanted[c.waiting[0]]
            c.waiting = None
        self._waiters.pop(c.sock, None)

    def _answer_of(self, c: _Conn) -> bytes:
        """(the table's lock held) the answer to ``c``'s WATCH now."""
        key, limit, after, _deadline = c.waiting
        st, ver, v = self.table._look(key, limit, after)
        return bytes([st]) + ver.to_bytes(8, "little") + v

    def _on_change(self, key: str) -> None:
        """A key changed (any thread, the table's lock held): the WATCHes waiting for it are
        answered at once by this thread — no hand-over to the server's thread, which may have to
        wait for the interpreter lock while this one works — except a large value, which the
        server's thread answers."""
        ws = self._wanted.get(key)
        if not ws:
            return
        mine = threading.current_thread() is self._thread
        for c in list(ws):
            answer = self._answer_of(c)
            if answer[0] == MISSING:
                continue  # deleted, or not newer than what it saw: it goes on waiting
            self._unwait(c)
            if mine or len(answer) <= DIRECT_ANSWER:
                self._reply(c, answer)
            else:
                self._hand_off(c, answer)

    def _hand_off(self, c: _Conn, answer: Optional[bytes]) -> None:
        """The server's thread answers ``answer`` to ``c`` (None: flushes what is left for it)."""
        self._handoff.append((c, answer))
        try:
            self._wake_w.send(b"c")
        except OSError:
            pass

    def _take_handoff(self) -> None:
        while self._handoff:
            c, answer = self._handoff.popleft()
            if answer is not None:
                self._reply(c, answer)
            else:
                self._flush(c)

    def _expire(self, now: float) -> None:
        due = []
        with self.table.lock:
            for c in list(self._waiters.values()):
                if now >= c.waiting[3]:
                    due.append((c, self._answer_of(c)))
                    self._unwait(c)
        for c, answer in due:
            self._reply(c, answer)

    def _reply(self, c: _Conn, answer: bytes) -> None:
        """Frame ``answer`` for ``c`` and send what the socket takes now (any thread); what is left
        is sent by the server's thread."""
        with c.lock:
            if c.closed:
                return
            c.outbuf += LEN.pack(len(answer)) + answer + _mac(c.k_out, c.n_out, answer)
            c.n_out += 1
            if threading.current_thread() is not self._thread:
                ok = self._send_some(c)
                if ok and not c.outbuf:
                    return
        if threading.current_thread() is not self._thread:
            self._hand_off(c, None)  # the rest, or a failed socket: the server's thread flushes or drops it
            return
        self._flush(c)

    def _send_some(self, c: _Conn) -> bool:
        """(``c.lock`` held) send what the socket takes now; False when it failed."""
        while c.outbuf:
            try:
                n = c.sock.send(c.outbuf)
            except BlockingIOError:
                return True
            except OSError:
                return False
            del c.outbuf[:n]
        return True

    def _answer(self, c: _Conn) -> None:
        cn, rank, proof = ANSWER.unpack_from(bytes(c.inbuf[: ANSWER.size]))
        del c.inbuf[: ANSWER.size]
        want, server_proof, c_in, c_out = _keys(self._key, c.nonce, cn, rank)
        if not hmac.compare_digest(proof, want) or not 0 < rank < self._world:
            c.outbuf += b"\0"
            self._flush(c)
            self._refuse(c, "its proof of the group secret is wrong")
            return
        if sum(1 for m in self._members.values() if m.rank == rank) >= MAX_MEMBER_CONNS:
            c.outbuf += b"\0"
            self._flush(c)
            self._refuse(c, f"rank {rank} holds {MAX_MEMBER_CONNS} store connections already")
            return
        del self._pending[c.sock]
        self._members[c.sock] = c
        c.rank, c.k_in, c.k_out = rank, c_in, c_out
        c.outbuf += b"\1" + server_proof
        self._flush(c)

    def _flush(self, c: _Conn) -> None:
        """(the server's thread) send what is left for ``c``; wait for the socket to take the rest."""
        with c.lock:
            if c.closed:
                return
            ok = self._send_some(c)
            more = bool(c.outbuf)
        if not ok:
            self._drop(c)
            return
        try:
            self._sel.modify(c.sock, selectors.EVENT_WRITE if more else selectors.EVENT_READ, c)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, c: _Conn, why: str = "") -> None:
        """(the server's thread) close ``c``."""
        self._pending.pop(c.sock, None)
        self._members.pop(c.sock, None)
        with self.table.lock:
            self._unwait(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        with c.lock:  # no other thread is writing to it (or to whatever next gets its descriptor)
            c.closed = True
            try:
                c.sock.close()
            except OSError:
                pass
        if why and self.on_intrusion is not None:
            self.on_intrusion(why)

    def _refuse(self, c: _Conn, why: str) -> None:
        """Close a connection that did not prove the secret, and say so: the first of each kind at
        once, naming the peer (its uid when it is on this machine), then counts at most every 2 s
        (a flood cannot flood the log or the group's intrusions)."""
        now = time.monotonic()
        first = why not in self._refused
        self._refused[why] = self._refused.get(why, 0) + 1
        self._refused_unreported += 1
        if first or now - self._refused_reported >= 2.0:
            self._last_who = c.who if "uid" in c.who else describe_peer(c.sock)
            if self._last_who.startswith("a peer that went away"):
                self._last_who = c.who
        self._drop(c)
        if first:
            msg = f"refused a connection to the group's store from {self._last_who}: {why}"
            log.warning("transfer group store: %s", msg)
            if self.on_intrusion is not None:
                self.on_intrusion(msg)
            self._refused_reported, self._refused_unreported = now, 0
        elif now - self._refused_reported >= 2.0:
            self._report_refusals(now)

    def _report_refusals(self, now: float) -> None:
        counts = "; ".join(f"{n} because {w}" for w, n in self._refused.items())
        msg = (f"refused {sum(self._refused.values())} connections to the group's store so far ({counts}); "
               f"the latest from {self._last_who}")
        log.warning("transfer group store: %s", msg)
        if self.on_intrusion is not None:
            self.on_intrusion(msg)
        self._refused_reported, self._refused_unreported = now, 0

    @property
    def open_connections(self) -> int:
        return len(self._pending) + len(self._members)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
