"""Control records of a transfer group: fixed-schema JSON, authenticated, never unpickled.

A record on the wire (the store value, or one IPC socket message)::

    | "USXR" | protocol u16 | flags u16 | body length u32 | JSON body | HMAC-SHA256 (32 bytes) |

The JSON body is ``{"k": key, "seq": update number, "ep": epoch, "b": {fields}}``; the HMAC
covers the group id (the group's name and rank 0's random nonce), the 12-byte head and the body,
under a key derived from the group secret.  So a record only opens under the key it was written
for, for the update number and epoch it names, in the group that made it: a record copied to
another key, replayed from an earlier update or planted by someone without the secret is refused
(:class:`ForgedRecordError`, which callers log as an intrusion and skip).  The fields are checked
against a schema (types, ranges, lengths); anything else is a :class:`~unisleep.errors.TransferError`
naming the peer.  A record whose protocol version differs from this side's names both versions.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from typing import Any, Optional

from ..errors import TransferError
from ..units import human_bytes

PROTOCOL = 5  # 3: the group's own store, peers' network namespace, the header's transport and cipher; 4: the header names its control plane (one per path), a bucket holds at most BUCKET_TENSORS tensors; 5: the header also on the IPC connection, an update's hash key only the levels its largest tensor needs
# (2: host bytes digested with GMAC, was keyed BLAKE3)
MAGIC = b"USXR"
HEAD = struct.Struct("<4sHHI")
TAG_BYTES = 32
#: largest record accepted (a header listing the specs of a very large model fits)
MAX_RECORD = 32 << 20
MAX_STR = 4096
MAX_NAME = 1024
MAX_DIMS = 16
DTYPES = frozenset({
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8", "int16", "int32",
    "int64", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
})


class ForgedRecordError(TransferError):
    """A record failed authentication: planted or replayed by someone without the group secret
    (or written for another key, update or group).  The receiving side logs it and goes on
    waiting for the genuine record."""


class MalformedRecordError(TransferError):
    """An authentic record (right key, update number and epoch known) whose body does not fit its
    schema: a peer of another version or a bug.  ``seq`` and ``epoch`` say which update it was for,
    so the reader can refuse that update and the writer hears why."""

    def __init__(self, msg: str, seq: int, epoch: int):
        super().__init__(msg)
        self.seq, self.epoch = seq, epoch


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A sub-key of the group secret for one purpose (records, bucket pads, IPC handshake...)."""
    return hmac.new(secret, b"unisleep transfer v1 " + purpose.encode(), hashlib.sha256).digest()


