"""The group's store: a small key-value server that rank 0 runs for its group, which only members
can use, with bounded resources.  It carries the control records of an update, the heartbeats and
the collective's bootstrap values.

Why not torch's ``TCPStore``: anyone who reaches its port reads and writes every key (the
collective's addresses, the heartbeats), asks for one large value hundreds of times in one request,
appends to a value without bound and holds as many connections as the host allows (each one a
descriptor of rank 0).  This store:

* **authenticates both ends when a connection opens** — the server sends a fresh nonce, the client
  answers with its own nonce, its rank and an HMAC-SHA256 proof under a key derived from the group
  secret, the server proves the secret back — and **every frame after** (an HMAC tag with a counter
  per direction: nothing can be injected, replayed or reordered on the connection);
* lets a connection that has not proved the secret send at most its 68-byte answer, for at most
  :data:`AUTH_S` seconds; holds at most :data:`MAX_PENDING` of them (a new one closes the oldest),
  and at most :data:`MAX_MEMBER_CONNS` per member once proven; every refused connection is named
  (its uid when it comes from this machine) through ``on_intrusion``;
* bounds a key (:data:`MAX_KEY` bytes), a value (:data:`MAX_VALUE`), all values together
  (:data:`MAX_TOTAL`) and the number of keys; one request names one value (no multi-get, no
  append), and a reader says how much it takes — the answer to a larger value is its size, not
  its bytes;
* never blocks: a member waiting for a key sends one WATCH, answered the moment the key changes —
  by the thread that changed it (rank 0's own writes answer from rank 0's thread, without waking
  the server's thread or waiting for it to be scheduled) — or when its wait is over.

The wire (TCP, after the handshake): ``length u32 | payload | tag (16 bytes)``; ``payload`` is an
operation byte and its fields, the answer a status byte and its data.

In this module, in order: the wire (formats, operations, limits, the store's errors, the keys
and tags of a connection); the table (:class:`_Table`: the values under the limits, one lock, a
version per change for WATCH, the store's time of each key's last change for AGE; :func:`_handle`:
one request's payload → its answer); rank 0's server (:class:`StoreServer`: one thread, a selector
over the listening socket and the connections); and the clients (:class:`_Api`: the verbs the group
and the collective's bootstrap use; :class:`LocalStore`: rank 0's own use, no socket;
:class:`RemoteStore`: a member's authenticated connection).
"""

from __future__ import annotations

import collections
import datetime
import errno
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Iterable, Optional

from ..errors import TransferError
from ..units import human_bytes
from .netinfo import describe_peer, descriptor_error
from .waiting import WaitNotice

log = logging.getLogger("unisleep.transfer")

# ---------------------------------------------------------------------------- the wire
MAGIC = b"USXS"
VERSION = 1
HELLO = struct.Struct("<4sHH32s")  # magic, version, reserved, server nonce
ANSWER = struct.Struct("<32sI32s")  # client nonce, rank, proof
TAG = 16
LEN = struct.Struct("<I")
I64 = struct.Struct("<q")
U32 = struct.Struct("<I")
U16 = struct.Struct("<H")

#: the largest key, in bytes
MAX_KEY = 1024
#: the largest value: a control record (at most 32 MiB, records.MAX_RECORD) and its framing
MAX_VALUE = (32 << 20) + (64 << 10)
#: all values together
MAX_TOTAL = 256 << 20
MAX_KEYS = 1 << 16
#: connections that have not proved the group secret yet (a new one closes the oldest)
MAX_PENDING = 64
#: how long such a connection may take to prove it
AUTH_S = 5.0
#: proven connections per member (the group uses two: records and heartbeats)
MAX_MEMBER_CONNS = 8
MAX_FRAME = 1 + 2 + 4 + MAX_KEY + 2 * MAX_VALUE
#: the largest answer to a WATCH that the thread changing its key sends itself (a control record);
#: a larger one (a header with many tensor specs) the server's thread sends
DIRECT_ANSWER = 64 << 10

SET, GET, ADD, CHECK, DELETE, NUMKEYS, CAS, WATCH, AGE = range(1, 10)
W = struct.Struct("<IIQ")  # WATCH: limit, wait in ms, the version already seen
OK, MISSING, TOOBIG, NOTINT, LIMIT, BAD = range(6)


