"""``WeightSender`` (trainer, rank 0) and ``WeightReceiver`` (engine, ranks ≥ 1).

One update, in order (every step can fail cleanly; the receiver keeps its previous version):

1. sender: header on the store — version, update number, tensor specs (or only their id when
   they are unchanged: metadata is reused), bucket size, path;
2. receiver: guard check (target memory awake?) and target check (names, shapes, dtypes) —
   then an acknowledgement; a refusal stops the sender before a byte moves;
3. sender: ``go``; buckets stream, double buffered — bucket k+1 is packed while bucket k is in
   flight; each bucket carries the checksums of its tensors in a trailer;
4. receiver: each bucket is verified against the manifest (checksums, order, completeness) and
   staged; only when all of them are good is the update applied (``apply`` callback or in-place
   copy into ``target``) and the version committed;
5. receiver: a ``done`` acknowledgement (or the error), which ``send`` waits for.

Paths: ``collective`` (the group's process-group backend: gloo on host, the vendor collective on
accelerators) or ``ipc`` (colocated: bucket memory shared through a file descriptor passed over a
Unix socket; the vendor's ``ipc`` module makes the shareable memory).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError
from .group import TransferGroup
from .manifest import (
    BucketPlan,
    Manifest,
    TensorSpec,
    bucket_checksums,
    check_bucket,
    plan_buckets,
    write_trailer,
)

log = logging.getLogger("unisleep.transfer")

MiB = 2**20
PATHS = ("auto", "collective", "ipc")
_ABORT, _END = 1, -1


# ------------------------------------------------------------------------------ reports
@dataclass
class TransferReport:
    """What one update did (returned by ``send`` and ``receive``)."""

    version: Any
    previous_version: Any
    path: str
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    metadata_reused: bool = False
    verified: bool = True
    phases: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("version", "previous_version", "path", "tensors", "bytes", "buckets",
                                            "seconds", "metadata_reused", "verified", "phases")}
        d["gbps"] = self.gbps
        return d

    def __str__(self) -> str:
        return (f"version {self.previous_version!r} -> {self.version!r} over {self.path}: {self.tensors} tensors, "
                f"{self.bytes / 2**30:.3f} GiB in {self.buckets} buckets, {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s)")


def default_bucket_bytes(group: TransferGroup) -> int:
    """Two send buffers take at most 1/8 of the free memory of the group's device; clamped to
    [16 MiB, 1 GiB]."""
    free = None
    if group.platform.is_accelerator:
        try:
            import torch

            free = int(torch.accelerator.get_memory_info(group.device_index)[0])
        except Exception:
            devs = group.platform.devices
            if group.device_index < len(devs):
                free = devs[group.device_index].free_bytes
    else:
        try:
            with open("/proc/meminfo") as f:
                info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.strip()}
            free = info.get("MemAvailable")
        except OSError:
            pass
    if not free:
        return 256 * MiB
    return max(16 * MiB, min(1024 * MiB, free // 16 // MiB * MiB))


def _named(obj) -> list:
    """(name, tensor) pairs of a Module (parameters + buffers), a mapping or an iterable of pairs."""
    if hasattr(obj, "named_parameters") and hasattr(obj, "named_buffers"):
        return list(obj.named_parameters()) + list(obj.named_buffers())
    if isinstance(obj, Mapping):
        return list(obj.items())
    return list(obj)


def _short(names: Sequence[str], n: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ------------------------------------------------------------------------------ IPC socket
def _send_msg(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [pickle.dumps(obj)], list(fds))


def _recv_msg(sock: socket.socket, what: str) -> tuple[Any, list[int]]:
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


# ------------------------------------------------------------------------------ sender
class WeightSender:
    """Trainer side (rank 0 of ``group``).

    ``bucket_bytes``: tensor bytes per bucket (``None``: sized from free memory, see
    :func:`default_bucket_bytes`); a larger tensor gets a bucket of its own.  ``path``:
    ``"auto"`` (IPC when every receiver shares the sender's device, else the collective),
    ``"collective"`` or ``"ipc"``.  ``verify``: compute per-tensor checksums (on by default;
    the receiver refuses an update whose bytes do not match them).
    """

    def __init__(self, group: TransferGroup, *, bucket_bytes: Optional[int] = None, path: str = "auto",
                 verify: bool = True):
        if not group.is_sender:
            raise InvalidArgumentError(f"WeightSender needs rank 0 of the group; this is rank {group.rank}")
        if path not in PATHS:
            raise InvalidArgumentError(f"path must be one of {PATHS}, got {path!r}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise InvalidArgumentError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = int(bucket_bytes) if bucket_bytes else default_bucket_bytes(group)
        self.path = path
        self.verify = verify
        self._last_meta_id: Optional[str] = None
        self._faults: dict[str, set] = {"skip": set(), "corrupt": set()}  # test hooks: bucket indices
        self._coll_slots: list = [None, None]
        self._ipc: Optional[_IpcSenderState] = None
        self.last_report: Optional[TransferReport] = None
        self.version: Any = None

    def resolve_path(self) -> str:
        g = self.group
        if self.path == "ipc":
            g.ipc_module()  # raises with the reason when there is none
            if not g.colocated:
                raise InvalidArgumentError("path='ipc' needs every receiver on the sender's device (same machine on host)")
            return "ipc"
        if self.path == "collective":
            g.process_group()  # raises when the vendor collective cannot connect these ranks
            return "collective"
        return "ipc" if g.ipc_available else "collective"

    def send(self, named_tensors, version: Any, *, specs: Optional[Sequence] = None) -> TransferReport:
        """Send one update and return once every receiver has verified and committed it.

        ``named_tensors``: an ``nn.Module`` (parameters and buffers), a mapping name → tensor, or
        an iterable of ``(name, tensor)`` pairs.  With ``specs`` (a list of :class:`TensorSpec`
        or ``(name, shape, dtype)``) the iterable may be a lazy generator that produces the
        tensors in that order, so the whole model never has to exist at once.
        ``version``: any picklable tag (an int step is typical) recorded by the receiver.

        Raises :class:`InvalidTransitionError` when a receiver's memory is asleep (nothing was
        sent), :class:`TransferError` when a receiver refused or rejected the update.
        """
        g = self.group
        t0 = time.perf_counter()
        if specs is not None:
            manifest = Manifest(tuple(s if isinstance(s, TensorSpec) else
                                      TensorSpec(s[0], tuple(int(x) for x in s[1]), str(s[2]).replace("torch.", ""))
                                      for s in specs))
            items: Iterator = iter(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        else:
            pairs = _named(named_tensors)
            manifest = Manifest.of(pairs)
            items = iter(pairs)
        names = manifest.names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidArgumentError(f"duplicate tensor names in the update: {_short(dup)}")
        path = self.resolve_path()
        plans = plan_buckets(manifest.specs, self.bucket_bytes)
        seq = g._next_seq()
        if seq:
            for k in ("hdr", "go", "abort", *(f"ack/{r}" for r in g.receivers), *(f"done/{r}" for r in g.receivers)):
                g.drop(f"u{seq - 1}/{k}")
        reuse = manifest.meta_id == self._last_meta_id
        ipc_name = None
        if path == "ipc":
            if self._ipc is None:
                self._ipc = _IpcSenderState(g)
            ipc_name = self._ipc.name
        header = {
            "seq": seq, "version": version, "previous_version": self.version, "meta_id": manifest.meta_id,
            "specs": None if reuse else manifest.specs, "bucket_bytes": self.bucket_bytes, "path": path,
            "buckets": len(plans), "bytes": manifest.nbytes, "ipc": ipc_name, "verify": self.verify,
        }
        g.put(f"u{seq}/hdr", header)
        # ---- acknowledgements: nothing moves before every receiver said yes
        refusals, connect = [], []
        for r in g.receivers:
            ack = g.take(f"u{seq}/ack/{r}", what=f"receiver rank {r} to accept update {seq} (version {version!r}); is receive() running?")
            if ack[0] != "ok":
                refusals.append((r, ack))
            elif ack[1].get("connected"):
                connect.append(r)
        if refusals:
            g.put(f"u{seq}/go", ("abort", "a receiver refused"))
            r, (_, kind, msg) = refusals[0]
            if any(a[1] == "metadata" for _, a in refusals):
                self._last_meta_id = None
            cls = InvalidTransitionError if kind == "asleep" else TransferError
            raise cls(f"receiver rank {r} refused update {seq} (version {version!r}); nothing was sent: {msg}")
        t_ack = time.perf_counter()
        if path == "ipc":
            self._ipc.accept(connect)
        g.put(f"u{seq}/go", ("go",))
        # ---- stream the buckets
        chan = _IpcSendChannel(self, seq) if path == "ipc" else _CollectiveSendChannel(self, seq)
        aborted: Optional[BaseException] = None
        try:
            self._stream(items, manifest, plans, seq, chan)
        except Exception as e:  # the generator, a spec mismatch, the transport...
            aborted = e
            try:
                g.put(f"u{seq}/abort", f"{type(e).__name__}: {e}")
                chan.end(abort=True)
            except Exception:
                pass
            if path == "ipc":
                self._drop_ipc()
            if isinstance(e, UnisleepError):
                raise
            raise TransferError(f"update {seq} (version {version!r}) aborted on the sender: {type(e).__name__}: {e}") from e
        t_sent = time.perf_counter()
        # ---- every receiver verified and committed?
        errors = []
        for r in g.receivers:
            done = g.take(f"u{seq}/done/{r}", what=f"receiver rank {r} to verify and commit version {version!r}")
            if done[0] != "ok":
                errors.append(f"rank {r}: {done[1]}")
        if errors:
            raise TransferError(f"update {seq} (version {version!r}) was rejected; receivers keep their previous version: "
                                + "; ".join(errors))
        prev, self.version = self.version, version
        self._last_meta_id = manifest.meta_id
        t1 = time.perf_counter()
        self.last_report = TransferReport(version, prev, path, len(manifest.specs), manifest.nbytes, len(plans), t1 - t0,
                                          metadata_reused=reuse, verified=self.verify,
                                          phases={"handshake": t_ack - t0, "stream": t_sent - t_ack, "commit_wait": t1 - t_sent})
        return self.last_report

    def _stream(self, items: Iterator, manifest: Manifest, plans: list[BucketPlan], seq: int, chan) -> None:
        import torch

        specs = manifest.specs
        for plan in plans:
            buf = chan.buffer(plan.index % 2, plan.total_bytes)
            with torch.no_grad():
                for s in plan.slots:
                    spec = specs[s.index]
                    try:
                        name, t = next(items)
                    except StopIteration:
                        raise TransferError(f"the tensors ran out at {spec.name!r} (#{s.index}); the specs list {len(specs)}") from None
                    if name != spec.name or tuple(t.shape) != spec.shape or str(t.dtype).replace("torch.", "") != spec.dtype:
                        raise TransferError(f"tensor #{s.index} is {name!r} {tuple(t.shape)} {t.dtype}, "
                                            f"the specs say {spec.name!r} {spec.shape} {spec.dtype}")
                    if s.nbytes:
                        buf[s.offset: s.offset + s.nbytes].view(t.dtype).view(t.shape).copy_(t)
                sums = bucket_checksums(buf, plan) if self.verify else torch.zeros(len(plan.slots), dtype=torch.int64, device=buf.device)
                write_trailer(buf, plan, seq, sums)
            if plan.index in self._faults["corrupt"] and plan.slots:
                o = plan.slots[0].offset
                buf[o: o + 1].bitwise_not_()
            if plan.index in self._faults["skip"]:
                continue
            chan.post(plan.index % 2, plan, buf)
        chan.end(abort=False)

    def _drop_ipc(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None

    def close(self) -> None:
        self._drop_ipc()
        self._coll_slots = [None, None]


class _CollectiveSendChannel:
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
        self._bcast(self._desc(_END, 0, _ABORT if abort else 0)).wait()


class _IpcSenderState:
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
            hello, _ = _recv_msg(conn, "the receiver's hello")
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


class _IpcSendChannel:
    """Colocated: pack into shared memory, tell each receiver which bucket is where, wait until
    every receiver has copied it out before packing into that memory again."""

    def __init__(self, sender: WeightSender, seq: int):
        self.s = sender
        self.st: _IpcSenderState = sender._ipc
        self.seq = seq
        self.tmp = None

    def _wait_free(self, slot: int) -> None:
        st = self.st
        while st.busy[slot]:
            for r in list(st.busy[slot]):
                msg, _ = _recv_msg(st.conns[r], f"receiver rank {r} to release bucket memory")
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
                _send_msg(conn, {"op": "buf", "id": bid, "slot": slot, "nbytes": eb.nbytes}, [eb.fd()])
                have.add(r)
            _send_msg(conn, {"op": "bucket", "k": plan.index, "id": bid, "slot": slot, "nbytes": plan.total_bytes})
            st.busy[slot].add(r)

    def end(self, abort: bool) -> None:
        st = self.st
        if not abort:
            self._wait_free(0)
            self._wait_free(1)
        for conn in st.conns.values():
            _send_msg(conn, {"op": "end", "abort": abort})
        if abort:
            st.busy = [set(), set()]


# ------------------------------------------------------------------------------ receiver
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
        return dict(_named(self.target))

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
                    + (f"not in the target: {_short(missing)}; " if missing else "")
                    + (f"shape/dtype differ: {_short(wrong, 4)}" if wrong else ""))
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
        state = _RecvState(self, seq, specs, plans, hdr.get("verify", True))
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
            if hdr["path"] == "ipc" and not isinstance(e, _VerifyError):
                self._drop_ipc()  # the socket may be out of step: reconnect on the next update
            if state.applied:
                self.consistent = False
            if isinstance(e, _VerifyError):
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
    def _recv_collective(self, st: "_RecvState") -> None:
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
            if k == _END:
                if pending is not None:
                    pending[2].wait()
                    st.take(pending[0], pending[1])
                st.aborted = bool(flag & _ABORT)
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
        _send_msg(s, {"rank": self.group.rank})
        self._sock, self._sock_name = s, name
        return True

    def _drop_ipc(self) -> None:
        for imp in self._imports.values():
            imp.close()
        self._imports.clear()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._sock_name = None

    def _recv_ipc(self, st: "_RecvState") -> None:
        import torch

        ipc = self.group.ipc_module()
        dev = self.group.device
        sock = self._sock
        slot_of: dict[str, int] = {}
        while True:
            msg, fds = _recv_msg(sock, f"bucket data of update {st.seq} (still serving version {self.version!r})")
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
                    _send_msg(sock, {"op": "free", "slot": msg["slot"]})
                    st.take(msg["k"], buf)
                else:  # verify and apply straight from the shared memory, then hand it back
                    st.take(msg["k"], src)
                    ipc.synchronize(self.group.device_index)
                    _send_msg(sock, {"op": "free", "slot": msg["slot"]})
            elif op == "end":
                st.aborted = bool(msg["abort"])
                return

    def close(self) -> None:
        self._drop_ipc()
        self._rot = [None, None]


class _VerifyError(TransferError):
    pass


class _RecvState:
    """Buckets of one update as they arrive: verified, then staged (or applied at once)."""

    def __init__(self, rx: WeightReceiver, seq: int, specs: Sequence[TensorSpec], plans: list[BucketPlan], verify: bool):
        self.rx, self.seq, self.specs, self.plans, self.verify = rx, seq, specs, plans, verify
        self.got: dict[int, Any] = {}
        self.rejected: set[int] = set()
        self.corrupt: list[str] = []
        self.problems: list[str] = []
        self.aborted = False
        self.applied = 0
        self._tmap: Optional[dict] = None

    def take(self, k: int, buf) -> None:
        if not 0 <= k < len(self.plans):
            self.problems.append(f"bucket {k} is not in the manifest ({len(self.plans)} buckets)")
            return
        plan = self.plans[k]
        if k in self.got or k in self.rejected:
            self.problems.append(f"bucket {k} arrived twice")
            return
        if buf.numel() != plan.total_bytes:
            self.problems.append(f"bucket {k} has {buf.numel()} bytes, the manifest says {plan.total_bytes}")
            self.corrupt += [self.specs[s.index].name for s in plan.slots]
            self.rejected.add(k)
            return
        if self.verify:
            problem, bad = check_bucket(buf, plan, self.seq)
            if problem:
                self.problems.append(problem)
            if bad:
                self.corrupt += [self.specs[plan.slots[i].index].name for i in bad]
                self.rejected.add(k)
                return
        self.got[k] = buf
        if not self.rx.staged and not self.corrupt and not self.problems:
            self._apply(plan, buf)

    def finish(self, version) -> None:
        if self.aborted:
            try:
                why = self.rx.group.take(f"u{self.seq}/abort", 5.0, what="the sender's reason")
            except TransferError:
                why = "no reason given"
            raise TransferError(f"the sender aborted update {self.seq} (version {version!r}): {why}")
        missing_b = [p for p in self.plans if p.index not in self.got and p.index not in self.rejected]
        missing = [self.specs[s.index].name for p in missing_b for s in p.slots]
        if missing or self.corrupt or self.problems:
            parts = []
            if missing:
                parts.append(f"incomplete: {len(missing)} tensor(s) never arrived (buckets "
                             f"{_short([str(p.index) for p in missing_b])}): {_short(missing)}")
            if self.corrupt:
                parts.append(f"corrupt: {len(self.corrupt)} tensor(s) fail the manifest checksum: {_short(self.corrupt)}")
            if self.problems:
                parts.append("; ".join(self.problems[:4]))
            tail = (f"the target was partly updated ({self.applied} buckets applied) and is now inconsistent"
                    if self.applied else f"still serving version {self.rx.version!r}")
            raise _VerifyError(f"update {self.seq} (version {version!r}) refused: " + "; ".join(parts) + f"; {tail}")

    def _views(self, plan: BucketPlan, buf) -> list:
        out = []
        for s in plan.slots:
            spec = self.specs[s.index]
            v = buf[s.offset: s.offset + s.nbytes].view(spec.torch_dtype()).view(spec.shape)
            out.append((spec.name, v))
        return out

    def _apply(self, plan: BucketPlan, buf) -> None:
        import torch

        pairs = self._views(plan, buf)
        if self.rx.apply is not None:
            self.rx.apply(pairs)
        else:
            if self._tmap is None:
                self._tmap = self.rx._target_map()
            tmap = self._tmap
            with torch.no_grad():
                for name, v in pairs:
                    tmap[name].copy_(v)
        self.applied += 1

    def commit(self) -> None:
        if not self.rx.staged:
            return
        for plan in self.plans:
            self._apply(plan, self.got[plan.index])
        self.got.clear()


__all__ = ["WeightSender", "WeightReceiver", "TransferReport", "default_bucket_bytes", "PATHS"]
