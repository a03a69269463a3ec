"""The clients of the group's store: the verbs the group and the collective's bootstrap use
(:class:`_Api`), a view under a key prefix, rank 0's own use of the store it serves
(:class:`LocalStore`, no socket) and a member's authenticated connection (:class:`RemoteStore`)
(the design: :mod:`.store`)."""

from __future__ import annotations

import datetime
import hmac
import secrets
import socket
import threading
import time
from typing import Optional

from ..errors import TransferError
from ..units import human_bytes
from .fd_limit import descriptor_error
from .store_server import StoreServer
from .store_table import _handle
from .store_wire import (ADD, AGE, ANSWER, AUTH_S, CAS, CHECK, DELETE, GET, HELLO, I64, LEN, LIMIT, MAGIC, MAX_FRAME,
                         MAX_VALUE, MISSING, NUMKEYS, OK, SET, TAG, TOOBIG, U16, U32, VERSION, W, WATCH, _keys, _mac,
                         _recv_exact, RecordTooLargeError, StoreAuthError, StoreLimitError)


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
        from .waiting import WaitNotice

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
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(max(left, 0.1), AUTH_S))
                hello = _recv_exact(sock, HELLO.size)
                magic, version, _r, sn = HELLO.unpack(hello)
                if magic != MAGIC:
                    sock.close()
                    raise StoreAuthError(f"{where} is not a unisleep transfer store (another service holds the "
                                         "port, or a process that is not the group's rank 0): its greeting fails "
                                         "authentication")
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
                last = (f"it sent no greeting within {AUTH_S:.0f} s (a unisleep older than protocol 3, whose store "
                        "was torch's TCPStore, or another service on that port?)" if isinstance(e, socket.timeout)
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
