"""The IPC path, both ends: colocated sender and receivers (one device, or one machine on the host
platform) share bucket memory through a file descriptor passed over a Unix socket; the vendor's
``ipc`` module makes the shareable memory.

* The IPC socket's messages (:class:`IpcConn`): authenticated, fixed-schema records
  (:mod:`.records`) with a counter per direction; file descriptors attached only to ``buf`` and
  ``stream`` messages; never unpickled.  The Unix-stream path (:mod:`.socket_path`) uses the same
  connections for its ``bucket``/``end`` messages and to hand over its byte socket.
* The sender's end: :class:`IpcSenderState` (the listening socket, who may connect, the secret
  handshake, one connection per receiver, the exported buffers) and :class:`IpcSendChannel`
  (the ``buffer`` / ``post`` / ``end`` verbs over it: pack into shared memory, tell each receiver
  which bucket is where, wait until every receiver is done with it before packing into that memory
  again).
* The receiver's end: :func:`connect_ipc` and :func:`handshake_receiver`, then :func:`receive`
  (map each buffer once, verify and apply each bucket straight from the shared memory — or copy it
  out when staged — and hand the memory back).

Who may connect to the IPC socket (an abstract Unix name, random, published only in the
authenticated header, but listed in ``/proc/net/unix`` for anyone): a thread accepts from the
moment the socket exists, reads the connecting process's credentials (``SO_PEERCRED``) at once
and drops any process whose uid (and pid, in the same pid namespace) is not that of a receiver
of the group — so idle connections of another user never fill the backlog — then a
challenge-response proves the group secret on both sides — the sender sends
a fresh nonce, the receiver answers with its rank and that nonce sealed with a key of the group
secret, the sender answers in kind — and only then does any descriptor travel.  Every refused
connection is closed and logged as an intrusion; the accept loop goes on for the real receivers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from ..errors import TransferError
from . import records as R
from .manifest import BucketPlan
from .netinfo import _pidns, descriptor_error, user_name
from .records import named_error

log = logging.getLogger("unisleep.transfer")

MAX_MSG = 16 << 10  # the largest sealed IPC message (its JSON)
#: the most a message's text (``msg``) takes of it, escaped as JSON
MAX_TEXT = 8 << 10
HANDSHAKE_S = 5.0
#: how long a receiver retries connecting to a full IPC socket (the liveness window)
CONNECT_RETRY_S = 5.0
#: ``ack``, ``go`` and ``done`` are the IPC path's control records (the header says ``"control":
#: "ipc"``): the same fields as the store's records of the other paths (``ok``, ``kind``, ``msg``),
#: for update ``u``; ``end`` carries an abort's reason in ``msg``
#: ``hdr`` carries the next update's header to a receiver connected already (``u``: its number,
#: ``k``: its epoch, ``msg``: the header's JSON, or empty: it is in the store only)
OPS = ("hello", "proof", "welcome", "buf", "bucket", "free", "error", "end", "stream", "ack", "go", "done", "hdr")
#: ``share`` is a ``buf`` message's handle when the vendor's buffers travel as a number instead
#: of a descriptor (:func:`offer_buffer`), in decimal
IPC_MSG = {"op": OPS, "id": R.OPT_STR, "slot": R.INT, "k": R.INT, "nbytes": R.INT, "u": R.INT, "abort": R.BOOL,
           "msg": R.STR, "nonce": R.OPT_STR, "rank": R.INT, "pid": R.INT, "ok": R.BOOL, "kind": R.STR,
           "share": R.OPT_STR}
_BLANK = {"id": None, "slot": 0, "k": 0, "nbytes": 0, "u": 0, "abort": False, "msg": "", "nonce": None, "rank": 0,
          "pid": 0, "ok": True, "kind": "", "share": None}
#: a vendor ipc module's ``SHARE``: how its buffers are handed over.  "fd" (the default): a file
#: descriptor, sent with SCM_RIGHTS.  "pid-handle": a number the exporter makes importable by one
#: process (``ExportBuffer.handle_for(pid)``), given the pid the kernel reports for that receiver's
#: connection (``SO_PEERCRED``, :attr:`IpcConn.peer_pid`) — never a pid the receiver states
SHARE_FD, SHARE_PID_HANDLE = "fd", "pid-handle"


class IpcGoneError(TransferError):
    """The peer closed its end of the IPC connection (it died, gave up, or dropped a connection
    that was out of step and will connect again)."""


def ipc_text(text: str) -> str:
    """``text`` cut to fit an IPC message (at most :data:`MAX_TEXT` bytes once escaped as JSON)."""
    text = text[:R.MAX_STR]
    while len(json.dumps(text, ensure_ascii=True)) > MAX_TEXT:
        text = text[: len(text) * 3 // 4]
    return text


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class IpcConn:
    """One authenticated IPC connection: sealed messages with a counter per direction."""

    def __init__(self, sock: socket.socket, group: "TransferGroup", ctx: str, out_dir: str, in_dir: str, peer: str,
                 peer_rank: int, peer_pid: int = 0):
        self.sock, self.group, self.peer, self.peer_rank = sock, group, peer, peer_rank
        #: the peer process's pid as the kernel reported it when it connected (SO_PEERCRED; the
        #: sender's side only, 0 where unknown)
        self.peer_pid = peer_pid
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
    changed = timeout_s is not None
    if changed:
        sock.settimeout(timeout_s)
    try:
        try:
            data, fds, flags, _addr = socket.recv_fds(sock, MAX_MSG + 64, 4)
        except ConnectionResetError:
            # the peer hung up with messages of this side unread: the kernel says so before the
            # messages the peer sent first (its reason, say), which are still there to read
            changed = True
            sock.settimeout(0)
            data, fds, flags, _addr = socket.recv_fds(sock, MAX_MSG + 64, 4)
    except socket.timeout as e:
        if quiet_timeout:
            raise
        raise TransferError(f"timed out waiting for {what} on the IPC socket ({peer})") from e
    except OSError as e:  # (BlockingIOError: reset, and nothing left to read)
        raise IpcGoneError(f"IPC socket failed while waiting for {what} ({peer}): {e}") from e
    finally:
        if changed and sock.fileno() >= 0:
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


def ipc_context(group: "TransferGroup", name: str) -> str:
    return f"{group.group_id}/ipc/{name.encode('unicode_escape').decode()}"


def connect_ipc(group: "TransferGroup", name: str) -> IpcConn:
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


# ------------------------------------------------------------ the header on the IPC connection
def header_text(hdr: dict) -> str:
    """The header as the ``msg`` of an ``hdr`` message, or "" when it does not fit one (a long
    list of specs: the receiver reads it in the store)."""
    text = json.dumps(hdr, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return text if len(text) <= min(R.MAX_STR, MAX_TEXT) else ""


def header_of(msg: dict) -> Optional[dict]:
    """The header an authentic ``hdr`` message carries (None: read it in the store); raises
    :class:`~.records.MalformedRecordError` when it does not fit the header's schema (the
    receiver refuses that update, as it does a malformed header in the store)."""
    if not msg["msg"]:
        return None
    try:
        hdr = json.loads(msg["msg"])
    except ValueError as e:
        raise R.MalformedRecordError(f"the header on the IPC socket is not JSON: {e}", msg["u"], msg["k"]) from None
    problem = R.check_schema(hdr, R.HEADER) if isinstance(hdr, dict) else "not an object"
    if problem:
        raise R.MalformedRecordError(f"the header on the IPC socket does not fit its schema: {problem}", msg["u"],
                                     msg["k"])
    return hdr


# ---------------------------------------------------------------------------- the sender's end
class IpcSenderState:
    """The sender's Unix socket (abstract namespace), one authenticated connection per receiver,
    and the exported bucket buffers (reused across updates).

    A thread accepts from the moment the socket exists, reads each caller's credentials at once
    (``SO_PEERCRED``) and closes a process that is not a receiver of the group (named in
    ``intrusions``, counted under a flood): idle connections of other users never fill the backlog.
    Connections from a receiver's uid wait (at most :data:`MAX_QUEUED`) for the sender's thread to
    run the secret handshake: while it waits for an answer (:meth:`answer`, the IPC path) or for
    the receivers that said they connect (:meth:`accept`, the Unix-stream path)."""

    MAX_QUEUED = 16

    def __init__(self, group: "TransferGroup"):
        self.group = group
        self.ipc = group.ipc_module()
        self.name = f"\0unisleep-transfer-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            raise (descriptor_error(e, "opening the IPC socket", "the sender") or e) from None
        self.listener.bind(self.name)
        self.listener.listen(max(128, 4 * group.world_size))
        self.listener.settimeout(0.2)
        self.conns: dict[int, IpcConn] = {}
        self.slots: list = [None, None]  # (buffer id, ExportBuffer)
        self.shared: dict[str, set] = {}  # buffer id -> ranks that imported it
        self.busy: list[set] = [set(), set()]  # ranks still reading slot i
        self.streams: dict[int, socket.socket] = {}  # rank -> our end of its bucket-bytes socket (SocketSendChannel)
        self._queued: list[tuple[socket.socket, int, int]] = []  # (socket, pid, uid) of a receiver's uid
        self._cv = threading.Condition()
        self._closed = False
        self.fd_error: Optional[Exception] = None
        self._refused: dict[int, int] = {}  # uid -> connections refused
        self._said = 0.0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="unisleep-transfer-ipc-accept")
        self._thread.start()

    # -- the accepting thread
    def _accept_loop(self) -> None:
        g = self.group
        receivers = [g.peers[r] for r in g.receivers]
        ns = _pidns()
        while not self._closed:
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                self._say_refused()
                continue
            except OSError as e:
                if self._closed:
                    return
                err = descriptor_error(e, "accepting a connection on the IPC socket", "the sender")
                if err is not None:
                    with self._cv:
                        self.fd_error = err
                        self._cv.notify_all()
                    time.sleep(0.2)
                    continue
                log.warning("the IPC socket's accept failed: %s", e)
                time.sleep(0.05)
                continue
            try:
                pid, uid, _gid = peer_credentials(sock)
            except OSError as e:
                sock.close()
                g._intrusion(f"an IPC connection without credentials was refused: {e}")
                continue
            if not any(p.uid == uid and (p.pidns != ns or p.pid == pid) for p in receivers):
                sock.close()
                self._refuse(pid, uid)
                continue
            with self._cv:
                self._queued.append((sock, pid, uid))
                while len(self._queued) > self.MAX_QUEUED:  # the same user as a receiver: trusted, still bounded
                    self._queued.pop(0)[0].close()
                self._cv.notify_all()

    def _refuse(self, pid: int, uid: int) -> None:
        n = self._refused.get(uid, 0)
        self._refused[uid] = n + 1
        if n == 0:
            g = self.group
            g._intrusion(f"refused an IPC connection from pid {pid}, {user_name(uid)}: not a receiver of this group "
                         "(expected " + ", ".join(f"rank {p.rank} pid {p.pid} uid {p.uid}"
                                                  for p in (g.peers[r] for r in g.receivers)) + ")")
            self._said = time.monotonic()
        else:
            self._say_refused()

    def _say_refused(self) -> None:
        if self._said and time.monotonic() - self._said >= 2.0 and any(n > 1 for n in self._refused.values()):
            self.group._intrusion("refused " + ", ".join(f"{n} IPC connections from {user_name(u)}"
                                                         for u, n in self._refused.items())
                                  + " so far: not receivers of this group")
            self._said = time.monotonic()

    # -- the sender's thread
    def accept(self, ranks: Sequence[int]) -> None:
        """Take one authenticated connection from each of ``ranks`` (the Unix-stream path, after
        their acknowledgements in the store said they connect anew); refuse everything else."""
        g = self.group
        want = set(ranks)
        deadline = time.monotonic() + g.timeout_s
        while want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"receivers {sorted(want)} did not connect to the IPC socket within {g.timeout_s:.0f} s")
            with self._cv:
                if not self._queued and self.fd_error is None:
                    self._cv.wait(min(left, 0.5))
            item = self._next_queued()
            if item is None:
                g.check_alive(sorted(want))
                continue
            got = self._admit(*item, want)
            if got is not None:
                self._install(*got)
                want.discard(got[0])

    def admit_queued(self) -> None:
        """Run the secret handshake with every connection the accepting thread queued (a
        receiver's uid); one that passes replaces its receiver's old connection."""
        while True:
            item = self._next_queued()
            if item is None:
                return
            got = self._admit(*item, set(self.group.receivers))
            if got is not None:
                self._install(*got)

    def _next_queued(self) -> Optional[tuple[socket.socket, int, int]]:
        with self._cv:
            if self.fd_error is not None:
                err, self.fd_error = self.fd_error, None
                raise err
            return self._queued.pop(0) if self._queued else None

    def _install(self, r: int, conn: IpcConn) -> None:
        """``conn`` (authenticated) is receiver ``r``'s connection from now on: the old one, its
        bucket-bytes socket and what that receiver had mapped are forgotten."""
        old = self.conns.pop(r, None)
        if old is not None:
            old.close()
        stream = self.streams.pop(r, None)
        if stream is not None:
            stream.close()
        self.conns[r] = conn
        for ranks_ in self.shared.values():
            ranks_.discard(r)

    def answer(self, r: int, op: str, seq: int, what: str) -> dict:
        """Receiver ``r``'s ``op`` message (``ack`` or ``done``, or its ``error``) of update ``seq``
        on its IPC connection — the control plane of the IPC and Unix-socket paths.

        A receiver without a connection (its first update, or after its connection broke off)
        connects meanwhile: every connection the accepting thread queues is admitted while this
        waits, and one of receiver ``r`` (a new receiver object of that rank, say) replaces its old
        connection.  What is left on a connection of earlier updates is skipped.  A message out of
        step (neither that nor a late word of an earlier update) closes the connection and raises,
        as does a dead or frozen receiver (named within a few seconds) or one that says nothing
        within the group's timeout."""
        g = self.group
        t0 = time.monotonic()
        next_live, nap = t0 + 0.5, 0.001
        while True:
            self.admit_queued()
            conn = self.conns.get(r)
            ready = []
            if conn is not None:
                try:
                    ready = select.select([conn.sock], [], [], nap)[0]
                except (OSError, ValueError):
                    self._forget(r, conn)
                    continue
            else:
                with self._cv:
                    if not self._queued and self.fd_error is None:
                        self._cv.wait(nap)
            if not ready:
                now = time.monotonic()
                if now >= next_live:
                    next_live = now + 0.5
                    g.check_alive([r])
                if now - t0 > g.timeout_s:
                    raise TransferError(f"timed out waiting for {what} on the IPC socket" +
                                        ("" if conn is not None else " (it never connected)"))
                nap = min(nap * 2, 0.02)
                continue
            try:
                msg, fds = conn.recv(what)
            except IpcGoneError:  # it hung up: that receiver connects again
                self._forget(r, conn)
                if g.broken:
                    raise
                continue
            for fd in fds:
                os.close(fd)
            if msg["u"] == seq and msg["op"] in (op, "error") and not fds:
                return msg
            if msg["u"] < seq and msg["op"] in ("free", "ack", "done", "error") and not fds:
                continue  # a late word of an update that broke off
            self._forget(r, conn)
            raise TransferError(f"receiver rank {r} sent {msg['op']!r} (update {msg['u']}) on the IPC socket while "
                                f"the sender waited for {what} (update {seq}); that connection was closed (the "
                                "receiver connects again on its next update)")

    def announce(self, seq: int, epoch: int, hdr: Optional[dict]) -> None:
        """Send update ``seq``'s header to every receiver connected already (the header is in the
        store as well, for the others): such a receiver waits for it on its connection, not on
        the store.  A connection that fails is closed: that receiver reads the store."""
        text = header_text(hdr) if hdr is not None else ""
        for r, conn in list(self.conns.items()):
            try:
                conn.send("hdr", u=seq, k=epoch, msg=text)
            except TransferError:
                self._forget(r, conn)

    def _forget(self, r: int, conn: IpcConn) -> None:
        """Close receiver ``r``'s connection ``conn`` and stop using it."""
        conn.close()
        if self.conns.get(r) is conn:
            del self.conns[r]
            stream = self.streams.pop(r, None)  # its bucket-bytes socket came over that connection
            if stream is not None:
                stream.close()

    def _admit(self, sock: socket.socket, pid: int, uid: int, want: set) -> Optional[tuple[int, IpcConn]]:
        g = self.group
        who = f"pid {pid}, uid {uid}"
        sock.settimeout(min(HANDSHAKE_S, g.timeout_s))
        key, base = g.subkey("ipc"), ipc_context(g, self.name)
        nonce = secrets.token_hex(16)
        try:
            send_sealed(sock, key, base + "/hello", "hello", 0, {"nonce": nonce})
            proof, _ = recv_sealed(sock, key, base + "/proof", 0, "the receiver's proof", who, timeout_s=HANDSHAKE_S)
            r = proof["rank"]
            theirs = proof["nonce"] or ""
            if proof["op"] != "proof" or not theirs.startswith(nonce) or len(theirs) <= len(nonce):
                raise TransferError("wrong answer to the challenge")
            if r not in want or g.peers[r].uid != uid or (g.peers[r].pidns == _pidns() and g.peers[r].pid != pid):
                raise TransferError(f"claims rank {r}, which is not waiting or runs as another process")
            mine = theirs[len(nonce):]
            send_sealed(sock, key, base + "/welcome", "welcome", 0, {"nonce": mine, "rank": r})
        except (TransferError, OSError) as e:
            sock.close()
            g._intrusion(f"refused an IPC connection from {who}: {e}")
            return None
        sock.settimeout(g.timeout_s)
        return r, IpcConn(sock, g, f"{base}/{nonce}{mine}/{r}", "s", "r", f"receiver rank {r}", r, peer_pid=pid)

    def drop_slot(self, slot: int) -> None:
        """Give slot ``slot``'s exported buffer back (a receiver's mapping keeps its memory until
        it unmaps it)."""
        cur = self.slots[slot]
        if cur is not None:
            cur[1].close()
            self.shared.pop(cur[0], None)
            self.slots[slot] = None

    def release_buffers(self) -> None:
        """Give the exported bucket buffers back; the socket and the connections stay for the
        next update."""
        self.drop_slot(0)
        self.drop_slot(1)
        self.shared.clear()
        self.busy = [set(), set()]

    def buffer_bytes(self) -> int:
        return sum(s[1].nbytes for s in self.slots if s is not None)

    def close(self) -> None:
        self._closed = True
        for c in self.conns.values():
            c.close()
        self.conns.clear()
        for st in self.streams.values():
            st.close()
        self.streams.clear()
        self.drop_slot(0)
        self.drop_slot(1)
        self.listener.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(2)
        with self._cv:
            for sock, _p, _u in self._queued:
                sock.close()
            self._queued.clear()


class IpcSendChannel:
    """Colocated: pack into shared memory, tell each receiver which bucket is where, wait until
    every receiver has copied it out before packing into that memory again."""

    def __init__(self, sender: Any, seq: int, give_back: bool = False):
        # sender: the WeightSender that owns this channel; give_back: the update's bucket memory
        # goes back at its end (each buffer as soon as every receiver has handed it back)
        self.s = sender
        self.st: IpcSenderState = sender._ipc
        self.seq = seq
        self.give_back = give_back
        self.epoch = sender.group.epoch
        self.tmp = None
        self.last_slot = 1  # the slot of the last bucket posted
        self.ended = False  # an 'end' went out to the receivers

    def _recv(self, r: int, what: str):
        try:
            return self.st.conns[r].recv(what)
        except TransferError as e:
            raise self._failure(r, e) from e

    def _failure(self, r: int, e: TransferError) -> TransferError:
        """The error to raise when receiver ``r``'s connection failed while this side wrote to it:
        the reason the receiver sent before it hung up (its ``error``, still queued on the
        connection), as the named error it was, else ``e``."""
        conn = self.st.conns.get(r)
        try:
            while conn is not None:
                msg, fds = conn.recv("the receiver's reason", timeout_s=0.5)
                for fd in fds:
                    os.close(fd)
                if msg["op"] == "error" or (msg["op"] == "done" and not msg["ok"]):
                    return named_error(f"receiver rank {r} stopped update {self.seq}: {msg['msg']}")
        except TransferError:  # nothing more on it
            pass
        return e

    def _wait_free(self, slot: int) -> None:
        st = self.st
        while st.busy[slot]:
            for r in list(st.busy[slot]):
                msg, _ = self._recv(r, f"receiver rank {r} to release bucket memory")
                if msg["op"] in ("free", "ack", "done", "error") and msg["u"] < self.seq:
                    continue  # a late word of an update that broke off
                if msg["op"] == "free" and msg["slot"] in (0, 1):
                    st.busy[msg["slot"]].discard(r)
                elif msg["op"] == "error" or (msg["op"] == "done" and not msg["ok"]):
                    raise named_error(f"receiver rank {r} stopped update {self.seq}: {msg['msg']}")
                else:
                    raise TransferError(f"receiver rank {r} sent {msg['op']!r} while the sender waited for 'free'")

    def buffer(self, slot: int, nbytes: int):
        st = self.st
        self._wait_free(slot)
        cur = st.slots[slot]
        if cur is None or cur[1].nbytes < nbytes:
            st.drop_slot(slot)
            cap = max(nbytes, self.s.bucket_bytes + 4096)
            t0 = time.perf_counter()
            try:
                buf = st.ipc.ExportBuffer(cap, self.s.group.device_index)
            except OSError as e:
                raise (descriptor_error(e, "making shareable bucket memory", "the sender") or e) from None
            finally:
                self.s._buffer_s += time.perf_counter() - t0
            cur = st.slots[slot] = (uuid.uuid4().hex[:12], buf)
        return cur[1].tensor

    def post(self, slot: int, plan: BucketPlan, buf) -> None:
        st = self.st
        self.last_slot = slot
        bid, eb = st.slots[slot]
        st.ipc.synchronize(self.s.group.device_index)  # the packing is finished before anyone reads
        have = st.shared.setdefault(bid, set())
        for r, conn in st.conns.items():
            try:
                if r not in have:
                    t0 = time.perf_counter()
                    fds, share = offer_buffer(st.ipc, eb, conn)
                    self.s._buffer_s += time.perf_counter() - t0
                    conn.send("buf", fds, id=bid, slot=slot, nbytes=eb.nbytes, share=share)
                    have.add(r)
                conn.send("bucket", k=plan.index, id=bid, slot=slot, nbytes=plan.total_bytes, u=self.seq)
            except TransferError as e:
                raise self._failure(r, e) from e
            st.busy[slot].add(r)

    def end(self, abort: bool, why: str = "") -> None:
        """The update's end (``abort``: broken off, ``why`` tells the receivers).  With one
        receiver, ``end`` follows the last bucket at once (:meth:`_end_early`)."""
        st = self.st
        if abort:
            if not self.ended:  # a receiver that read an 'end' already hears no second one
                self._send_end(True, why)
            st.busy = [set(), set()]
            return
        if len(st.conns) == 1:
            self._end_early()
            return
        # the slot of the last bucket is handed back last: the other one's memory goes back
        # (when the update gives it back) while the receivers still read the last bucket
        for slot in (1 - self.last_slot, self.last_slot):
            self._wait_free(slot)
            self._give_back(slot)
        self._send_end(False, "")

    def _end_early(self) -> None:
        """One receiver: ``end`` goes out behind the last bucket without waiting for its
        ``free`` (the receiver reads them in order: nothing it does changes), then the frees
        are collected — one round trip less per update.  Several receivers: every one hands its
        buckets back before any hears ``end``, so that one failing while it applies still
        aborts the update for all of them."""
        self._send_end(False, "")
        for slot in (1 - self.last_slot, self.last_slot):
            self._wait_free(slot)
            self._give_back(slot)

    def _send_end(self, abort: bool, why: str) -> None:
        self.ended = True
        for conn in self.st.conns.values():
            conn.send("end", abort=abort, u=self.seq, msg=ipc_text(why))

    def _give_back(self, slot: int) -> None:
        if self.give_back:
            t0 = time.perf_counter()
            self.st.drop_slot(slot)
            self.s._released_s += time.perf_counter() - t0


def offer_buffer(ipc, eb, conn: IpcConn) -> tuple[list[int], Optional[str]]:
    """What a ``buf`` message carries to ``conn``'s receiver for exported buffer ``eb``: its fd
    (exported once per buffer), or — for a module whose ``SHARE`` is ``"pid-handle"`` — its
    handle made importable by exactly that receiver's process (the kernel's pid for the
    connection; a connection without one is refused by the module)."""
    if getattr(ipc, "SHARE", SHARE_FD) == SHARE_PID_HANDLE:
        return [], str(eb.handle_for(conn.peer_pid))
    return [eb.fd()], None


def buffer_message_ok(ipc, msg: dict, fds: list[int]) -> bool:
    """Whether a ``buf`` message carries what ``ipc``'s buffers travel as: one fd, or (a
    ``"pid-handle"`` module) no fd and a decimal handle."""
    if getattr(ipc, "SHARE", SHARE_FD) == SHARE_PID_HANDLE:
        share = msg["share"] or ""
        return not fds and share.isdigit() and len(share) <= 20
    return len(fds) == 1


def import_buffer(ipc, msg: dict, fds: list[int], device_index: int):
    """The receiver's mapping of a checked ``buf`` message's buffer (its fd, or its handle)."""
    if getattr(ipc, "SHARE", SHARE_FD) == SHARE_PID_HANDLE:
        return ipc.ImportedBuffer(int(msg["share"]), msg["nbytes"], device_index)
    return ipc.ImportedBuffer(fds[0], msg["nbytes"], device_index)


# ---------------------------------------------------------------------------- the receiver's end
def update_messages(rx, st: "RecvState"):
    """The sender's messages of update ``st.seq`` on the authenticated IPC connection, as
    ``(op, msg, fds)``; the call-off of an earlier update this receiver refused is skipped."""
    conn = rx._conn
    if conn is None or not rx._ready:
        raise TransferError("no authenticated IPC connection to the sender")
    while True:
        msg, fds = conn.recv(f"bucket data of update {st.seq} (still serving version {rx.version!r})")
        if msg["op"] == "go" and msg["u"] < st.seq and not fds:
            continue
        if msg["op"] == "hdr" and msg["u"] <= st.seq and not fds:
            continue  # this update's header, which this side took from the store meanwhile
        yield msg["op"], msg, fds


def _free(conn: IpcConn, slot: int, seq: int) -> None:
    """Hand bucket memory back; if the sender already hung up (an abort), its last messages are
    still queued on the socket: the loop reads them (``end``, or the end of the stream)."""
    try:
        conn.send("free", slot=slot, u=seq)
    except TransferError:
        pass


def receive(rx, st: "RecvState") -> None:
    """The receiver's loop: the sender's messages of update ``st.seq`` on the IPC connection —
    ``buf`` (a shared buffer, mapped once), ``bucket`` (which bucket is where: verified and applied,
    or copied out when staged, then handed back with ``free``) — until ``end``."""
    import torch

    ipc = rx.group.ipc_module()
    dev = rx.group.device
    conn = rx._conn
    slot_of: dict[str, int] = {}
    for op, msg, fds in update_messages(rx, st):
        if op == "buf":
            if msg["slot"] not in (0, 1) or not msg["id"] or msg["nbytes"] <= 0 or not buffer_message_ok(ipc, msg, fds):
                for fd in fds:
                    os.close(fd)
                raise TransferError("the sender's buffer message is malformed")
            old = [b for b, sl in slot_of.items() if sl == msg["slot"] and b != msg["id"]]
            for b in old:
                slot_of.pop(b)
                imp = rx._imports.pop(b, None)
                if imp is not None:
                    imp.close()
            prev = rx._imports.pop(msg["id"], None)
            if prev is not None:
                prev.close()
            tb = time.perf_counter()
            rx._imports[msg["id"]] = import_buffer(ipc, msg, fds, rx.group.device_index)
            rx._buffer_s += time.perf_counter() - tb
            slot_of[msg["id"]] = msg["slot"]
        elif op == "bucket":
            imp = rx._imports.get(msg["id"] or "")
            if msg["u"] != st.seq or imp is None or not 0 <= msg["nbytes"] <= imp.nbytes or msg["slot"] not in (0, 1):
                raise TransferError(f"the sender's bucket message does not fit update {st.seq} "
                                    f"(update {msg['u']}, buffer {msg['id']!r}, {msg['nbytes']} bytes)")
            src = imp.tensor[: msg["nbytes"]]
            if rx.staged:  # copy out, hand the memory back, verify the copy
                buf = torch.empty(msg["nbytes"], dtype=torch.uint8, device=dev)
                buf.copy_(src)
                ipc.synchronize(rx.group.device_index)
                _free(conn, msg["slot"], st.seq)
                st.take(msg["k"], buf)
            else:  # verify and apply straight from the shared memory, then hand it back
                st.take(msg["k"], src)
                ipc.synchronize(rx.group.device_index)
                _free(conn, msg["slot"], st.seq)
        elif op == "end":
            st.end(msg)
            return
        else:
            raise TransferError(f"unexpected IPC message {op!r} from the sender during update {st.seq}")
