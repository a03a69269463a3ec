"""The sender's side of the IPC path (colocated: bucket memory shared through a file descriptor):
:class:`IpcSenderState` (the listening Unix socket, who may connect, the secret handshake, one
connection per receiver, the exported buffers) and :class:`IpcSendChannel` (the ``buffer`` /
``post`` / ``end`` verbs over it).  Who may connect and why: :mod:`.channels`."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from ..errors import TransferError
from .channels import (HANDSHAKE_S, STORE_LOOK_S, IpcConn, IpcGoneError, _corrupt, ipc_context, named_error,
                       peer_credentials, receiver_failure, recv_sealed, send_sealed)
from .netinfo import descriptor_error
from .group import TransferGroup
from .manifest import BucketPlan
from .netinfo import user_name
from .peers import _pidns

log = logging.getLogger("unisleep.transfer")


class IpcSenderState:
    """The sender's Unix socket (abstract namespace), one authenticated connection per receiver,
    and the exported bucket buffers (reused across updates).

    A thread accepts from the moment the socket exists, reads each caller's credentials at once
    (``SO_PEERCRED``) and closes a process that is not a receiver of the group (named in
    ``intrusions``, counted under a flood): idle connections of other users never fill the backlog.
    Connections from a receiver's uid wait (at most :data:`MAX_QUEUED`) for :meth:`accept`, which
    runs the secret handshake."""

    MAX_QUEUED = 16

    def __init__(self, group: TransferGroup):
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
        """Take one authenticated connection from each of ``ranks``; refuse everything else."""
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
                if self.fd_error is not None:
                    err, self.fd_error = self.fd_error, None
                    raise err
                item = self._queued.pop(0) if self._queued else None
            if item is None:
                g.check_alive(sorted(want))
                continue
            got = self._admit(*item, want)
            if got is None:
                continue
            r, conn = got
            old = self.conns.pop(r, None)
            if old is not None:
                old.close()
            stream = self.streams.pop(r, None)
            if stream is not None:
                stream.close()
            self.conns[r] = conn
            for ranks_ in self.shared.values():
                ranks_.discard(r)
            want.discard(r)

    def control(self, r: int, op: str, seq: int, what: str, key: str) -> Optional[dict]:
        """Receiver ``r``'s ``op`` message (or its ``error``) of update ``seq`` on its connection,
        skipping what is left there of earlier updates; None when that connection is gone (closed
        and forgotten: its receiver answers in the store and connects again) or the receiver
        answered in the store instead (at ``key``: another receiver object of that rank, whose new
        connection :meth:`accept` takes in place of this one; looked for after
        :data:`STORE_LOOK_S`, then every :data:`STORE_LOOK_S`).  A message out of step (neither that
        nor a late word of an earlier update) closes the connection and raises, as does a dead or
        frozen receiver, or one that says nothing within the group's timeout."""
        import select

        g = self.group
        conn = self.conns.get(r)
        if conn is None:
            return None
        t0 = time.monotonic()
        next_live, next_look, nap = t0 + 0.5, t0 + STORE_LOOK_S, 0.001
        try:
            while True:
                try:
                    ready = select.select([conn.sock], [], [], nap)[0]
                except (OSError, ValueError):
                    raise IpcGoneError(f"the IPC connection of receiver rank {r} is closed") from None
                if not ready:
                    now = time.monotonic()
                    if now >= next_look:
                        next_look = now + STORE_LOOK_S
                        if g.check(key):
                            return None
                    if now >= next_live:
                        next_live = now + 0.5
                        g.check_alive([r])
                    if now - t0 > g.timeout_s:
                        raise TransferError(f"timed out waiting for {what} (on the IPC socket and in the store)")
                    nap = min(nap * 2, STORE_LOOK_S)
                    continue
                msg, fds = conn.recv(what)
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
        except IpcGoneError:
            self._forget(r, conn)
            if g.broken:
                raise
            return None

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
        return r, IpcConn(sock, g, f"{base}/{nonce}{mine}/{r}", "s", "r", f"receiver rank {r}", r)

    def release_buffers(self) -> None:
        """Give the exported bucket buffers back (a receiver's mapping keeps its memory until it
        unmaps it); the socket and the connections stay for the next update."""
        for s in self.slots:
            if s is not None:
                s[1].close()
        self.slots = [None, None]
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
        for s in self.slots:
            if s is not None:
                s[1].close()
        self.slots = [None, None]
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

    def __init__(self, sender: Any, seq: int):  # sender: the WeightSender that owns this channel
        self.s = sender
        self.st: IpcSenderState = sender._ipc
        self.seq = seq
        self.epoch = sender.group.epoch
        self.tmp = None

    def _recv(self, r: int, what: str):
        try:
            return self.st.conns[r].recv(what)
        except TransferError as e:
            raise receiver_failure(self.s.group, self.seq, self.epoch, r, e) from e

    def _wait_free(self, slot: int) -> None:
        st = self.st
        while st.busy[slot]:
            for r in list(st.busy[slot]):
                msg, _ = self._recv(r, f"receiver rank {r} to release bucket memory")
                if msg["op"] in ("free", "ack", "done", "error") and msg["u"] < self.seq:
                    continue  # a late word of an update that broke off
                if msg["op"] == "free" and msg["slot"] in (0, 1):
                    st.busy[msg["slot"]].discard(r)
                elif msg["op"] == "error":
                    raise named_error(f"receiver rank {r}: {msg['msg']}")
                else:
                    raise TransferError(f"receiver rank {r} sent {msg['op']!r} while the sender waited for 'free'")

    def buffer(self, slot: int, nbytes: int):
        st = self.st
        self._wait_free(slot)
        cur = st.slots[slot]
        if cur is None or cur[1].nbytes < nbytes:
            if cur is not None:
                cur[1].close()
                st.shared.pop(cur[0], None)
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

    def post(self, slot: int, plan: BucketPlan, buf, corrupt: bool = False) -> None:
        st = self.st
        if corrupt:
            _corrupt(buf, plan)
        bid, eb = st.slots[slot]
        st.ipc.synchronize(self.s.group.device_index)  # the packing is finished before anyone reads
        have = st.shared.setdefault(bid, set())
        for r, conn in st.conns.items():
            try:
                if r not in have:
                    t0 = time.perf_counter()
                    fd = eb.fd()  # exported once per buffer
                    self.s._buffer_s += time.perf_counter() - t0
                    conn.send("buf", [fd], id=bid, slot=slot, nbytes=eb.nbytes)
                    have.add(r)
                conn.send("bucket", k=plan.index, id=bid, slot=slot, nbytes=plan.total_bytes, u=self.seq)
            except TransferError as e:
                raise receiver_failure(self.s.group, self.seq, self.epoch, r, e) from e
            st.busy[slot].add(r)

    def end(self, abort: bool) -> None:
        st = self.st
        if not abort:
            self._wait_free(0)
            self._wait_free(1)
        for conn in st.conns.values():
            conn.send("end", abort=abort, u=self.seq)
        if abort:
            st.busy = [set(), set()]
