"""How bucket bytes move once an update is under way.

* the bucket descriptor's flags (``END``, ``ABORT``) on the collective path;
* the IPC socket (:class:`IpcConn`): authenticated, fixed-schema records (:mod:`.records`), file
  descriptors attached only to ``buf`` messages; never unpickled;
* the sender's channels, with the same ``buffer`` / ``post`` / ``end`` verbs:
  :class:`~.send_channels.CollectiveSendChannel` (broadcast over the group's backend),
  :class:`~.send_channels.SocketSendChannel` (a Unix stream) and :class:`~.ipc_send.IpcSendChannel`
  (shared memory, colocated), the latter over :class:`~.ipc_send.IpcSenderState` (the listening
  socket, one connection per receiver, the exported buffers); this module holds what they share
  (the IPC messages, the descriptor flags, :func:`wait_work`, :func:`receiver_failure`).

Who may connect to the IPC socket (an abstract Unix name, random, published only in the
authenticated header, but listed in ``/proc/net/unix`` for anyone): a thread accepts from the
moment the socket exists, reads the connecting process's credentials (``SO_PEERCRED``) at once
and drops any process whose uid (and pid, in the same pid namespace) is not that of a receiver
of the group — so idle connections of another user never fill the backlog — then a
challenge-response proves the group secret on both sides — the sender sends
a fresh nonce, the receiver answers with its rank and that nonce sealed with a key of the group
secret, the sender answers in kind — and only then does any descriptor travel.  Every refused
connection is closed and logged as an intrusion; the accept loop goes on for the real receivers.

The receiving loops of both paths are methods of :class:`~unisleep.transfer.receiver.WeightReceiver`
(:mod:`.receive_paths`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import socket
import struct
import time
from typing import Optional, Sequence

from ..errors import TransferError
from . import records as R
from .netinfo import descriptor_error
from .group import TransferGroup
from .manifest import BucketPlan


log = logging.getLogger("unisleep.transfer")

ABORT, END = 1, -1  # descriptor flag: the update was aborted; descriptor bucket index: no more buckets
CIPHERED = 2  # descriptor flag: the bucket's pieces are encrypted, and its tag follows them (.cipher)
PIECED = 4  # descriptor flag: the bucket follows in pieces of cipher.PIECE bytes
MAX_MSG = 16 << 10  # the largest sealed IPC message (its JSON)
#: the most a message's text (``msg``) takes of it, escaped as JSON
MAX_TEXT = 8 << 10
HANDSHAKE_S = 5.0
#: how long a receiver retries connecting to a full IPC socket (the liveness window)
CONNECT_RETRY_S = 5.0
#: the sender, waiting for a connected receiver's answer on the IPC socket, looks in the store for
#: it after this long and then this often (a receiver answers there only when it connects anew)
STORE_LOOK_S = 0.02
#: ``ack``, ``go`` and ``done`` carry an update's control records between a sender and a receiver
#: whose connection is already up (the header says ``"control": "ipc"``): the same fields as the
#: store's records (``ok``, ``kind``, ``msg``), for update ``u``
OPS = ("hello", "proof", "welcome", "buf", "bucket", "free", "error", "end", "stream", "ack", "go", "done")
IPC_MSG = {"op": OPS, "id": R.OPT_STR, "slot": R.INT, "k": R.INT, "nbytes": R.INT, "u": R.INT, "abort": R.BOOL,
           "msg": R.STR, "nonce": R.OPT_STR, "rank": R.INT, "pid": R.INT, "ok": R.BOOL, "kind": R.STR}
_BLANK = {"id": None, "slot": 0, "k": 0, "nbytes": 0, "u": 0, "abort": False, "msg": "", "nonce": None, "rank": 0,
          "pid": 0, "ok": True, "kind": ""}


class IpcGoneError(TransferError):
    """The peer closed its end of the IPC connection (it died, gave up, or dropped a connection
    that was out of step and will connect again)."""


def ipc_text(text: str) -> str:
    """``text`` cut to fit an IPC message (at most :data:`MAX_TEXT` bytes once escaped as JSON)."""
    import json

    text = text[:R.MAX_STR]
    while len(json.dumps(text, ensure_ascii=True)) > MAX_TEXT:
        text = text[: len(text) * 3 // 4]
    return text


def named_error(msg: str) -> TransferError:
    """A peer's error message as the named error it was (``"...: DescriptorLimitError: ..."`` →
    :class:`DescriptorLimitError`), else :class:`TransferError`."""
    from ..errors import DescriptorLimitError, IntrusionError, VersionError

    for cls in (DescriptorLimitError, VersionError, IntrusionError):
        if f"{cls.__name__}: " in msg:
            return cls(msg)
    return TransferError(msg)


def receiver_failure(group: TransferGroup, seq: int, epoch: int, r: int, e: TransferError,
                     wait_s: float = 0.5) -> TransferError:
    """The error to raise when receiver ``r``'s connection failed during update ``seq``: the
    reason the receiver wrote in its ``done`` record (it writes it before hanging up; looked for
    up to ``wait_s``), as the named error it was, else ``e``."""
    if group.broken or ("receiver rank" in str(e) and type(e) not in (TransferError, IpcGoneError)):
        return e  # a dead or frozen receiver (named already) writes no reason
    deadline = time.monotonic() + wait_s
    while True:
        try:
            raw = group.store.fetch(f"u{seq}/done/{r}", 1 << 16)
            if raw is not None:
                _, _, body = R.open_record(group._rec_key, group.group_id, raw, name=f"u{seq}/done/{r}",
                                           peer=f"receiver rank {r}", schema=R.DONE, seq=seq, epoch=epoch,
                                           limit=1 << 16)
                if not body["ok"]:
                    return named_error(f"receiver rank {r} stopped update {seq}: {body['msg']}")
                return e
        except Exception:  # noqa: BLE001 - no better reason than e
            return e
        if time.monotonic() > deadline:
            return e
        time.sleep(0.01)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class IpcConn:
    """One authenticated IPC connection: sealed messages with a counter per direction."""

    def __init__(self, sock: socket.socket, group: TransferGroup, ctx: str, out_dir: str, in_dir: str, peer: str,
                 peer_rank: int):
        self.sock, self.group, self.peer, self.peer_rank = sock, group, peer, peer_rank
        self.key = group.subkey("ipc")
        self.ctx = ctx
        self.out_dir, self.in_dir = out_dir, in_dir
        self.n_out = self.n_in = 1

    def send(self, op: str, fds: Sequence[int] = (), **fields) -> None:
        send_sealed(self.sock, self.key, f"{self.ctx}/{self.out_dir}", op, self.n_out, fields, fds, peer=self.peer)
        self.n_out += 1

    def recv(self, what: str, timeout_s: Optional[float] = None) -> tuple[dict, list[int]]:
        """The next message; while waiting, the peer's liveness is checked every half second (a
        frozen or vanished peer ends the wait within a few seconds, named)."""
        limit = self.group.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        while True:
            try:
                body, fds = recv_sealed(self.sock, self.key, f"{self.ctx}/{self.in_dir}", self.n_in, what, self.peer,
                                        timeout_s=min(0.5, max(0.01, limit - (time.monotonic() - t0))),
                                        quiet_timeout=True)
                break
            except socket.timeout:
                if time.monotonic() - t0 >= limit:
                    raise TransferError(f"timed out waiting for {what} on the IPC socket ({self.peer})") from None
                self.group.check_alive([self.peer_rank])
        self.n_in += 1
        return body, fds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def send_sealed(sock: socket.socket, key: bytes, ctx: str, op: str, n: int, fields: dict, fds: Sequence[int] = (),
                peer: str = "the peer") -> None:
    body = dict(_BLANK, op=op, **fields)
    data = R.seal(key, ctx, "ipc", n, 0, body)
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendall(data)
    except OSError as e:
        raise TransferError(f"the IPC socket failed sending {op!r} to {peer}: {e} (it died or gave up)") from e


def recv_sealed(sock: socket.socket, key: bytes, ctx: str, n: Optional[int], what: str, peer: str,
                timeout_s: Optional[float] = None, quiet_timeout: bool = False) -> tuple[dict, list[int]]:
    old = sock.gettimeout()
    if timeout_s is not None:
        sock.settimeout(timeout_s)
    try:
        data, fds, flags, _addr = socket.recv_fds(sock, MAX_MSG + 64, 4)
    except socket.timeout as e:
        if quiet_timeout:
            raise
        raise TransferError(f"timed out waiting for {what} on the IPC socket ({peer})") from e
    except OSError as e:
        raise IpcGoneError(f"IPC socket failed while waiting for {what} ({peer}): {e}") from e
    finally:
        if timeout_s is not None:
            sock.settimeout(old)
    try:
        if flags & socket.MSG_CTRUNC:  # the kernel dropped the descriptors sent: no room for them here
            raise descriptor_error(OSError(errno.EMFILE, "descriptors dropped (MSG_CTRUNC)"),
                                   f"receiving {what} from {peer}")
        if not data:
            raise IpcGoneError(f"{peer} closed the IPC socket while this side waited for {what} (it died or gave up)")
        _, _, body = R.open_record(key, ctx, data, name="ipc", peer=peer, schema=IPC_MSG, seq=n, epoch=0,
                                   limit=MAX_MSG)
        if fds and body["op"] not in ("buf", "stream"):
            raise TransferError(f"{peer} attached descriptors to a {body['op']!r} message")
        return body, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def ipc_context(group: TransferGroup, name: str) -> str:
    return f"{group.group_id}/ipc/{name.encode('unicode_escape').decode()}"


def connect_ipc(group: TransferGroup, name: str) -> IpcConn:
    """Receiver side: connect to the sender's socket (the handshake follows with
    :func:`handshake_receiver`).  A full backlog (``EAGAIN``) is retried for up to
    :data:`CONNECT_RETRY_S` seconds: the sender's accepting thread drains it."""
    deadline = time.monotonic() + min(CONNECT_RETRY_S, group.timeout_s)
    delay = 0.002
    while True:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            raise (descriptor_error(e, "connecting to the sender's IPC socket", f"receiver rank {group.rank}")
                   or e) from None
        s.settimeout(group.timeout_s)
        try:
            s.connect(name)
        except (BlockingIOError, InterruptedError) as e:
            s.close()
            if time.monotonic() > deadline:
                raise TransferError(f"the sender's IPC socket stayed full for {CONNECT_RETRY_S:.0f} s ({e}): its "
                                    "accepting thread is not draining it") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            continue
        except OSError:
            s.close()
            raise
        return IpcConn(s, group, ipc_context(group, name), "r", "s", "the sender (rank 0)", 0)


