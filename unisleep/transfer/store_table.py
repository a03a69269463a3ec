"""The store's values and the requests on them: :class:`_Table` (the values under the limits, one
lock, a version per change for WATCH, the store's time of each key's last change for AGE) and :func:`_handle` (one request's payload → its answer).
The server (:mod:`.store_server`) and rank 0's own client (:class:`~.store_client.LocalStore`)
both go through them (the design: :mod:`.store`)."""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable, Iterable, Optional

from ..units import human_bytes
from .store_wire import (ADD, AGE, BAD, CAS, CHECK, DELETE, GET, I64, LIMIT, MAX_KEY, MAX_KEYS, MAX_TOTAL, MAX_VALUE,
                         MISSING, NUMKEYS, OK, SET, TOOBIG, U16, U32, W, WATCH, StoreLimitError)


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
