"""The group's store on the wire: the handshake's and the frames' formats, the operations and
their answers' statuses, the limits, the store's errors, and the HMAC keys and tags of a
connection (the design: :mod:`.store`)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from ..errors import TransferError

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