class StoreLimitError(TransferError):
    """A request over the store's limits (a key or value too large, the store full): refused,
    nothing stored."""


class RecordTooLargeError(TransferError):
    """A value is larger than the reader takes (its size is known, its bytes were not fetched)."""

    def __init__(self, msg: str, size: int):
        super().__init__(msg)
        self.size = size


class StoreAuthError(TransferError):
    """The store and this member do not share the group secret (or the address is not the
    group's store)."""


def _mac(key: bytes, n: int, payload: bytes) -> bytes:
    return hmac.new(key, n.to_bytes(8, "little") + payload, hashlib.sha256).digest()[:TAG]


def _keys(key: bytes, sn: bytes, cn: bytes, rank: int) -> tuple[bytes, bytes, bytes, bytes]:
    """(client proof, server proof, client→server key, server→client key)."""
    r = rank.to_bytes(4, "little")
    return (hmac.new(key, b"client" + sn + cn + r, hashlib.sha256).digest(),
            hmac.new(key, b"server" + sn + cn + r, hashlib.sha256).digest(),
            hmac.new(key, b"c2s" + sn + cn + r, hashlib.sha256).digest(),
            hmac.new(key, b"s2c" + sn + cn + r, hashlib.sha256).digest())
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise ConnectionError("closed by the other end")
        buf += b
    return bytes(buf)


