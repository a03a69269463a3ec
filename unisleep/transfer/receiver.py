"""``WeightReceiver``: the engine's side of an update (ranks >= 1 of the group) — guard and target
checks before a byte moves, the receiving loops of the collective and IPC paths, then verify,
apply and commit (through :class:`~unisleep.transfer.staging.RecvState`)."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable, Optional, Sequence

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError
from .channels import ABORT, END, recv_msg, send_msg
from .group import TransferGroup
from .manifest import TensorSpec, plan_buckets
from .names import short_names, tensor_pairs
from .report import TransferReport
from .staging import RecvState, VerifyError


class WeightReceiver:
    """Engine side (rank ≥ 1 of ``group``).

    Apply with ``apply`` — a callable taking a list of ``(name, tensor)`` pairs, e.g.
    ``model.load_weights`` (the tensors are views of transfer memory, valid during the call) — or
    in place into ``target``: a mapping name → tensor, an ``nn.Module`` (parameters and buffers,
    e.g. ones adopted by a :class:`~unisleep.MemoryLifecycle`).

    ``guard``: a :class:`~unisleep.MemoryLifecycle` (its ``guard_tags``, default ``"weights"``
    or else every tag, must be awake) or a callable returning True when the target may be written.
    A closed guard makes ``receive`` raise :class:`InvalidTransitionError` before a byte moves.

    ``staged`` (default True): every bucket is verified and held until the whole update is good,
    then applied; the previous version stays intact on any failure (costs one update's size of
    memory on the group's device).  ``staged=False`` applies each verified bucket at once
    (two bucket buffers only) — a failure part-way then leaves the target mixed, which the error
    says, and ``consistent`` becomes False.
    """

    def __init__(self, group: TransferGroup, *, apply: Optional[Callable] = None, target=None, guard=None,
                 staged: bool = True, guard_tags: Optional[Sequence[str]] = None, initial_version: Any = None):
        if group.is_sender:
            raise InvalidArgumentError("WeightReceiver runs on ranks >= 1; rank 0 is the sender")
        if apply is not None and target is not None:
            raise InvalidArgumentError("give apply= or target=, not both")
        if apply is None and target is None:
            raise InvalidArgumentError("a receiver needs apply= (e.g. model.load_weights) or target= (tensors to update in place)")
        self.group = group
        self.apply = apply
        self.target = target
        self.guard = guard
        self.guard_tags = list(guard_tags) if guard_tags else None
        self.staged = staged
        self.version: Any = initial_version
        self.consistent = True
        self._meta: dict[str, tuple] = {}
        self._sock: Optional[socket.socket] = None
        self._sock_name: Optional[str] = None
        self._imports: dict[str, Any] = {}
        self._rot: list = [None, None]
        self.last_report: Optional[TransferReport] = None

    # ---------------------------------------------------------------- checks before bytes
    def check_guard(self) -> None:
        """Raise :class:`InvalidTransitionError` if the target memory may not be written now."""
        g = self.guard
        if g is None:
            return
        if hasattr(g, "state") and callable(g.state):
            st = g.state()
            tags = self.guard_tags or (["weights"] if "weights" in st else list(st))
            asleep = {t: st.get(t, "unknown") for t in tags if st.get(t) != "awake"}
            if asleep:
                raise InvalidTransitionError(
                    "cannot receive weights into memory that is asleep ("
                    + ", ".join(f"{t}: {s}" for t, s in asleep.items())
                    + "); wake the weights first (lifecycle.wake_up(['weights'])), then receive. Nothing was transferred."
                )
        elif callable(g):
            if not g():
                raise InvalidTransitionError(
                    "the receiver's guard says the target memory may not be written now (asleep?); "
                    "wake the weights first, then receive. Nothing was transferred."
                )
        else:
            raise InvalidArgumentError(f"guard must be a MemoryLifecycle or a callable, got {type(g).__name__}")

    def _target_map(self) -> dict:
        return dict(tensor_pairs(self.target))

    def _check_target(self, specs: Sequence[TensorSpec]) -> Optional[str]:
        if self.target is None:
            return None
        tmap = self._target_map()
        missing = [s.name for s in specs if s.name not in tmap]
        wrong = [f"{s.name} (sent {s.shape} {s.dtype}, target {tuple(tmap[s.name].shape)} "
                 f"{str(tmap[s.name].dtype).replace('torch.', '')})"
                 for s in specs if s.name in tmap and (tuple(tmap[s.name].shape) != s.shape or
                                                       str(tmap[s.name].dtype).replace("torch.", "") != s.dtype)]
        if missing or wrong:
            return ("the update does not fit the target: "
                    + (f"not in the target: {short_names(missing)}; " if missing else "")
                    + (f"shape/dtype differ: {short_names(wrong, 4)}" if wrong else ""))
        return None

    # ---------------------------------------------------------------- one update
    def receive(self, *, timeout_s: Optional[float] = None) -> TransferReport:
        """Receive, verify and apply the next update; return its report.

        Raises :class:`InvalidTransitionError` (guard closed: nothing moved) or
        :class:`TransferError` (refused, incomplete, corrupt, sender died or timed out); in every
        such case ``version`` is still the previous one and, with ``staged=True``, the target
        holds the previous weights untouched.
        """
        g = self.group
        seq = g._next_seq()
        t0 = time.perf_counter()
        ack_key, done_key = f"u{seq}/ack/{g.rank}", f"u{seq}/done/{g.rank}"
        try:
            self.check_guard()
        except InvalidTransitionError as e:
            g.put(ack_key, ("refused", "asleep", str(e)))
            raise
        hdr = g.take(f"u{seq}/hdr", timeout_s,
                     what=f"update {seq} from the sender (still serving version {self.version!r})")
        version = hdr["version"]
        if hdr["specs"] is not None:
            self._meta = {hdr["meta_id"]: hdr["specs"]}
        specs = self._meta.get(hdr["meta_id"])
        if specs is None:
            msg = f"metadata {hdr['meta_id']} was never received here; resend with the tensor specs"
            g.put(ack_key, ("refused", "metadata", msg))
            raise TransferError(f"update {seq} (version {version!r}) refused: {msg}")
        problem = self._check_target(specs)
        if problem:
            g.put(ack_key, ("refused", "target", problem))
            raise TransferError(f"update {seq} (version {version!r}) refused before any byte moved: {problem}")
        connected = False
        try:
            if hdr["path"] == "ipc":
                connected = self._connect(hdr["ipc"])
        except Exception as e:
            g.put(ack_key, ("refused", "ipc", f"cannot connect to the sender's IPC socket: {e}"))
            raise TransferError(f"update {seq}: cannot connect to the sender's IPC socket: {e}") from e
        g.put(ack_key, ("ok", {"connected": connected}))
        go = g.take(f"u{seq}/go", timeout_s, what=f"the sender to start update {seq}")
        if go[0] != "go":
            raise TransferError(f"update {seq} (version {version!r}) was called off by the sender: {go[1]}; "
                                f"still serving version {self.version!r}")
        plans = plan_buckets(specs, hdr["bucket_bytes"])
        t_ack = time.perf_counter()
        state = RecvState(self, seq, specs, plans, hdr.get("verify", True))
        try:
            if hdr["path"] == "ipc":
                self._recv_ipc(state)
            else:
                self._recv_collective(state)
            t_recv = time.perf_counter()
            state.finish(version)
            self.check_guard()  # nobody put the weights to sleep meanwhile
            state.commit()
        except Exception as e:
            if hdr["path"] == "ipc" and not isinstance(e, VerifyError):
                self._drop_ipc()  # the socket may be out of step: reconnect on the next update
            if state.applied:
                self.consistent = False
            if isinstance(e, VerifyError):
                err: Exception = TransferError(str(e))
            else:
                tail = (f"the target was partly updated ({state.applied} buckets applied) and is inconsistent"
                        if state.applied else f"still serving version {self.version!r}")
                if isinstance(e, UnisleepError):
                    err = type(e)(f"{e}; {tail}")
                else:
                    err = TransferError(f"update {seq} (version {version!r}) broke off (the sender died, "
                                        f"timed out or the connection failed): {type(e).__name__}: {e}; {tail}")
            try:
                g.put(done_key, ("error", str(err)))
            except Exception:
                pass
            raise err from e
        prev, self.version = self.version, version
        self.consistent = True
        t1 = time.perf_counter()
        g.put(done_key, ("ok", version))
        self.last_report = TransferReport(version, prev, hdr["path"], len(specs), hdr["bytes"], len(plans), t1 - t0,
                                          metadata_reused=hdr["specs"] is None, verified=state.verify,
                                          phases={"handshake": t_ack - t0, "stream": t_recv - t_ack, "commit": t1 - t_recv})
        return self.last_report

    # ---------------------------------------------------------------- collective path
    def _recv_collective(self, st: "RecvState") -> None:
        import torch
        import torch.distributed as dist

        pg = self.group.process_group()
        dev = self.group.device
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pending = None
        while True:
            d = torch.empty(4, dtype=torch.int64, device=dev)
            pg.broadcast([d], opts).wait()
            seq, k, nbytes, flag = d.tolist()
            if k == END:
                if pending is not None:
                    pending[2].wait()
                    st.take(pending[0], pending[1])
                st.aborted = bool(flag & ABORT)
                return
            if seq != st.seq:
                raise TransferError(f"out of step: got a bucket of update {seq} while receiving update {st.seq}")
            if self.staged:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            else:
                slot = k % 2
                cur = self._rot[slot]
                if cur is None or cur.numel() < nbytes:
                    cur = self._rot[slot] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                buf = cur[:nbytes]
            w = pg.broadcast([buf], opts)
            if pending is not None:  # verify bucket k-1 while bucket k is in flight
                pending[2].wait()
                st.take(pending[0], pending[1])
            pending = (k, buf, w)

    # ---------------------------------------------------------------- IPC path
    def _connect(self, name: str) -> bool:
        if self._sock is not None and self._sock_name == name:
            return False
        self._drop_ipc()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(self.group.timeout_s)
        s.connect(name)
        send_msg(s, {"rank": self.group.rank})
        self._sock, self._sock_name = s, name
        return True

    def _drop_ipc(self) -> None:
        for imp in self._imports.values():
            imp.close()
        self._imports.clear()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._sock_name = None

    def _recv_ipc(self, st: "RecvState") -> None:
        import torch

        ipc = self.group.ipc_module()
        dev = self.group.device
        sock = self._sock
        slot_of: dict[str, int] = {}
        while True:
            msg, fds = recv_msg(sock, f"bucket data of update {st.seq} (still serving version {self.version!r})")
            op = msg["op"]
            if op == "buf":
                old = [b for b, sl in slot_of.items() if sl == msg["slot"] and b != msg["id"]]
                for b in old:
                    slot_of.pop(b)
                    imp = self._imports.pop(b, None)
                    if imp is not None:
                        imp.close()
                self._imports[msg["id"]] = ipc.ImportedBuffer(fds[0], msg["nbytes"], self.group.device_index)
                slot_of[msg["id"]] = msg["slot"]
            elif op == "bucket":
                src = self._imports[msg["id"]].tensor[: msg["nbytes"]]
                if self.staged:  # copy out, hand the memory back, verify the copy
                    buf = torch.empty(msg["nbytes"], dtype=torch.uint8, device=dev)
                    buf.copy_(src)
                    ipc.synchronize(self.group.device_index)
                    send_msg(sock, {"op": "free", "slot": msg["slot"]})
                    st.take(msg["k"], buf)
                else:  # verify and apply straight from the shared memory, then hand it back
                    st.take(msg["k"], src)
                    ipc.synchronize(self.group.device_index)
                    send_msg(sock, {"op": "free", "slot": msg["slot"]})
            elif op == "end":
                st.aborted = bool(msg["abort"])
                return

    def close(self) -> None:
        self._drop_ipc()
        self._rot = [None, None]


__all__ = ["WeightReceiver"]
