"""The Unix-stream path, both ends: host memory between processes of one machine (the collective
path's default when every member runs on this machine, ``via="socket"``).

Each bucket's bytes go over a Unix stream socket per receiver — one end of a socket pair whose
other end was handed, as a descriptor, over the receiver's authenticated IPC connection
(:mod:`.ipc`; so nobody else can hold it) — after a sealed ``bucket`` message on that connection.
The sender's channel (:class:`SocketSendChannel`) has a thread that writes each bucket's bytes as
soon as they are packed (:class:`_Streamer`), and one bucket while the next is packed; the
receiver's loop (:func:`receive`) reads them into one of two receive buffers (a fresh one when
staged) and hands each bucket to the update's state.

The control messages of an update on this path (acknowledgement, go, done, a receiver's reason
for stopping) travel on that same IPC connection, as on the IPC path: one control plane.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from typing import Any, Optional

from ..errors import TransferError
from .ipc import IpcGoneError, ipc_text, update_messages
from .records import named_error
from .manifest import BucketPlan, pack_tensor
from .netinfo import descriptor_error


def receiver_failure(group: "TransferGroup", seq: int, epoch: int, r: int, e: TransferError,
                     conn=None, wait_s: float = 2.0) -> TransferError:
    """The error to raise when receiver ``r``'s bucket socket failed during update ``seq``: the
    reason the receiver sent on its IPC connection ``conn`` before it hung up (an ``error``, or a
    refused ``done``; looked for up to ``wait_s``), as the named error it was, else ``e``."""
    if group.broken or conn is None or ("receiver rank" in str(e) and type(e) not in (TransferError, IpcGoneError)):
        return e  # a dead or frozen receiver (named already) sends no reason
    deadline = time.monotonic() + wait_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return e
            msg, fds = conn.recv(f"receiver rank {r}'s reason", timeout_s=left)
            for fd in fds:
                os.close(fd)
            if msg["u"] == seq and (msg["op"] == "error" or (msg["op"] == "done" and not msg["ok"])):
                return named_error(f"receiver rank {r} stopped update {seq}: {msg['msg']}")
    except Exception:  # noqa: BLE001 - no better reason than e (the connection is gone, or silent)
        return e


class _Streamer:
    """One bucket being packed for :class:`SocketSendChannel`: how far it is packed.  The writer
    hears of progress every :data:`STEP` bytes packed (and at the end), not at every tensor: a
    wake-up of the writer thread and a socket write per small tensor cost about a hundred
    microseconds each."""

    #: packed bytes between two wake-ups of the writer
    STEP = 1 << 20

    def __init__(self, plan: BucketPlan, buf):
        self.plan, self.buf = plan, buf
        self.ready = 0
        self._told = 0  # what the writer was last told
        self._cv = threading.Condition()

    def advance(self, upto: int) -> None:
        with self._cv:
            self.ready = max(self.ready, upto)
            self._cv.notify_all()

    def wait_past(self, sent: int) -> int:
        with self._cv:
            while self.ready <= sent:
                self._cv.wait(0.5)
            return self.ready

    def put(self, slot, t) -> None:
        if slot.nbytes:
            pack_tensor(self.buf, slot.offset, slot.nbytes, t)
        upto = slot.offset + slot.nbytes
        if upto - self._told >= self.STEP:
            self._told = upto
            self.advance(upto)

    def seal(self) -> None:
        """After the trailer was written behind the data (nothing to do: the trailer goes at
        :meth:`close`)."""

    def close(self) -> None:
        self.advance(self.plan.total_bytes)


class SocketSendChannel:
    """Host memory between processes of one machine: each bucket's bytes go over a Unix stream
    socket per receiver — one end of a socket pair whose other end was handed, as a descriptor,
    over the receiver's authenticated IPC connection (so nobody else can hold it) — after a sealed
    ``bucket`` message on that connection.  A thread writes each bucket's bytes as soon as they are
    packed, and one bucket while the next is packed."""

    WRITE = 4 << 20

    def __init__(self, sender: Any, seq: int):  # sender: the WeightSender that owns this channel
        self.s = sender
        self.st: "IpcSenderState" = sender._ipc
        self.seq = seq
        self.epoch = sender.group.epoch
        self.dev = sender.group.device
        self._q: queue.Queue = queue.Queue()
        self._free = [threading.Event(), threading.Event()]
        for ev in self._free:
            ev.set()
        self._err: Optional[BaseException] = None
        self._open: Optional[_Streamer] = None
        for r, conn in self.st.conns.items():
            if r not in self.st.streams:
                try:
                    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                except OSError as e:
                    raise (descriptor_error(e, "opening a socket for the bucket bytes", "the sender") or e) from None
                try:
                    conn.send("stream", [theirs.fileno()])
                except TransferError as e:
                    mine.close()
                    raise receiver_failure(sender.group, seq, self.epoch, r, e, conn) from e
                finally:
                    theirs.close()
                self.st.streams[r] = mine
        self._thread = threading.Thread(target=self._writer, daemon=True, name="unisleep-transfer-socket-writer")
        self._thread.start()

    def _check(self) -> None:
        if self._err is not None:
            err, self._err = self._err, None
            raise err

    def _wait(self, slot: int) -> None:
        while not self._free[slot].wait(0.5):
            pass
        self._check()

    def buffer(self, slot: int, nbytes: int):
        self._wait(slot)
        return self.s._host_buffer(slot, nbytes)

    def begin(self, plan: BucketPlan, buf) -> "_Streamer":
        """The bucket's bytes start to go out as soon as its first tensor is packed: the writer
        follows the packing (:class:`_Streamer`)."""
        self._check()
        st = _Streamer(plan, buf)
        self._free[plan.index % 2].clear()
        self._open = st
        self._q.put(st)
        return st

    def post(self, slot: int, plan: BucketPlan, buf) -> None:
        st, self._open = self._open, None
        assert st is not None and st.plan is plan, "a bucket is posted after it was packed"
        self._check()

    def end(self, abort: bool, why: str = "") -> None:
        """The update's end (``abort``: broken off, ``why`` tells the receivers, on the IPC
        connection that is this path's control plane)."""
        if self._open is not None:  # a bucket broke off while packed: the rest goes as it is
            self._open.advance(self._open.plan.total_bytes)
            self._open = None
        self._q.put(None)
        while self._thread.is_alive():
            self._thread.join(0.5)
        self._check()
        for r, conn in self.st.conns.items():
            try:
                conn.send("end", abort=abort, u=self.seq, msg=ipc_text(why))
            except TransferError as e:
                raise receiver_failure(self.s.group, self.seq, self.epoch, r, e, conn) from e

    def _writer(self) -> None:
        while True:
            st = self._q.get()
            if st is None:
                return
            plan = st.plan
            try:
                if self._err is None:
                    for r, conn in self.st.conns.items():
                        try:
                            conn.send("bucket", k=plan.index, slot=plan.index % 2, nbytes=plan.total_bytes, u=self.seq)
                        except TransferError as e:
                            raise receiver_failure(self.s.group, self.seq, self.epoch, r, e, conn) from e
                    sent = 0
                    while sent < plan.total_bytes:
                        upto = st.wait_past(sent)
                        for r in self.st.conns:
                            self._write(r, self.st.streams[r], st.buf[sent:upto])
                        sent = upto
            except BaseException as e:  # noqa: BLE001 - raised on the sender's thread
                self._err = e
            finally:
                self._free[plan.index % 2].set()

    def _write(self, r: int, sock: socket.socket, t) -> None:
        g = self.s.group
        mv = memoryview(t.numpy()).cast("B")
        n, off = len(mv), 0
        sock.settimeout(0.5)
        t0 = time.monotonic()
        while off < n:
            try:
                off += sock.send(mv[off: off + self.WRITE])
            except socket.timeout:
                g.check_alive([r])  # a frozen or dead receiver is named within a few seconds
                if time.monotonic() - t0 > g.timeout_s:
                    raise TransferError(f"receiver rank {r} took no bucket bytes for {g.timeout_s:.0f} s") from None
            except OSError as e:
                raise receiver_failure(g, self.seq, self.epoch, r, TransferError(
                    f"the bucket socket to receiver rank {r} failed: {e} (it died or gave up)"),
                    self.st.conns.get(r)) from e


