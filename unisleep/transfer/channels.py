"""How bucket bytes move once an update is under way.

* the bucket descriptor's flags (``END``, ``ABORT``) on the collective path;
* the IPC socket: pickled messages with file descriptors attached (:func:`send_msg`,
  :func:`recv_msg`);
* the sender's two channels, with the same ``buffer`` / ``post`` / ``end`` verbs:
  :class:`CollectiveSendChannel` (broadcast over the group's backend) and :class:`IpcSendChannel`
  (shared memory, colocated), the latter over :class:`IpcSenderState` (the listening socket, one
  connection per receiver, the exported buffers).

The receiving loops of both paths are methods of :class:`~unisleep.transfer.receiver.WeightReceiver`.
"""

from __future__ import annotations

import os
import pickle
import socket
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import TransferError
from .group import TransferGroup
from .manifest import BucketPlan

if TYPE_CHECKING:
    from .sender import WeightSender

ABORT, END = 1, -1  # descriptor flag: the update was aborted; descriptor bucket index: no more buckets


def send_msg(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [pickle.dumps(obj)], list(fds))


def recv_msg(sock: socket.socket, what: str) -> tuple[Any, list[int]]:
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
    except socket.timeout as e:
        raise TransferError(f"timed out waiting for {what} on the IPC socket") from e
    except OSError as e:
        raise TransferError(f"IPC socket failed while waiting for {what}: {e}") from e
    if not data:
        for fd in fds:
            os.close(fd)
        raise TransferError(f"the peer closed the IPC socket while this side waited for {what} (it died or gave up)")
    return pickle.loads(data), fds


class CollectiveSendChannel:
    """Buckets through the group's backend: a 4-word descriptor, then the bucket, both broadcast
    from rank 0; two send buffers alternate so packing overlaps the transfer in flight."""

    def __init__(self, sender: WeightSender, seq: int):
        import torch.distributed as dist

        self.s = sender
        self.seq = seq
        self.pg = sender.group.process_group()
        self.dev = sender.group.device
        self.opts = dist.BroadcastOptions()
        self.opts.rootRank = 0
        self.pending: list[list] = [[], []]

    def _bcast(self, t):
        return self.pg.broadcast([t], self.opts)

    def _desc(self, k: int, nbytes: int, flag: int):
        import torch

        return torch.tensor([self.seq, k, nbytes, flag], dtype=torch.int64, device=self.dev)

    def buffer(self, slot: int, nbytes: int):
        import torch

        for w in self.pending[slot]:
            if hasattr(w, "wait"):
                w.wait()
        self.pending[slot] = []
        cur = self.s._coll_slots[slot]
        cap = max(nbytes, self.s.bucket_bytes + 4096)
        if cur is None or cur.numel() < nbytes:
            # a bucket larger than the usual size (one big tensor) gets a buffer of its own
            if nbytes > self.s.bucket_bytes + 4096:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            cur = self.s._coll_slots[slot] = torch.empty(cap, dtype=torch.uint8, device=self.dev)
        return cur

    def post(self, slot: int, plan: BucketPlan, buf) -> None:
        d = self._desc(plan.index, plan.total_bytes, 0)
        self.pending[slot] = [self._bcast(d), self._bcast(buf[: plan.total_bytes]), d, buf]

    def end(self, abort: bool) -> None:
        for slot in (0, 1):
            for w in self.pending[slot]:
                if hasattr(w, "wait"):
                    w.wait()
            self.pending[slot] = []
        self._bcast(self._desc(END, 0, ABORT if abort else 0)).wait()


class IpcSenderState:
    """The sender's Unix socket (abstract namespace), one connection per receiver, and the
    exported bucket buffers (reused across updates)."""

    def __init__(self, group: TransferGroup):
        self.group = group
        self.ipc = group.ipc_module()
        self.name = f"\0unisleep-transfer-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.name)
        self.listener.listen(max(8, group.world_size))
        self.listener.settimeout(group.timeout_s)
        self.conns: dict[int, socket.socket] = {}
        self.slots: list = [None, None]  # (buffer id, ExportBuffer)
        self.shared: dict[int, set] = {}  # buffer id -> ranks that imported it
        self.busy: list[set] = [set(), set()]  # ranks still reading slot i

    def accept(self, ranks: Sequence[int]) -> None:
        want = set(ranks)
        while want:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout as e:
                raise TransferError(f"receivers {sorted(want)} did not connect to the IPC socket") from e
            conn.settimeout(self.group.timeout_s)
            hello, _ = recv_msg(conn, "the receiver's hello")
            r = hello["rank"]
            old = self.conns.pop(r, None)
            if old is not None:
                old.close()
            self.conns[r] = conn
            for ranks_ in self.shared.values():
                ranks_.discard(r)
            want.discard(r)

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.conns.clear()
        for s in self.slots:
            if s is not None:
                s[1].close()
        self.slots = [None, None]
        self.listener.close()


class IpcSendChannel:
    """Colocated: pack into shared memory, tell each receiver which bucket is where, wait until
    every receiver has copied it out before packing into that memory again."""

    def __init__(self, sender: WeightSender, seq: int):
        self.s = sender
        self.st: IpcSenderState = sender._ipc
        self.seq = seq
        self.tmp = None

    def _wait_free(self, slot: int) -> None:
        st = self.st
        while st.busy[slot]:
            for r in list(st.busy[slot]):
                msg, _ = recv_msg(st.conns[r], f"receiver rank {r} to release bucket memory")
                if msg.get("op") == "free":
                    st.busy[msg["slot"]].discard(r)
                elif msg.get("op") == "error":
                    raise TransferError(f"receiver rank {r}: {msg['msg']}")

    def buffer(self, slot: int, nbytes: int):
        st = self.st
        self._wait_free(slot)
        cur = st.slots[slot]
        if cur is None or cur[1].nbytes < nbytes:
            if cur is not None:
                cur[1].close()
                st.shared.pop(cur[0], None)
            cap = max(nbytes, self.s.bucket_bytes + 4096)
            buf = st.ipc.ExportBuffer(cap, self.s.group.device_index)
            cur = st.slots[slot] = (uuid.uuid4().hex[:12], buf)
        return cur[1].tensor

    def post(self, slot: int, plan: BucketPlan, buf) -> None:
        st = self.st
        bid, eb = st.slots[slot]
        st.ipc.synchronize(self.s.group.device_index)  # the packing is finished before anyone reads
        have = st.shared.setdefault(bid, set())
        for r, conn in st.conns.items():
            if r not in have:
                send_msg(conn, {"op": "buf", "id": bid, "slot": slot, "nbytes": eb.nbytes}, [eb.fd()])
                have.add(r)
            send_msg(conn, {"op": "bucket", "k": plan.index, "id": bid, "slot": slot, "nbytes": plan.total_bytes})
            st.busy[slot].add(r)

    def end(self, abort: bool) -> None:
        st = self.st
        if not abort:
            self._wait_free(0)
            self._wait_free(1)
        for conn in st.conns.values():
            send_msg(conn, {"op": "end", "abort": abort})
        if abort:
            st.busy = [set(), set()]