def handshake_receiver(conn: IpcConn, timeout_s: float) -> None:
    """Receiver side: answer the sender's challenge, check its answer to ours."""
    g = conn.group
    key, base = conn.key, conn.ctx
    hello, _ = recv_sealed(conn.sock, key, base + "/hello", 0, "the sender's hello", conn.peer, timeout_s=timeout_s)
    if hello["op"] != "hello" or not hello["nonce"]:
        raise TransferError("the IPC peer did not start with a hello; not the sender of this group")
    mine = secrets.token_hex(16)
    send_sealed(conn.sock, key, base + "/proof", "proof", 0, {"rank": g.rank, "nonce": hello["nonce"] + mine,
                                                                "pid": os.getpid()})
    welcome, _ = recv_sealed(conn.sock, key, base + "/welcome", 0, "the sender's welcome", conn.peer, timeout_s=timeout_s)
    if welcome["op"] != "welcome" or welcome["nonce"] != mine or welcome["rank"] != g.rank:
        raise TransferError("the IPC peer's answer to this receiver's challenge is wrong; not the sender of this group")
    conn.ctx = f"{base}/{hello['nonce']}{mine}/{g.rank}"
def pack_tensor(buf, offset: int, nbytes: int, t) -> None:
    """Copy tensor ``t`` (``nbytes`` bytes, its spec checked) into ``buf[offset:]``: a plain
    memory copy when both are dense host memory (a microsecond or two, where a tensor view and
    ``copy_`` cost tens of microseconds per small tensor), else through torch."""
    import torch

    if (t.device.type == "cpu" and buf.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.numel() * t.element_size() == nbytes
            and offset + nbytes <= buf.numel()):
        ctypes.memmove(buf.data_ptr() + offset, t.data_ptr(), nbytes)
    else:
        buf[offset: offset + nbytes].view(t.dtype).view(t.shape).copy_(t)


def _corrupt(buf, plan: BucketPlan) -> None:
    """Test hook (``WeightSender._faults["corrupt"]``): flip the first byte of the bucket's first tensor."""
    if plan.slots:
        o = plan.slots[0].offset
        buf[o: o + 1].bitwise_not_()
def wait_work(group: TransferGroup, work) -> None:
    """Wait for a collective's work object, checking the other ranks' liveness meanwhile: a dead
    peer ends the wait within a few seconds (and names the peer) instead of the group timeout."""
    if not hasattr(work, "is_completed"):
        work.wait()
        return
    delay, t0, next_live = 0.0002, time.monotonic(), time.monotonic() + 0.5
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_live:
            next_live = now + 0.5
            group.check_alive([p.rank for p in group.peers if p.rank != group.rank])
            if now - t0 > group.timeout_s:
                raise TransferError(f"a collective did not complete within {group.timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.001)
    work.wait()