# ---------------------------------------------------------------------------- the table
class _Table:
    """The values, with the limits; every method under one lock.  Every change of a key gives it
    a new version (a counter over the whole table), so a reader can wait for a change instead of
    polling: :meth:`watch`; and when it changed, by the store's clock (:meth:`aged`): how long a
    member's heartbeat has been silent does not depend on when another member last looked."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.ver: dict[str, int] = {}
        self.at: dict[str, float] = {}  # time.monotonic() of each key's last change
        self.total = 0
        self._n = 0
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.on_change: Optional[Callable[[str], None]] = None  # called with the lock held: must be quick

    def _changed(self, key: str) -> None:
        self._n += 1
        self.ver[key] = self._n
        self.at[key] = time.monotonic()
        if len(self.ver) > 2 * MAX_KEYS:  # versions of deleted keys are forgotten, oldest first
            for k in [k for k in self.ver if k not in self.data][: len(self.ver) - MAX_KEYS]:
                del self.ver[k]
                self.at.pop(k, None)
        self.cv.notify_all()
        if self.on_change is not None:
            self.on_change(key)

    def _put(self, key: str, value: bytes) -> None:
        if len(key.encode()) > MAX_KEY:
            raise StoreLimitError(f"store key {key[:80]!r} is longer than {MAX_KEY} bytes")
        if len(value) > MAX_VALUE:
            raise StoreLimitError(f"a value of {human_bytes(len(value))} for {key!r} is over the store's limit of "
                                  f"{human_bytes(MAX_VALUE)}")
        old = self.data.get(key)
        if old is None and len(self.data) >= MAX_KEYS:
            raise StoreLimitError(f"the store holds {MAX_KEYS} keys already")
        total = self.total - (len(old) if old is not None else 0) + len(value)
        if total > MAX_TOTAL:
            raise StoreLimitError(f"the store would hold {human_bytes(total)}, over its limit of {human_bytes(MAX_TOTAL)}")
        self.data[key], self.total = value, total
        self._changed(key)

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self._put(key, value)

    def _look(self, key: str, limit: int, after: int) -> tuple[int, int, bytes]:
        v, ver = self.data.get(key), self.ver.get(key, 0)
        if v is None or ver <= after:
            return MISSING, ver, b""
        if len(v) > limit:
            return TOOBIG, ver, len(v).to_bytes(8, "little")
        return OK, ver, v

    def fetch(self, key: str, limit: int) -> tuple[int, bytes]:
        with self.lock:
            st, _ver, v = self._look(key, limit, 0)
        return st, v

    def _look_locked(self, key: str, limit: int, after: int) -> tuple[int, int, bytes]:
        with self.lock:
            return self._look(key, limit, after)

    def watch(self, key: str, limit: int, after: int, wait_s: float) -> tuple[int, int, bytes]:
        """(status, version, value) of ``key`` once its version is above ``after`` (waiting up to
        ``wait_s``); MISSING when it is absent or unchanged by then."""
        deadline = time.monotonic() + wait_s
        with self.cv:
            while True:
                r = self._look(key, limit, after)
                left = deadline - time.monotonic()
                if r[0] != MISSING or left <= 0:
                    return r
                self.cv.wait(left)

    def aged(self, key: str, limit: int) -> tuple[int, float, bytes]:
        """(status, seconds since ``key`` last changed, value): MISSING when absent, TOOBIG (the
        value's size in place of its bytes) when it is larger than ``limit``."""
        with self.lock:
            st, _ver, v = self._look(key, limit, 0)
            return st, (time.monotonic() - self.at[key]) if st != MISSING else 0.0, v

    def add(self, key: str, delta: int) -> int:
        with self.lock:
            old = self.data.get(key, b"0")
            try:
                n = int(old.decode("ascii")) + delta
            except (UnicodeDecodeError, ValueError):
                raise StoreLimitError(f"store key {key!r} does not hold a counter") from None
            if not -(2**63) <= n < 2**63:
                raise StoreLimitError(f"counter {key!r} would overflow")
            if delta or key not in self.data:
                self._put(key, str(n).encode())
            return n

    def check(self, keys: Iterable[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def delete(self, key: str) -> bool:
        with self.lock:
            v = self.data.pop(key, None)
            if v is not None:
                self.total -= len(v)
                self._changed(key)
            return v is not None

    def num_keys(self) -> int:
        with self.lock:
            return len(self.data)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.lock:
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._put(key, desired)
                return desired
            return cur if cur is not None else expected


def _handle(table: _Table, payload: bytes) -> bytes:
    """One request → its answer (status byte + data)."""
    try:
        op = payload[0]
        if op == SET:
            (kl,) = U16.unpack_from(payload, 1)
            table.set(payload[3: 3 + kl].decode(), payload[3 + kl:])
            return bytes([OK])
        if op == GET:
            (limit,) = U32.unpack_from(payload, 1)
            st, v = table.fetch(payload[5:].decode(), limit)
            return bytes([st]) + v
        if op == ADD:
            (delta,) = I64.unpack_from(payload, 1)
            return bytes([OK]) + I64.pack(table.add(payload[9:].decode(), delta))
        if op == CHECK:
            keys, off = [], 1
            while off < len(payload):
                (kl,) = U16.unpack_from(payload, off)
                keys.append(payload[off + 2: off + 2 + kl].decode())
                off += 2 + kl
            return bytes([OK, table.check(keys)])
        if op == DELETE:
            return bytes([OK, table.delete(payload[1:].decode())])
        if op == NUMKEYS:
            return bytes([OK]) + I64.pack(table.num_keys())
        if op == WATCH:  # the server answers at once only when there is news; else it waits (StoreServer)
            limit, _wait_ms, after = W.unpack_from(payload, 1)
            st, ver, v = table._look_locked(payload[1 + W.size:].decode(), limit, after)
            return bytes([st]) + ver.to_bytes(8, "little") + v
        if op == AGE:
            (limit,) = U32.unpack_from(payload, 1)
            st, age, v = table.aged(payload[5:].decode(), limit)
            return bytes([st]) + I64.pack(int(age * 1e6)) + v
        if op == CAS:
            (kl,) = U16.unpack_from(payload, 1)
            key = payload[3: 3 + kl].decode()
            (el,) = U32.unpack_from(payload, 3 + kl)
            exp = payload[7 + kl: 7 + kl + el]
            return bytes([OK]) + table.compare_set(key, exp, payload[7 + kl + el:])
    except StoreLimitError as e:
        return bytes([LIMIT]) + str(e).encode()[:4000]
    except (struct.error, IndexError, UnicodeDecodeError):
        pass
    return bytes([BAD])


# ---------------------------------------------------------------------------- rank 0's server
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
    connections; ``on_intrusion(msg)`` hears every refused connection (aggregated under a flood).
    ``stale_key``: the store key of an earlier group whose loopback secret file this one replaced; a
    member that read that file before rank 0 rewrote it is refused quietly (it reads the file again),
    not reported as an intrusion."""

    def __init__(self, listener: socket.socket, key: bytes, world_size: int,
                 on_intrusion: Optional[Callable[[str], None]] = None, stale_key: Optional[bytes] = None):
        self.table = _Table()
        self._key = key
        self._stale_key = stale_key
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
            if self._stale_key is not None and 0 < rank < self._world and \
                    hmac.compare_digest(proof, _keys(self._stale_key, c.nonce, cn, rank)[0]):
                log.debug("transfer group store: rank %d proved the previous loopback secret; it re-reads the file", rank)
                self._drop(c)
                return
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


# ---------------------------------------------------------------------------- the clients
class _Api:
    """What the group and the collective's bootstrap use (the c10d ``Store`` verbs, plus
    :meth:`fetch`), on top of one ``_call(payload) -> answer``."""

    timeout_s: float = 300.0

    def _call(self, payload: bytes) -> bytes:
        raise NotImplementedError

    def _ok(self, ans: bytes, what: str) -> bytes:
        if ans[0] == OK:
            return ans[1:]
        if ans[0] == LIMIT:
            raise StoreLimitError(f"the group's store refused {what}: {ans[1:].decode(errors='replace')}")
        raise TransferError(f"the group's store refused {what} (status {ans[0]})")

    def set(self, key: str, value) -> None:
        v = value.encode() if isinstance(value, str) else bytes(value)
        k = key.encode()
        self._ok(self._call(bytes([SET]) + U16.pack(len(k)) + k + v), f"to store {key!r}")

    def fetch(self, key: str, limit: int = MAX_VALUE) -> Optional[bytes]:
        """The value of ``key`` (None when absent); :class:`RecordTooLargeError` without fetching
        it when it holds more than ``limit`` bytes."""
        ans = self._call(bytes([GET]) + U32.pack(min(limit, MAX_VALUE)) + key.encode())
        if ans[0] == MISSING:
            return None
        if ans[0] == TOOBIG:
            size = int.from_bytes(ans[1:9], "little")
            raise RecordTooLargeError(f"store key {key!r} holds {human_bytes(size)}, more than the "
                                      f"{human_bytes(limit)} this side takes: not fetched", size)
        return self._ok(ans, f"to read {key!r}")

    def watch(self, key: str, limit: int = MAX_VALUE, after: int = 0, wait_s: float = 0.0) -> tuple[int, Optional[bytes]]:
        """``(version, value)`` of ``key`` as soon as its version is above ``after`` — the store
        answers when it changes (no polling), or after ``wait_s`` with ``(version, None)``.
        :class:`RecordTooLargeError` without fetching a value larger than ``limit``."""
        ms = max(0, min(int(wait_s * 1000), 60_000))
        ans = self._call(bytes([WATCH]) + W.pack(min(limit, MAX_VALUE), ms, after) + key.encode())
        return self._watched(key, limit, ans[0], int.from_bytes(ans[1:9], "little"), ans[9:])

    def _watched(self, key: str, limit: int, st: int, ver: int, v: bytes) -> tuple[int, Optional[bytes]]:
        if st == MISSING:
            return ver, None
        if st == TOOBIG:
            size = int.from_bytes(v[:8], "little")
            raise RecordTooLargeError(f"store key {key!r} holds {human_bytes(size)}, more than the "
                                      f"{human_bytes(limit)} this side takes: not fetched", size)
        if st != OK:
            raise TransferError(f"the group's store refused to read {key!r} (status {st})")
        return ver, v

    def aged(self, key: str, limit: int = 64) -> Optional[tuple[float, bytes]]:
        """``(seconds since key last changed, by the store's clock; its value)`` — None when it
        is absent; :class:`RecordTooLargeError` without fetching a value larger than ``limit``."""
        ans = self._call(bytes([AGE]) + U32.pack(min(limit, MAX_VALUE)) + key.encode())
        age_us, v = self._watched(key, limit, ans[0], I64.unpack_from(ans, 1)[0], ans[9:])  # WATCH's layout
        return None if v is None else (age_us / 1e6, v)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it (the c10d ``get``)."""
        deadline, delay = time.monotonic() + self.timeout_s, 0.001
        while True:
            v = self.fetch(key)
            if v is not None:
                return v
            if time.monotonic() > deadline:
                raise TransferError(f"store key {key!r} did not appear within {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def add(self, key: str, amount: int) -> int:
        return I64.unpack(self._ok(self._call(bytes([ADD]) + I64.pack(int(amount)) + key.encode()),
                                   f"to add to {key!r}"))[0]

    def check(self, keys) -> bool:
        body = b"".join(U16.pack(len(k.encode())) + k.encode() for k in keys)
        return bool(self._ok(self._call(bytes([CHECK]) + body), "a check")[0])

    def wait(self, keys, timeout=None) -> None:
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else \
            (self.timeout_s if timeout is None else float(timeout))
        deadline, delay = time.monotonic() + t, 0.001
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TransferError(f"store keys {list(keys)[:4]} did not appear within {t:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def delete_key(self, key: str) -> bool:
        return bool(self._ok(self._call(bytes([DELETE]) + key.encode()), f"to delete {key!r}")[0])

    def num_keys(self) -> int:
        return I64.unpack(self._ok(self._call(bytes([NUMKEYS])), "to count keys"))[0]

    def compare_set(self, key: str, expected, desired) -> bytes:
        e = expected.encode() if isinstance(expected, str) else bytes(expected)
        d = desired.encode() if isinstance(desired, str) else bytes(desired)
        k = key.encode()
        return self._ok(self._call(bytes([CAS]) + U16.pack(len(k)) + k + U32.pack(len(e)) + e + d),
                        f"to compare-and-set {key!r}")

    def set_timeout(self, timeout) -> None:
        self.timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)

    def prefixed(self, prefix: str) -> "_Prefixed":
        return _Prefixed(self, prefix)


class _Prefixed(_Api):
    """The same store with every key under ``prefix/``."""

    def __init__(self, inner: _Api, prefix: str):
        self._inner, self._prefix = inner, prefix

    @property
    def timeout_s(self) -> float:  # type: ignore[override]
        return self._inner.timeout_s

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key, value):
        return self._inner.set(self._k(key), value)

    def fetch(self, key, limit=MAX_VALUE):
        return self._inner.fetch(self._k(key), limit)

    def watch(self, key, limit=MAX_VALUE, after=0, wait_s=0.0):
        return self._inner.watch(self._k(key), limit, after, wait_s)

    def aged(self, key, limit=64):
        return self._inner.aged(self._k(key), limit)

    def add(self, key, amount):
        return self._inner.add(self._k(key), amount)

    def check(self, keys):
        return self._inner.check([self._k(k) for k in keys])

    def delete_key(self, key):
        return self._inner.delete_key(self._k(key))

    def num_keys(self):
        return self._inner.num_keys()

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(self._k(key), expected, desired)

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)


class LocalStore(_Api):
    """Rank 0's own use of the store it serves (no socket)."""

    def __init__(self, server: StoreServer, timeout_s: float):
        self.server, self.timeout_s = server, timeout_s

    def _call(self, payload: bytes) -> bytes:
        if self.server._closed:
            raise ConnectionError("the group's store is closed (this group was closed)")
        return _handle(self.server.table, payload)

    def watch(self, key: str, limit: int = MAX_VALUE, after: int = 0, wait_s: float = 0.0) -> tuple[int, Optional[bytes]]:
        if self.server._closed:
            raise ConnectionError("the group's store is closed (this group was closed)")
        st, ver, v = self.server.table.watch(key, min(limit, MAX_VALUE), after, wait_s)
        return self._watched(key, limit, st, ver, v)

    def close(self) -> None:
        pass


def _held_by(host: str, port: int) -> str:
    """``" (it is held by uid 65534 (nobody), pid 4242 (python3))"`` for the listener at
    ``host:port`` when this machine lists it, else ``""``."""
    from .netinfo import port_holder

    try:
        who = port_holder(host, port)
    except Exception:  # noqa: BLE001 - naming the holder is a courtesy: the error stands without it
        return ""
    return f" (it is held by {who})" if who else ""


class RemoteStore(_Api):
    """A member's connection to rank 0's store (one request at a time; thread-safe)."""

    def __init__(self, sock: socket.socket, k_out: bytes, k_in: bytes, timeout_s: float, where: str):
        self._sock, self._k_out, self._k_in = sock, k_out, k_in
        self._n_out = self._n_in = 0
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self._where = where
        self._dead: Optional[str] = None

    @classmethod
    def connect(cls, host: str, port: int, key: bytes, rank: int, timeout_s: float) -> "RemoteStore":
        """Connect to the group's store at ``host:port`` and prove the group secret (retrying while
        the store is not up yet, or busy refusing strangers, until ``timeout_s``)."""
        where = f"{host}:{port}"
        deadline = time.monotonic() + timeout_s
        delay, last = 0.01, "nothing answered"
        notice = WaitNotice(f"rank {rank} is waiting for the transfer group's store at {where} (rank 0 starts it)",
                            timeout_s)
        while True:
            notice.tick()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError(f"cannot reach the group's store at {where} within {timeout_s:.0f} s: {last}")
            try:
                sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            except OSError as e:
                err = descriptor_error(e, f"connecting to the group's store at {where}")
                if err is not None:
                    raise err from None
                last = f"{type(e).__name__}: {e}"
                time.sleep(min(delay, max(0.0, left)))
                delay = min(delay * 2, 0.25)
                continue
            greeted = False
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(max(left, 0.1), AUTH_S))
                hello = _recv_exact(sock, HELLO.size)
                magic, version, _r, sn = HELLO.unpack(hello)
                if magic != MAGIC:
                    sock.close()
                    raise StoreAuthError(f"{where} is not a unisleep transfer store (another service holds the "
                                         "port, or a process that is not the group's rank 0): its greeting fails "
                                         "authentication" + _held_by(host, port))
                greeted = True
                if version != VERSION:
                    sock.close()
                    raise TransferError(f"the group's store at {where} speaks store protocol {version}, this member "
                                        f"{VERSION}: run the same unisleep version on every member")
                cn = secrets.token_bytes(32)
                proof, server_proof, k_out, k_in = _keys(key, sn, cn, rank)
                sock.sendall(ANSWER.pack(cn, rank, proof))
                verdict = _recv_exact(sock, 1)
                if verdict != b"\1":
                    sock.close()
                    raise StoreAuthError(f"the group's store at {where} refused this member's proof of the group "
                                         "secret: authentication failed (the members hold different secrets)")
                if not hmac.compare_digest(_recv_exact(sock, 32), server_proof):
                    sock.close()
                    raise StoreAuthError(f"the store at {where} could not prove the group secret: authentication "
                                         "failed (a process that is not the group's rank 0 holds the port?)")
            except OSError as e:  # closed unanswered under a flood, or not up yet: again
                try:
                    sock.close()
                except OSError:
                    pass
                if greeted and isinstance(e, socket.timeout):
                    # a store that greets answers the proof at once (a flooded one closes instead): what
                    # greets and then stays silent is not the group's rank 0
                    raise StoreAuthError(f"{where} sent a unisleep store greeting but did not answer this member's "
                                         f"proof of the group secret within {AUTH_S:.0f} s: a process that is not "
                                         f"the group's rank 0 holds the port{_held_by(host, port)}") from None
                last = (f"it accepted the connection but sent no greeting within {AUTH_S:.0f} s (a unisleep older "
                        "than protocol 3, whose store was torch's TCPStore, or another service on that port?"
                        f"{_held_by(host, port)})" if isinstance(e, socket.timeout)
                        else f"{type(e).__name__}: {e}")
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
                continue
            sock.settimeout(timeout_s)
            return cls(sock, k_out, k_in, timeout_s, where)

    def _call(self, payload: bytes) -> bytes:
        with self._lock:
            if self._dead:
                raise ConnectionError(self._dead)
            try:
                self._sock.sendall(LEN.pack(len(payload)) + payload + _mac(self._k_out, self._n_out, payload))
                self._n_out += 1
                (n,) = LEN.unpack(_recv_exact(self._sock, LEN.size))
                if n > MAX_FRAME:
                    raise ConnectionError(f"the store sent a frame of {human_bytes(n)}")
                body = _recv_exact(self._sock, n + TAG)
                ans, tag = body[:n], body[n:]
                if not hmac.compare_digest(tag, _mac(self._k_in, self._n_in, ans)):
                    raise ConnectionError("an answer of the store failed authentication (altered on the way)")
                self._n_in += 1
                return ans
            except (OSError, ConnectionError) as e:
                self._dead = (f"the connection to the group's store at {self._where} is lost (its host, rank 0, may "
                              f"have died): {type(e).__name__}: {e}")
                try:
                    self._sock.close()
                except OSError:
                    pass
                raise ConnectionError(self._dead) from None

    def close(self) -> None:
        with self._lock:
            self._dead = self._dead or "this store connection was closed"
            try:
                self._sock.close()
            except OSError:
                pass