def seal(key: bytes, group_id: str, name: str, seq: int, epoch: int, body: dict) -> bytes:
    payload = json.dumps({"k": name, "seq": int(seq), "ep": int(epoch), "b": body},
                         separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()
    if len(payload) > MAX_RECORD:
        raise TransferError(f"control record {name!r} is {human_bytes(len(payload))}, over the limit of "
                            f"{human_bytes(MAX_RECORD)}; send fewer tensors per update")
    head = HEAD.pack(MAGIC, PROTOCOL, 0, len(payload))
    tag = hmac.new(key, group_id.encode() + head + payload, hashlib.sha256).digest()
    return head + payload + tag


def open_record(key: bytes, group_id: str, raw: bytes, *, name: str, peer: str, schema: dict,
                seq: Optional[int] = None, epoch: Optional[int] = None, limit: int = MAX_RECORD) -> tuple[int, int, dict]:
    """Check and decode one record; returns ``(seq, epoch, body)``.

    ``peer`` names who should have written it (for the messages); ``seq``/``epoch``: the values
    the record must carry (None: any, the caller checks).  Raises :class:`ForgedRecordError` when
    the record is not authentic, :class:`TransferError` when an authentic record is malformed or
    of another protocol version."""
    if not isinstance(raw, (bytes, bytearray)):
        raise ForgedRecordError(f"record {name!r} (from {peer}) is not bytes")
    raw = bytes(raw)
    if len(raw) < HEAD.size + TAG_BYTES or len(raw) > limit + HEAD.size + TAG_BYTES:
        raise ForgedRecordError(f"record {name!r} (from {peer}) has {human_bytes(len(raw))}, not a record of this "
                                f"protocol (limit {human_bytes(limit)})")
    magic, proto, _flags, n = HEAD.unpack_from(raw)
    if magic != MAGIC or n != len(raw) - HEAD.size - TAG_BYTES:
        raise ForgedRecordError(f"record {name!r} (from {peer}) has no valid record header")
    head, payload, tag = raw[: HEAD.size], raw[HEAD.size: HEAD.size + n], raw[HEAD.size + n:]
    want = hmac.new(key, group_id.encode() + head + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(want, tag):
        raise ForgedRecordError(f"record {name!r} claiming to come from {peer} fails authentication "
                                "(planted or replayed by a process without the group secret, or the peer "
                                "uses another secret)")
    if proto != PROTOCOL:
        raise TransferError(f"{peer} speaks transfer protocol {proto}, this side {PROTOCOL}: run the same "
                            "unisleep version on both sides")
    try:
        doc = json.loads(payload)
    except ValueError as e:
        raise TransferError(f"record {name!r} from {peer} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"k", "seq", "ep", "b"} or not isinstance(doc["b"], dict):
        raise TransferError(f"record {name!r} from {peer} does not have the record layout")
    if doc["k"] != name:
        raise ForgedRecordError(f"record {name!r} from {peer} was written for key {str(doc['k'])[:80]!r} (replayed)")
    rs, re_ = doc["seq"], doc["ep"]
    if not _is_int(rs) or not _is_int(re_):
        raise TransferError(f"record {name!r} from {peer}: update number and epoch must be integers")
    if seq is not None and rs != seq:
        raise ForgedRecordError(f"record {name!r} from {peer} is for update {rs}, expected {seq} (replayed)")
    if epoch is not None and re_ != epoch:
        raise ForgedRecordError(f"record {name!r} from {peer} is for epoch {re_}, expected {epoch} (replayed)")
    body = doc["b"]
    problem = check_schema(body, schema)
    if problem:
        raise MalformedRecordError(f"record {name!r} from {peer} does not fit its schema: {problem}", rs, re_)
    return rs, re_, body


# --------------------------------------------------------------------------- schemas
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


INT, STR, BOOL, NONE = "int", "str", "bool", "none"
VERSION = "version"  # int, str (<= 256 chars) or null
SPECS = "specs"  # list of [name, [dims], dtype] or null
OPT_STR = "opt_str"


def _check_value(v, t) -> Optional[str]:
    if t == INT:
        return None if _is_int(v) else "an integer"
    if t == STR:
        return None if isinstance(v, str) and len(v) <= MAX_STR else f"a string of at most {MAX_STR} characters"
    if t == OPT_STR:
        return None if v is None or (isinstance(v, str) and len(v) <= MAX_STR) else "a string or null"
    if t == BOOL:
        return None if isinstance(v, bool) else "true or false"
    if t == VERSION:
        ok = v is None or _is_int(v) or (isinstance(v, str) and len(v) <= 256)
        return None if ok else "an integer, a string of at most 256 characters, or null"
    if t == SPECS:
        if v is None:
            return None
        if not isinstance(v, list):
            return "a list of tensor specs"
        for s in v:
            if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and len(s[0]) <= MAX_NAME
                    and isinstance(s[1], list) and len(s[1]) <= MAX_DIMS
                    and all(_is_int(d) and 0 <= d < 2**48 for d in s[1]) and s[2] in DTYPES):
                return f"a list of [name, shape, dtype] (got {str(s)[:80]})"
        return None
    if isinstance(t, tuple):  # one of these literal values
        return None if v in t else f"one of {t}"
    if isinstance(t, re.Pattern):
        return None if isinstance(v, str) and t.fullmatch(v) else f"a string matching {t.pattern}"
    raise AssertionError(t)


def check_schema(body: dict, schema: dict) -> Optional[str]:
    if set(body) != set(schema):
        extra, missing = sorted(set(body) - set(schema))[:4], sorted(set(schema) - set(body))[:4]
        return f"fields differ (unexpected {extra}, missing {missing})"
    for k, t in schema.items():
        why = _check_value(body[k], t)
        if why:
            return f"{k!r} must be {why}"
    return None


HEX = re.compile(r"[0-9a-f]{1,128}")
NAME = re.compile(r"[A-Za-z0-9._\-]{1,128}")

PEER = {"rank": INT, "device_key": STR, "host": STR, "boot": STR, "pid": INT, "pidns": INT, "netns": INT, "uid": INT,
        "nonce": HEX, "insecure": BOOL}
#: ``via``: how the bytes move ("ipc": shared memory; "socket": a Unix socket on one machine;
#: "backend": the process-group backend); ``cipher``: "aes-256-gcm" (every bucket encrypted) or "none";
#: ``control``: where a receiver whose IPC connection is still up answers (acknowledgement, go,
#: done): "ipc" (on that connection), else "store"
HEADER = {"version": VERSION, "previous_version": VERSION, "meta_id": HEX, "specs": SPECS, "bucket_bytes": INT,
          "path": ("collective", "ipc"), "via": ("ipc", "socket", "backend"), "cipher": ("none", "aes-256-gcm"),
          "buckets": INT, "bytes": INT, "ipc": OPT_STR, "verify": BOOL, "keep_buffers": BOOL,
          "control": ("store", "ipc")}
ACK = {"ok": BOOL, "kind": STR, "msg": STR, "connected": BOOL}
GO = {"go": BOOL, "why": STR}
ABORT = {"why": STR}
DONE = {"ok": BOOL, "msg": STR, "version": VERSION}


# --------------------------------------------------------------------------- versions
def _natural(v) -> tuple:
    parts = re.findall(r"\d+|\D+", str(v))
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def version_order(new: Any, old: Any) -> int:
    """-1, 0 or 1: ``new`` before, equal to or after ``old``.  Integers compare as numbers,
    strings by their natural order ("step-9" < "step-10"); an integer and a string compare as
    the integer's decimal string."""
    if _is_int(new) and _is_int(old):
        return (new > old) - (new < old)
    a, b = _natural(new), _natural(old)
    return (a > b) - (a < b)


def check_version(new: Any, old: Any, allow_equal: bool, who: str) -> Optional[str]:
    """Why ``new`` may not follow ``old`` (None: it may); ``old`` None: nothing came before."""
    if new is None or _check_value(new, VERSION):
        return (f"version {new!r} is not a version: give an integer (e.g. the training step) or a string of at "
                "most 256 characters; versions must increase from one update to the next")
    if old is None:
        return None
    order = version_order(new, old)
    if order > 0 or (order == 0 and allow_equal):
        return None
    return (f"version {new!r} does not come after {who}'s version {old!r}: versions must increase "
            "(pass allow_equal_versions=True to resend an equal version)")


__all__ = ["PROTOCOL", "MAX_RECORD", "ForgedRecordError", "MalformedRecordError", "derive_key", "seal", "open_record", "check_schema",
           "version_order", "check_version", "PEER", "HEADER", "ACK", "GO", "ABORT", "DONE"]


def named_error(msg: str) -> TransferError:
    """A peer's error message as the named error it was (``"...: DescriptorLimitError: ..."`` →
    :class:`DescriptorLimitError`), else :class:`TransferError`."""
    from ..errors import DescriptorLimitError, IntrusionError, VersionError

    for cls in (DescriptorLimitError, VersionError, IntrusionError):
        if f"{cls.__name__}: " in msg:
            return cls(msg)
    return TransferError(msg)
