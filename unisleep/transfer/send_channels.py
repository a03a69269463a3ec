"""The sender's channels through the group's backend and through a Unix stream, with the same
``buffer`` / ``post`` / ``end`` verbs as the IPC one (:mod:`.ipc_send`):
:class:`CollectiveSendChannel` (broadcast over the group's backend, optionally encrypted in pieces)
and :class:`SocketSendChannel` (host memory between processes of one machine, over a Unix stream
per receiver).  The messages and helpers they share: :mod:`.channels`."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from ..errors import TransferError
from .channels import ABORT, CIPHERED, END, PIECED, _corrupt, pack_tensor, receiver_failure, wait_work
from .netinfo import descriptor_error
from .manifest import BucketPlan

if TYPE_CHECKING:
    from .ipc_send import IpcSenderState


def host_buffer(sender: Any, slot: int, nbytes: int, device):  # sender: a WeightSender
    """Send buffer ``slot`` of a sender, at least ``nbytes`` (+ :data:`~.cipher.SLACK`); a bucket
    larger than the usual size (one big tensor) gets a buffer of its own."""
    import torch

    from .cipher import SLACK

    cur = sender._coll_slots[slot]
    if cur is None or cur.numel() < nbytes + SLACK:
        t0 = time.perf_counter()
        try:
            if nbytes > sender.bucket_bytes + 4096:
                return torch.empty(nbytes + SLACK, dtype=torch.uint8, device=device)
            cur = sender._coll_slots[slot] = torch.empty(max(nbytes, sender.bucket_bytes + 4096) + SLACK,
                                                         dtype=torch.uint8, device=device)
        finally:
            sender._buffer_s += time.perf_counter() - t0
    return cur


class CollectiveSendChannel:
    """Buckets through the group's backend: a 4-word descriptor, then the bucket, both broadcast
    from rank 0; two send buffers alternate so packing overlaps the transfer in flight.  With a
    cipher (:mod:`.cipher`) each bucket goes in pieces, each encrypted in place just before it is
    broadcast, then its tag."""

    def __init__(self, sender: Any, seq: int, cipher=None):  # sender: the WeightSender that owns this channel
        import torch.distributed as dist

        self.s = sender
        self.seq = seq
        self.pg = sender.group.process_group()
        self.dev = sender.group.device
        self.opts = dist.BroadcastOptions()
        self.opts.rootRank = 0
        self.pending: list[list] = [[], []]
        self.cipher = cipher
        self._open: Optional[_Sealer] = None  # the encrypted bucket being packed

    def _bcast(self, t):
        return self.pg.broadcast([t], self.opts)

    def _desc(self, k: int, nbytes: int, flag: int):
        import torch

        return torch.tensor([self.seq, k, nbytes, flag], dtype=torch.int64, device=self.dev)

    def _finish_pending(self, slot: int) -> None:
        for w in self.pending[slot]:
            if hasattr(w, "wait"):
                wait_work(self.s.group, w)
        self.pending[slot] = []

    def buffer(self, slot: int, nbytes: int):
        self._finish_pending(slot)
        return host_buffer(self.s, slot, nbytes, self.dev)

    def begin(self, plan: BucketPlan, buf, corrupt: bool = False) -> Optional["_Sealer"]:
        """Host memory: the bucket's descriptor goes out now, and each piece of it as soon as it is
        packed (and, with a cipher, encrypted from where the tensors are straight into ``buf``:
        one pass over the bytes) — :class:`_Sealer`.  Device memory: None (packed, then sent)."""
        if buf.device.type != "cpu":
            return None
        d = self._desc(plan.index, plan.total_bytes, PIECED | (CIPHERED if self.cipher is not None else 0))
        self._open = _Sealer(self, plan, buf, [self._bcast(d), d, buf], corrupt)
        return self._open

    def post(self, slot: int, plan: BucketPlan, buf, corrupt: bool = False) -> None:
        n = plan.total_bytes
        if self._open is None:
            if corrupt:
                _corrupt(buf, plan)
            d = self._desc(plan.index, n, 0)
            self.pending[slot] = [self._bcast(d), self._bcast(buf[:n]), d, buf]
            return
        sealer, self._open = self._open, None
        assert sealer is not None and sealer.plan is plan, "an encrypted bucket is posted after it was packed"
        self.pending[slot] = sealer.works

    def end(self, abort: bool) -> None:
        if self._open is not None:  # a bucket broke off while packed: send the rest, unsealed (its tag fails)
            sealer, self._open = self._open, None
            sealer.abandon()
            self.pending[sealer.plan.index % 2] = sealer.works
        for slot in (0, 1):
            self._finish_pending(slot)
        wait_work(self.s.group, self._bcast(self._desc(END, 0, ABORT if abort else 0)))


class _Streamer:
    """One bucket being packed for :class:`SocketSendChannel`: how far it is packed.  The writer
    hears of progress every :data:`STEP` bytes packed (and at the end), not at every tensor: a
    wake-up of the writer thread and a socket write per small tensor cost about a hundred
    microseconds each."""

    #: packed bytes between two wake-ups of the writer
    STEP = 1 << 20

    def __init__(self, plan: BucketPlan, buf, corrupt: bool):
        self.plan, self.buf, self.corrupt = plan, buf, corrupt
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
        if not self.corrupt and upto - self._told >= self.STEP:  # (test hook: a bucket to alter goes once digested)
            self._told = upto
            self.advance(upto)

    def close(self) -> None:
        """After the trailer was written behind the data."""
        if self.corrupt:
            _corrupt(self.buf, self.plan)
        self.advance(self.plan.total_bytes)


class _Sealer:
    """One host bucket being packed for the collective: every piece of :data:`~.cipher.PIECE`
    bytes is broadcast as soon as it is packed, so packing overlaps the transfer even within one
    bucket.  With a cipher each tensor is encrypted from its own memory into the bucket (the
    padding between tensors is zeroed and encrypted in place), and the tag follows the last piece;
    :meth:`close` (after the trailer was written behind the data) sends the rest."""

    def __init__(self, chan: CollectiveSendChannel, plan: BucketPlan, buf, works: list, corrupt: bool):
        from .cipher import pieces, writable_view

        self.chan, self.plan, self.buf, self.works, self.corrupt = chan, plan, buf, works, corrupt
        self.enc = chan.cipher.encryptor(plan.index, plan.total_bytes) if chan.cipher is not None else None
        self.mv = writable_view(buf)
        self.pieces = pieces(plan.total_bytes)
        self.done = 0  # bytes packed (and sealed)
        self.sent = 0  # pieces sent

    def _gap(self, upto: int) -> None:
        if upto > self.done:
            if self.enc is not None:
                self.buf[self.done: upto].zero_()
                self.enc.piece(self.mv, self.done, upto)
            self.done = upto

    def put(self, slot, t) -> None:
        import torch

        self._gap(slot.offset)
        if slot.nbytes and self.enc is not None:
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            src = src.contiguous().reshape(-1).view(torch.uint8)
            self.enc.into(memoryview(src.numpy()), self.mv, slot.offset)
        elif slot.nbytes:
            pack_tensor(self.buf, slot.offset, slot.nbytes, t)
        self.done = slot.offset + slot.nbytes
        if not (self.corrupt and self.enc is None):  # (test hook: a plain bucket to alter goes once digested)
            self._flush(final=False)

    def close(self) -> None:
        import torch

        self._gap(self.plan.data_bytes)
        if self.enc is not None:
            self.enc.piece(self.mv, self.done, self.plan.total_bytes)
        self.done = self.plan.total_bytes
        self._flush(final=True)
        if self.enc is not None:
            tag = torch.frombuffer(bytearray(self.enc.tag()), dtype=torch.uint8)
            self.works += [self.chan._bcast(tag), tag]

    def abandon(self) -> None:
        import torch

        self.done = self.plan.total_bytes
        self._flush(final=True)
        if self.enc is not None:
            tag = torch.zeros(16, dtype=torch.uint8)
            self.works += [self.chan._bcast(tag), tag]

    def _flush(self, final: bool) -> None:
        while self.sent < len(self.pieces):
            off, end = self.pieces[self.sent]
            if end > self.done and not final:
                return
            if self.corrupt and off == 0:  # test hook: on the wire (after encryption, or once digested)
                _corrupt(self.buf, self.plan)
            self.works.append(self.chan._bcast(self.buf[off:end]))
            self.sent += 1
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
                    raise receiver_failure(sender.group, seq, self.epoch, r, e) from e
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
        return host_buffer(self.s, slot, nbytes, self.dev)

    def begin(self, plan: BucketPlan, buf, corrupt: bool = False) -> "_Streamer":
        """The bucket's bytes start to go out as soon as its first tensor is packed: the writer
        follows the packing (:class:`_Streamer`)."""
        self._check()
        st = _Streamer(plan, buf, corrupt)
        self._free[plan.index % 2].clear()
        self._open = st
        self._q.put(st)
        return st

    def post(self, slot: int, plan: BucketPlan, buf, corrupt: bool = False) -> None:
        st, self._open = self._open, None
        assert st is not None and st.plan is plan, "a bucket is posted after it was packed"
        self._check()

    def end(self, abort: bool) -> None:
        if self._open is not None:  # a bucket broke off while packed: the rest goes as it is
            self._open.advance(self._open.plan.total_bytes)
            self._open = None
        self._q.put(None)
        while self._thread.is_alive():
            self._thread.join(0.5)
        self._check()
        for r, conn in self.st.conns.items():
            try:
                conn.send("end", abort=abort, u=self.seq)
            except TransferError as e:
                raise receiver_failure(self.s.group, self.seq, self.epoch, r, e) from e

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
                            raise receiver_failure(self.s.group, self.seq, self.epoch, r, e) from e
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
                    f"the bucket socket to receiver rank {r} failed: {e} (it died or gave up)")) from e
