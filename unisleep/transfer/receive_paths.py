"""The receiving loops of an update, one per path — the collective (broadcast buckets, optionally
encrypted in pieces), the Unix stream (host memory between processes of one machine) and IPC
(bucket memory shared by the sender) — each handing its buckets to the update's
:class:`~unisleep.transfer.staging.RecvState`.  They are methods of
:class:`~unisleep.transfer.receiver.WeightReceiver` (through :class:`_ReceivePaths`) and use its
state: the group, the IPC connection, the bucket buffers."""

from __future__ import annotations

import os
import time

from ..errors import TransferError
from .channels import ABORT, CIPHERED, END, PIECED, IpcConn, wait_work
from .staging import RecvState


def _end(st, msg) -> None:
    """The sender's "end" message closes the update this side receives (aborted or not); an end
    for another update is an error."""
    if msg["u"] != st.seq:
        raise TransferError(f"the sender ended update {msg['u']} while this side received update {st.seq}")
    st.aborted = bool(msg["abort"])


class _ReceivePaths:
    """The receiving loops of :class:`~unisleep.transfer.receiver.WeightReceiver`."""

    # ---------------------------------------------------------------- collective path
    def _recv_collective(self, st: "RecvState") -> None:
        import torch
        import torch.distributed as dist

        from .cipher import SLACK, pieces, writable_view

        pg = self.group.process_group()
        dev = self.group.device
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pending = None  # (bucket, buffer, its work or None, authentic or None)

        def settle(p) -> None:
            if p[2] is not None:
                wait_work(self.group, p[2])
            st.take(p[0], p[1], authentic=p[3])

        while True:
            d = torch.empty(4, dtype=torch.int64, device=dev)
            wait_work(self.group, pg.broadcast([d], opts))
            seq, k, nbytes, flag = d.tolist()
            if k == END:
                if pending is not None:
                    settle(pending)
                st.aborted = bool(flag & ABORT)
                return
            if seq != st.seq:
                raise TransferError(f"out of step: got a bucket of update {seq} while receiving update {st.seq}")
            if not 0 <= k < len(st.plans) or nbytes != st.plans[k].total_bytes:
                raise TransferError(f"bucket descriptor {k} ({nbytes} bytes) is not in the manifest of update {st.seq}")
            if bool(flag & CIPHERED) != (st.cipher is not None):
                raise TransferError(f"bucket {k} is {'' if flag & CIPHERED else 'not '}encrypted; the header said "
                                    f"{'aes-256-gcm' if st.cipher is not None else 'none'}")
            tb = time.perf_counter()
            if self.staged:
                full = torch.empty(nbytes + SLACK, dtype=torch.uint8, device=dev)
            else:
                slot = k % 2
                full = self._rot[slot]
                if full is None or full.numel() < nbytes + SLACK:
                    full = self._rot[slot] = torch.empty(nbytes + SLACK, dtype=torch.uint8, device=dev)
            self._buffer_s += time.perf_counter() - tb
            buf = full[:nbytes]
            if not flag & PIECED:
                w = pg.broadcast([buf], opts)
                if pending is not None:  # verify bucket k-1 while bucket k is in flight
                    settle(pending)
                pending = (k, buf, w, None)
                continue
            # in pieces: every piece is posted at once; each is decrypted as soon as it arrived,
            # while the next is on the wire; the tag comes last
            works = [(off, end, pg.broadcast([full[off:end]], opts)) for off, end in pieces(nbytes)]
            if st.cipher is None:
                if pending is not None:
                    settle(pending)
                pending = (k, buf, works[-1][2] if works else None, None)
                for _off, _end, w in works[:-1]:
                    wait_work(self.group, w)
                continue
            tag = torch.empty(16, dtype=torch.uint8)
            wt = pg.broadcast([tag], opts)
            if pending is not None:
                settle(pending)
            dec = st.cipher.decryptor(k, nbytes)
            mv = writable_view(full)
            for off, end, w in works:
                wait_work(self.group, w)
                dec.piece(mv, off, end)
            wait_work(self.group, wt)
            pending = (k, buf, None, dec.check(bytes(tag.numpy())))

    def _update_messages(self, st: "RecvState"):
        """The sender's messages of update ``st.seq`` on the authenticated IPC connection, as
        ``(op, msg, fds)``; the call-off of an earlier update this receiver refused is skipped."""
        conn = self._conn
        if conn is None or not self._ready:
            raise TransferError("no authenticated IPC connection to the sender")
        while True:
            msg, fds = conn.recv(f"bucket data of update {st.seq} (still serving version {self.version!r})")
            if msg["op"] == "go" and msg["u"] < st.seq and not fds:
                continue
            yield msg["op"], msg, fds

    # ---------------------------------------------------------------- socket path
    def _recv_socket(self, st: "RecvState") -> None:
        import socket as _socket

        import torch

        for op, msg, fds in self._update_messages(st):
            if op == "stream":
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise TransferError("the sender's stream message is malformed")
                if self._stream is not None:
                    self._stream.close()
                self._stream = _socket.socket(fileno=fds[0])
            elif op == "bucket":
                k, nbytes = msg["k"], msg["nbytes"]
                if msg["u"] != st.seq or not 0 <= k < len(st.plans) or nbytes != st.plans[k].total_bytes:
                    raise TransferError(f"the sender's bucket message does not fit update {st.seq} (update {msg['u']}, "
                                        f"bucket {k}, {nbytes} bytes)")
                if self._stream is None:
                    raise TransferError("the sender sent a bucket before the socket for its bytes")
                tb = time.perf_counter()
                if self.staged:
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                else:
                    cur = self._rot[k % 2]
                    if cur is None or cur.numel() < nbytes:
                        cur = self._rot[k % 2] = torch.empty(nbytes, dtype=torch.uint8)
                    buf = cur[:nbytes]
                self._buffer_s += time.perf_counter() - tb
                self._read_exact(buf, f"bucket {k} of update {st.seq}")
                st.take(k, buf)
            elif op == "end":
                _end(st, msg)
                return
            else:
                raise TransferError(f"unexpected message {op!r} from the sender during update {st.seq}")

    def _read_exact(self, buf, what: str) -> None:
        """Read ``buf.numel()`` bytes from the bucket socket into ``buf`` (liveness checked while waiting)."""
        import socket as _socket

        g, sock = self.group, self._stream
        mv = memoryview(buf.numpy()).cast("B")
        n, off = len(mv), 0
        sock.settimeout(0.5)
        t0 = time.monotonic()
        while off < n:
            try:
                got = sock.recv_into(mv[off:], n - off)
            except _socket.timeout:
                g.check_alive([0])
                if time.monotonic() - t0 > g.timeout_s:
                    raise TransferError(f"timed out waiting for {what} from the sender") from None
                continue
            except OSError as e:
                raise TransferError(f"the bucket socket failed while reading {what}: {e}") from e
            if not got:
                raise TransferError(f"the sender closed the bucket socket in the middle of {what} (it died or gave up)")
            off += got
    @staticmethod
    def _free(conn: IpcConn, slot: int, seq: int) -> None:
        """Hand bucket memory back; if the sender already hung up (an abort), its last messages
        are still queued on the socket: the loop reads them (``end``, or the end of the stream)."""
        try:
            conn.send("free", slot=slot, u=seq)
        except TransferError:
            pass

    def _recv_ipc(self, st: "RecvState") -> None:
        import torch

        ipc = self.group.ipc_module()
        dev = self.group.device
        conn = self._conn
        slot_of: dict[str, int] = {}
        for op, msg, fds in self._update_messages(st):
            if op == "buf":
                if len(fds) != 1 or msg["slot"] not in (0, 1) or not msg["id"] or msg["nbytes"] <= 0:
                    for fd in fds:
                        os.close(fd)
                    raise TransferError("the sender's buffer message is malformed")
                old = [b for b, sl in slot_of.items() if sl == msg["slot"] and b != msg["id"]]
                for b in old:
                    slot_of.pop(b)
                    imp = self._imports.pop(b, None)
                    if imp is not None:
                        imp.close()
                prev = self._imports.pop(msg["id"], None)
                if prev is not None:
                    prev.close()
                tb = time.perf_counter()
                self._imports[msg["id"]] = ipc.ImportedBuffer(fds[0], msg["nbytes"], self.group.device_index)
                self._buffer_s += time.perf_counter() - tb
                slot_of[msg["id"]] = msg["slot"]
            elif op == "bucket":
                imp = self._imports.get(msg["id"] or "")
                if msg["u"] != st.seq or imp is None or not 0 <= msg["nbytes"] <= imp.nbytes or msg["slot"] not in (0, 1):
                    raise TransferError(f"the sender's bucket message does not fit update {st.seq} "
                                        f"(update {msg['u']}, buffer {msg['id']!r}, {msg['nbytes']} bytes)")
                src = imp.tensor[: msg["nbytes"]]
                if self.staged:  # copy out, hand the memory back, verify the copy
                    buf = torch.empty(msg["nbytes"], dtype=torch.uint8, device=dev)
                    buf.copy_(src)
                    ipc.synchronize(self.group.device_index)
                    self._free(conn, msg["slot"], st.seq)
                    st.take(msg["k"], buf)
                else:  # verify and apply straight from the shared memory, then hand it back
                    st.take(msg["k"], src)
                    ipc.synchronize(self.group.device_index)
                    self._free(conn, msg["slot"], st.seq)
            elif op == "end":
                _end(st, msg)
                return
            else:
                raise TransferError(f"unexpected IPC message {op!r} from the sender during update {st.seq}")
