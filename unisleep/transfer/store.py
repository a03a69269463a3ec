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

Modules: :mod:`.store_wire` (formats, operations, limits, errors, the connection's keys),
:mod:`.store_table` (the values and the requests on them), :mod:`.store_server` (rank 0's server),
:mod:`.store_client` (:class:`LocalStore`, :class:`RemoteStore`), :mod:`.fd_limit`
(:func:`descriptor_error`).  Every name is importable from here as well.
"""

from __future__ import annotations

from .fd_limit import descriptor_error
from .store_client import LocalStore, RemoteStore, _Api, _Prefixed  # noqa: F401 - every name importable from here
from .store_server import StoreServer, _Conn  # noqa: F401
from .store_table import _handle, _Table
from .store_wire import (ADD, AGE, ANSWER, AUTH_S, BAD, CAS, CHECK, DELETE, DIRECT_ANSWER, GET, HELLO, I64, LEN, LIMIT,
                         MAGIC, MAX_FRAME, MAX_KEY, MAX_KEYS, MAX_MEMBER_CONNS, MAX_PENDING, MAX_TOTAL, MAX_VALUE,
                         MISSING, NOTINT, NUMKEYS, OK, SET, TAG, TOOBIG, U16, U32, VERSION, W, WATCH,
                         RecordTooLargeError, StoreAuthError, StoreLimitError, _keys, _mac, _recv_exact)

__all__ = ["StoreServer", "LocalStore", "RemoteStore", "StoreLimitError", "StoreAuthError", "RecordTooLargeError",
           "descriptor_error", "MAX_VALUE", "MAX_TOTAL", "MAX_PENDING", "AUTH_S"]