# ---------------------------------------------------------------------------- the receiver's end
def receive(rx, st: "RecvState") -> None:
    """The receiver's loop: the sender's messages of update ``st.seq`` on the IPC connection (the
    socket for the bytes, then each bucket's ``bucket`` message followed by its bytes on that
    socket), every bucket into ``st``, until ``end``."""
    import torch

    for op, msg, fds in update_messages(rx, st):
        if op == "stream":
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise TransferError("the sender's stream message is malformed")
            if rx._stream is not None:
                rx._stream.close()
            rx._stream = socket.socket(fileno=fds[0])
        elif op == "bucket":
            k, nbytes = msg["k"], msg["nbytes"]
            if msg["u"] != st.seq or not 0 <= k < len(st.plans) or nbytes != st.plans[k].total_bytes:
                raise TransferError(f"the sender's bucket message does not fit update {st.seq} (update {msg['u']}, "
                                    f"bucket {k}, {nbytes} bytes)")
            if rx._stream is None:
                raise TransferError("the sender sent a bucket before the socket for its bytes")
            tb = time.perf_counter()
            if rx.staged:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            else:
                cur = rx._rot[k % 2]
                if cur is None or cur.numel() < nbytes:
                    cur = rx._rot[k % 2] = torch.empty(nbytes, dtype=torch.uint8)
                buf = cur[:nbytes]
            rx._buffer_s += time.perf_counter() - tb
            _read_exact(rx, buf, f"bucket {k} of update {st.seq}")
            st.take(k, buf)
        elif op == "end":
            st.end(msg)
            return
        else:
            raise TransferError(f"unexpected message {op!r} from the sender during update {st.seq}")


def _read_exact(rx, buf, what: str) -> None:
    """Read ``buf.numel()`` bytes from the bucket socket into ``buf`` (liveness checked while waiting)."""
    g, sock = rx.group, rx._stream
    mv = memoryview(buf.numpy()).cast("B")
    n, off = len(mv), 0
    sock.settimeout(0.5)
    t0 = time.monotonic()
    while off < n:
        try:
            got = sock.recv_into(mv[off:], n - off)
        except socket.timeout:
            g.check_alive([0])
            if time.monotonic() - t0 > g.timeout_s:
                raise TransferError(f"timed out waiting for {what} from the sender") from None
            continue
        except OSError as e:
            raise TransferError(f"the bucket socket failed while reading {what}: {e}") from e
        if not got:
            raise TransferError(f"the sender closed the bucket socket in the middle of {what} (it died or gave up)")
        off += got
