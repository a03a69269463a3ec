"""``WeightSender``: the trainer's side of an update (rank 0 of the group) — header,
acknowledgements, buckets streamed double buffered, then every receiver's commit — and
:func:`default_bucket_bytes`, the bucket size the free memory allows."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Sequence

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError, VersionError
from .channels import ipc_text, named_error
from .cipher import BucketCipher
from .group import TransferGroup
from .ipc_send import IpcSenderState, IpcSendChannel
from . import records as R
from .manifest import BucketPlan, Manifest, UpdateSeal, check_tensor, plan_buckets, spec_of, write_trailer
from .names import short_names, tensor_pairs
from .records import check_version
from .report import TransferReport
from .send_channels import CollectiveSendChannel, SocketSendChannel

log = logging.getLogger("unisleep.transfer")

MiB = 2**20
PATHS = ("auto", "collective", "ipc")
#: the largest bucket a sender takes (more than any machine's memory)
MAX_BUCKET_BYTES = 1 << 40


#: the largest default bucket: colocated IPC on a device (both processes share the device's
#: time, so fewer, larger buckets lose less to the hand-overs between them: 8 GiB verified in
#: 14.7-15.6 ms with 4 GiB buckets, 16.5-17.5 ms with 2 GiB and 15.1-16.3 ms with one 8 GiB
#: bucket in one run on an H200, docs/transfer.md; it needs 64 GiB free for two such buffers);
#: every other path
MAX_DEFAULT_BUCKET = {"ipc": 4096 * MiB, "collective": 1024 * MiB}


def default_bucket_bytes(group: TransferGroup, path: str = "collective") -> int:
    """Two send buffers take at most 1/8 of the free memory of the group's device; clamped to
    [16 MiB, 1 GiB], or [16 MiB, 4 GiB] for colocated IPC on a device (``path="ipc"``)."""
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
    cap = MAX_DEFAULT_BUCKET["ipc" if path == "ipc" and group.platform.is_accelerator else "collective"]
    return max(16 * MiB, min(cap, free // 16 // MiB * MiB))


class WeightSender:
    """Trainer side (rank 0 of ``group``).

    ``bucket_bytes``: tensor bytes per bucket (``None``: sized from free memory for the path,
    at its first update, see :func:`default_bucket_bytes`); a larger tensor gets a bucket of its own.  ``path``:
    ``"auto"`` (IPC when every receiver shares the sender's device, else the collective),
    ``"collective"`` or ``"ipc"``.  ``verify``: compute a keyed digest of every tensor (on by
    default; the receiver refuses an update whose bytes do not match).  ``allow_equal_versions``:
    accept a version equal to the previous one (e.g. several chunks of one version).

    How the collective path moves host memory (docs/security.md): ``via=None`` — over a Unix socket
    when every member runs on this machine (handed over the receivers' authenticated IPC
    connections: nothing another user can connect to), else over the group's backend;
    ``via="socket"`` or ``via=<backend>`` (e.g. ``"gloo"``) to choose.  Over gloo every pair of
    the data channel first proves the group secret, and ``encrypt`` (``None``: on) sends every
    bucket AES-256-GCM-encrypted under a key of its update, authenticated by its tag instead of the
    keyed digests; ``encrypt=False`` sends them in the clear (a warning when the members are on
    several machines).  Device memory (an accelerator's collective) is never encrypted.

    Bucket memory (docs/transfer.md): ``keep_buffers=False`` — the send buffers (an IPC path's
    shareable memory, the collective path's two send buffers) are given back when the update ends,
    and every receiver gives back what it mapped or allocated for the update (the header tells it),
    so when ``send()`` returns neither side holds bucket memory: the device belongs to whoever works
    next (a colocated trainer sleeping, the engine generating).  Each update then makes its buffers
    anew (the report's ``buffers`` and ``release`` phases say what that costs).  ``keep_buffers=True``
    keeps them between updates (faster when nothing else needs that memory).  ``None`` (default):
    given back on an accelerator (device memory is what the other side needs; making it costs
    milliseconds), kept on the host platform (there the kernel zeroes every fresh page: about a
    second per GiB on a loaded 2-core machine, docs/benchmarks.md).  A send buffer on an accelerator's collective path comes from the framework's
    own allocator, which keeps it cached until the framework empties its cache.
    """

    def __init__(self, group: TransferGroup, *, bucket_bytes: Optional[int] = None, path: str = "auto",
                 verify: bool = True, allow_equal_versions: bool = False, via: Optional[str] = None,
                 encrypt: Optional[bool] = None, keep_buffers: Optional[bool] = None):
        if not group.is_sender:
            raise InvalidArgumentError(f"WeightSender needs rank 0 of the group; this is rank {group.rank}")
        if not isinstance(path, str) or path not in PATHS:
            raise InvalidArgumentError(f"path must be one of {PATHS}, got {path!r}")
        if bucket_bytes is not None and not (R._is_int(bucket_bytes) and 0 < bucket_bytes <= MAX_BUCKET_BYTES):
            raise InvalidArgumentError(f"bucket_bytes must be a whole number of bytes in [1, 2**40] (or None: sized "
                                       f"from free memory), got {bucket_bytes!r}")
        for what, v in (("verify", verify), ("allow_equal_versions", allow_equal_versions)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{what} must be True or False, got {v!r}")
        if keep_buffers is not None and not isinstance(keep_buffers, bool):
            raise InvalidArgumentError(f"keep_buffers must be True, False or None (given back on an accelerator, "
                                       f"kept on the host), got {keep_buffers!r}")
        if via not in (None, "socket", group.backend):
            raise InvalidArgumentError(f"via must be None (the default for the path), 'socket' or {group.backend!r}, "
                                       f"got {via!r}")
        if encrypt not in (None, True, False):
            raise InvalidArgumentError(f"encrypt must be None (encrypt what crosses {group.backend}), True or False, "
                                       f"got {encrypt!r}")
        self.via = via
        self.encrypt = encrypt
        self._warned_plain = False
        self.group = group
        self.bucket_bytes = int(bucket_bytes) if bucket_bytes else default_bucket_bytes(group)
        self._path_buckets: Optional[dict] = None if bucket_bytes else {}  # path -> its default size
        self.path = path
        self.verify = verify
        self.allow_equal_versions = allow_equal_versions
        self.keep_buffers = keep_buffers
        self._buffer_s = 0.0  # seconds this update spent making (and exporting) bucket memory
        self._last_meta_id: Optional[str] = None
        self._faults: dict[str, set] = {"skip": set(), "corrupt": set()}  # test hooks: bucket indices
        self._coll_slots: list = [None, None]
        self._ipc: Optional[IpcSenderState] = None
        self._seal_ahead: Optional[tuple] = None  # (seq, epoch, seal) made while the last update committed
        self._no_records = -1  # the last update whose answers all travelled on the IPC connections (no store records)
        self.last_report: Optional[TransferReport] = None
        self.version: Any = None

    def resolve(self) -> tuple[str, str, str]:
        """``(path, via, cipher)`` of the next update: how its bytes move (``"ipc"``: shared memory;
        ``"socket"``: a Unix socket, host memory on one machine; ``"backend"``: the group's
        collective) and whether they are encrypted (``"aes-256-gcm"`` or ``"none"``)."""
        g = self.group
        path = self.resolve_path()
        if path == "ipc":
            if self.encrypt:
                raise InvalidArgumentError("encrypt=True: the colocated IPC path shares memory between two processes "
                                           "of one machine; nothing crosses a wire to encrypt")
            return path, "ipc", "none"
        socket_ok = not g.platform.is_accelerator and g.local and g.platform.backend.ipc is not None
        via = "socket" if self.via == "socket" or (self.via is None and socket_ok) else "backend"
        if via == "socket":
            if not socket_ok:
                raise InvalidArgumentError("via='socket' needs host memory and every member on this machine, in its "
                                           f"network namespace; use via={g.backend!r} between machines")
            if self.encrypt:
                raise InvalidArgumentError("encrypt=True: with via='socket' the bytes never leave this machine (a Unix "
                                           f"socket only the receivers hold); encryption is for via={g.backend!r}")
            return path, via, "none"
        g.process_group(connect=False)
        can = getattr(g._collective, "CIPHER", False)
        if self.encrypt and not can:
            raise InvalidArgumentError(f"encrypt=True: buckets on the {g.platform.name} platform's {g.backend} are "
                                       "device memory, which unisleep does not encrypt; see docs/security.md (residual "
                                       "risks) for what protects them")
        cipher = "aes-256-gcm" if can and self.encrypt is not False else "none"
        if can and cipher == "none" and not g.local and not self._warned_plain:
            log.warning("encrypt=False: the weights cross the network between the group's machines in the clear "
                        "(authenticated by keyed digests, readable by anyone on the path)")
            self._warned_plain = True
        return path, via, cipher

    def resolve_path(self) -> str:
        g = self.group
        if self.path == "ipc":
            g.ipc_module()  # raises with the reason when there is none
            if not g.colocated:
                raise InvalidArgumentError("path='ipc' needs every receiver on the sender's device (same machine on host)")
            return "ipc"
        if self.path == "collective":
            if g.platform.is_accelerator or not g.local:
                g.process_group(connect=False)  # raises when the vendor collective cannot connect these ranks
            return "collective"
        return "ipc" if g.ipc_available else "collective"

    def send(self, named_tensors, version: Any, *, specs: Optional[Sequence] = None) -> TransferReport:
        """Send one update and return once every receiver has verified and committed it.

        ``named_tensors``: an ``nn.Module`` (parameters and buffers), a mapping name → tensor, or
        an iterable of ``(name, tensor)`` pairs.  With ``specs`` (a list of :class:`TensorSpec`
        or ``(name, shape, dtype)``) the iterable may be a lazy generator that produces the
        tensors in that order, so the whole model never has to exist at once.
        ``version``: an integer or a string of at most 256 characters (never None); it must come
        after the previous version sent (unless ``allow_equal_versions``: then equal is fine), and
        every receiver refuses one that does not come after the version it serves.

        A bad argument (a tensor that is not a ``torch.Tensor``, a spec with an unknown dtype or a
        negative dimension, a version that does not increase) raises :class:`InvalidArgumentError`
        (:class:`VersionError` for versions) before anything is sent; found only while streaming a
        lazy generator, it aborts the update and every receiver hears why.

        Raises :class:`InvalidTransitionError` when a receiver's memory is asleep (nothing was
        sent), :class:`VersionError` when a receiver serves a version this one does not come after,
        :class:`TransferError` when a receiver refused or rejected the update, or is dead (then the
        message says to recreate the group).
        """
        g = self.group
        g.check_usable()
        t0 = time.perf_counter()
        why = check_version(version, self.version, self.allow_equal_versions, "this sender")
        if why:
            raise VersionError(why)
        keep = self.keep_buffers
        if keep is None:
            keep = not g.platform.is_accelerator
        if not isinstance(keep, bool):
            raise InvalidArgumentError(f"keep_buffers must be True, False or None, got {keep!r}")
        if specs is not None:
            if isinstance(specs, (str, bytes, Mapping)) or not hasattr(specs, "__iter__"):
                raise InvalidArgumentError(f"specs must be a list of TensorSpec or (name, shape, dtype), got "
                                           f"{type(specs).__name__}")
            manifest = Manifest(tuple(spec_of(s, i) for i, s in enumerate(specs)))
            try:
                items: Iterator = iter(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
            except TypeError:
                raise InvalidArgumentError(f"the tensors must be a module, a mapping or (name, tensor) pairs, got "
                                           f"{type(named_tensors).__name__}") from None
        else:
            try:
                pairs = tensor_pairs(named_tensors)
            except TypeError:
                raise InvalidArgumentError(f"the tensors must be a module, a mapping or (name, tensor) pairs, got "
                                           f"{type(named_tensors).__name__}") from None
            for i, p in enumerate(pairs):
                if not isinstance(p, tuple) or len(p) != 2:
                    raise InvalidArgumentError(f"item #{i} of the tensors is not a (name, tensor) pair: {str(p)[:80]}")
                check_tensor(p[0], p[1], i)
            manifest = Manifest.of(pairs)
            items = iter(pairs)
        names = manifest.names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidArgumentError(f"duplicate tensor names in the update: {short_names(dup)}")
        path, via, cipher = self.resolve()
        if self._path_buckets is not None:  # sized once per path, so the plan stays the same
            if path not in self._path_buckets:
                self._path_buckets[path] = default_bucket_bytes(g, path)
            self.bucket_bytes = self._path_buckets[path]
        plans = plan_buckets(manifest.specs, self.bucket_bytes)
        seq, g._seq = g._seq, g._seq + 1
        epoch = g.epoch
        reuse = manifest.meta_id == self._last_meta_id
        ipc_name = None
        sock = path == "ipc" or via == "socket"  # through the IPC socket's authenticated connections
        if sock:
            if self._ipc is None:
                self._ipc = IpcSenderState(g)
                # its accept thread keeps the channel alive: a sender dropped without close()
                # still gives back its socket and the buffers it kept
                self._ipc_finalizer = weakref.finalize(self, self._ipc.close)
            ipc_name = self._ipc.name
        digests = self.verify and cipher == "none"  # an encrypted bucket is authenticated by its tag
        self._buffer_s = 0.0
        # receivers still connected from the last update answer on that connection (acknowledgement,
        # go, done: sealed like the store's records), not through the store — rank 0's store is a
        # thread of this process, and every request to it waits for this thread's interpreter lock
        control = "ipc" if sock and self._ipc.conns and set(self._ipc.conns) >= set(g.receivers) else "store"
        header = {
            "version": version, "previous_version": self.version, "meta_id": manifest.meta_id,
            "specs": None if reuse else [[s.name, list(s.shape), s.dtype] for s in manifest.specs],
            "bucket_bytes": self.bucket_bytes, "path": path, "via": via, "cipher": cipher, "buckets": len(plans),
            "bytes": manifest.nbytes, "ipc": ipc_name, "verify": digests, "keep_buffers": keep,
            "control": control,
        }
        try:  # on success the update gives its bucket memory back itself (timed: the "release" phase)
            return self._send_update(g, t0, version, manifest, items, plans, seq, epoch, path, via, cipher, reuse,
                                     sock, digests, header)
        except BaseException:
            if not keep:  # the update failed: its bucket memory goes back all the same
                try:
                    self._release_buffers()
                except Exception as e:  # noqa: BLE001 - the update's own error is the one raised
                    log.warning("giving back the bucket memory of a failed update also failed: %s", e)
            raise

    def _send_update(self, g, t0, version, manifest, items, plans, seq, epoch, path, via, cipher, reuse, sock,
                     digests, header) -> TransferReport:
        """The update once its header is made: post it, stream the buckets, wait for every commit."""
        control = header["control"]
        intrusions0 = len(g.intrusions)
        g.put("hdr", header, seq, epoch)
        # the update's keys: made while the last update committed, else now, while the receivers
        # read the header (not after "go")
        ahead, self._seal_ahead = self._seal_ahead, None
        seal = None
        if digests:
            seal = ahead[2] if ahead is not None and ahead[:2] == (seq, epoch) else UpdateSeal.prepared(g, seq, epoch, plans)
        crypt = BucketCipher.of(g, seq, epoch) if cipher != "none" else None
        # ---- colocated: the first bucket is packed (and hashed) while the receivers read the
        # header and answer; its bytes stay in this process's own buffer until "go"
        chan = first = packing = None
        if path == "ipc" and plans and not self._ipc.busy[0]:
            chan = IpcSendChannel(self, seq)
            try:
                first = self._pack(plans[0], chan, items, manifest.specs, seq, seal)
            except Exception as e:  # the generator, a spec mismatch: said once the receivers answered
                packing = e
            except BaseException as e:
                self._call_off(seq, epoch, f"{type(e).__name__}: {e}", control)
                raise
        # the last update's records are dropped while the receivers answer (after the first
        # bucket's packing is queued: nothing waits on them) — unless every answer of it travelled
        # on the IPC connections (it left no record in the store)
        if seq and self._no_records != seq - 1:
            for k in ("go", "abort", *(f"ack/{r}" for r in g.receivers), *(f"done/{r}" for r in g.receivers)):
                g.drop(f"u{seq - 1}/{k}")
        # ---- acknowledgements: nothing moves before every receiver said yes
        refusals, connect = [], []
        by_ipc: list[int] = []  # receivers that acknowledged on their IPC connection (go and done go there too)
        try:
            g.check_alive(g.receivers)  # a dead receiver: say so now, not after a timeout
            if via == "backend":
                g.process_group()  # a new epoch connects here; the receivers follow when they read the header
            for r in g.receivers:
                what = f"receiver rank {r} to accept update {seq} (version {version!r}); is receive() running?"
                ack = self._ipc_record(r, "ack", seq, what, f"u{seq}/ack/{r}") if control == "ipc" else None
                if ack is not None:
                    by_ipc.append(r)
                else:
                    ack = g.take(f"u{seq}/ack/{r}", R.ACK, seq=seq, epoch=epoch, peer=f"receiver rank {r}", watch=[r],
                                 what=what)
                if not ack["ok"]:
                    refusals.append((r, ack))
                elif ack["connected"]:
                    connect.append(r)
        except BaseException as e:
            self._call_off(seq, epoch, f"{type(e).__name__}: {e}", control)
            raise
        if refusals:
            self._call_off(seq, epoch, "a receiver refused", control)
            r, ack = refusals[0]
            if any(a["kind"] == "metadata" for _, a in refusals):
                self._last_meta_id = None
            cls = {"asleep": InvalidTransitionError, "version": VersionError}.get(ack["kind"], TransferError)
            raise cls(f"receiver rank {r} refused update {seq} (version {version!r}); nothing was sent: {ack['msg']}")
        if packing is not None:  # every receiver that read the header hears why, as "called off"
            self._call_off(seq, epoch, f"{type(packing).__name__}: {packing}", control)
            if isinstance(packing, UnisleepError):
                raise packing
            raise TransferError(f"update {seq} (version {version!r}) aborted on the sender: "
                                f"{type(packing).__name__}: {packing}") from packing
        t_ack = time.perf_counter()
        if len(by_ipc) < len(g.receivers):
            g.put(f"u{seq}/go", {"go": True, "why": ""}, seq, epoch)
        # ---- stream the buckets
        live = None  # the channel, once every receiver is connected to it
        try:
            for r in by_ipc:
                self._ipc.conns[r].send("go", u=seq)
            if sock:
                self._ipc.accept(connect)
                missing = sorted(set(g.receivers) - set(self._ipc.conns))
                if missing:  # a receiver that kept a connection this side has closed: it connects next time
                    raise TransferError(f"receivers {missing} answered without connecting to the IPC socket, whose "
                                        "connection to them this side had closed")
            live = chan or (IpcSendChannel(self, seq) if path == "ipc" else SocketSendChannel(self, seq)
                            if via == "socket" else CollectiveSendChannel(self, seq, crypt))
            self._stream(items, manifest, plans, seq, live, seal, first)
        except Exception as e:  # the generator, a spec mismatch, the transport...
            ended = False
            try:
                g.put(f"u{seq}/abort", {"why": f"{type(e).__name__}: {e}"[:4000]}, seq, epoch)
                if live is not None:
                    live.end(abort=True)
                    ended = True
            except Exception:
                pass
            if sock and not ended:
                self._drop_ipc()  # the socket is out of step; an ended one stays (the receivers read 'end')
            else:
                g.channel_broke(f"update {seq} broke off")
            dead = self._dead_receivers()
            if isinstance(e, UnisleepError) and not dead:
                raise
            if dead:
                g.broken = dead[0]
                raise TransferError(f"update {seq} (version {version!r}) broke off: {'; '.join(dead)}; recreate the "
                                    f"group ({type(e).__name__}: {str(e)[:300]})") from e
            raise TransferError(f"update {seq} (version {version!r}) aborted on the sender: {type(e).__name__}: {e}") from e
        finally:
            if seal is not None:
                seal.release()
        t_sent = time.perf_counter()
        # ---- every receiver verified and committed?  Meanwhile the next update's keys are made
        # (derived from the group secret, the epoch and the update number: nothing new is learnt)
        if digests:
            self._seal_ahead = (seq + 1, epoch, UpdateSeal.prepared(g, seq + 1, epoch, plans))
        errors, done_by_ipc = [], 0
        try:
            for r in g.receivers:
                what = f"receiver rank {r} to verify and commit version {version!r}"
                done = self._ipc_record(r, "done", seq, what, f"u{seq}/done/{r}") if r in by_ipc else None
                if done is not None:
                    done_by_ipc += 1
                else:
                    done = g.take(f"u{seq}/done/{r}", R.DONE, seq=seq, epoch=epoch, peer=f"receiver rank {r}",
                                  watch=[r], what=what)
                if not done["ok"]:
                    errors.append(f"rank {r}: {done['msg']}")
        except BaseException:
            if via == "backend":
                g.channel_broke(f"update {seq}: no answer")
            raise
        if errors:
            raise named_error(f"update {seq} (version {version!r}) was rejected; receivers keep their previous version: "
                              + "; ".join(errors))
        prev, self.version = self.version, version
        self._last_meta_id = manifest.meta_id
        if len(by_ipc) == done_by_ipc == len(g.receivers):
            self._no_records = seq
        t_done = time.perf_counter()
        release_s = 0.0
        if not header["keep_buffers"]:  # every receiver has given its mappings back: the memory goes now
            self._release_buffers()
            release_s = time.perf_counter() - t_done
        t1 = time.perf_counter()
        self.last_report = TransferReport(version, prev, path, len(manifest.specs), manifest.nbytes, len(plans), t1 - t0,
                                          metadata_reused=reuse, verified=digests or cipher != "none",
                                          phases={"handshake": t_ack - t0, "stream": t_sent - t_ack,
                                                  "commit_wait": t_done - t_sent, "buffers": self._buffer_s,
                                                  "release": release_s},
                                          intrusions=list(g.intrusions[intrusions0:]))
        return self.last_report

    def _dead_receivers(self) -> list[str]:
        """Why receivers are dead, for a transport failure (a process that exited is seen at
        once; a silent heartbeat after a few seconds)."""
        out: list[str] = []
        for r in self.group.receivers:
            try:
                why = self.group.peer_dead(r)
            except Exception:  # noqa: BLE001
                why = None
            if why:
                out.append(why)
        return out

    def _ipc_record(self, r: int, op: str, seq: int, what: str, key: str) -> Optional[dict]:
        """Receiver ``r``'s ``ack`` or ``done`` of update ``seq`` from its IPC connection, as the
        store's record would say it (an ``error`` there is a ``done`` that failed); None when the
        receiver wrote it to the store (at ``key``) instead."""
        msg = self._ipc.control(r, op, seq, what, key) if self._ipc is not None else None
        if msg is None:
            return None
        ok = msg["op"] == op and msg["ok"]
        return {"ok": ok, "kind": msg["kind"] if msg["op"] == op else "error", "msg": msg["msg"], "connected": False}

    def _call_off(self, seq: int, epoch: int, why: str, control: str) -> None:
        """Before any byte moved: withdraw the header (a late receiver waits for the next one)
        and tell those waiting for ``go`` — in the store, and (``control == "ipc"``) on every IPC
        connection (a receiver that is not waiting there skips it as a word of an earlier update)."""
        g = self.group
        g.drop("hdr")
        if control == "ipc" and self._ipc is not None:
            for r in list(self._ipc.conns):
                conn = self._ipc.conns[r]
                try:
                    conn.send("go", u=seq, ok=False, msg=ipc_text(why))
                except TransferError:
                    self._ipc._forget(r, conn)  # gone: that receiver connects again
        try:
            g.put(f"u{seq}/go", {"go": False, "why": why[:4000]}, seq, epoch)
        except TransferError:
            pass

    def _pack(self, plan: BucketPlan, chan, items: Iterator, specs, seq: int, seal, corrupt: bool = False,
              skip: bool = False):
        """Pack (and, on a device, hash in the same pass; on an encrypting channel, encrypt in
        the same pass and send each piece as soon as it is sealed) the next tensors from
        ``items`` into the channel's buffer for ``plan``; returns the buffer."""
        import torch

        buf = chan.buffer(plan.index % 2, plan.total_bytes)
        # a device bucket is hashed while it is packed (one pass over each tensor)
        hasher = seal.hasher(buf, plan) if seal is not None and plan.slots and buf.device.type != "cpu" else None
        sealer = chan.begin(plan, buf, corrupt) if hasattr(chan, "begin") and not skip else None
        with torch.no_grad():
            for i, s in enumerate(plan.slots):
                spec = specs[s.index]
                try:
                    item = next(items)
                except StopIteration:
                    raise TransferError(f"the tensors ran out at {spec.name!r} (#{s.index}); the specs list {len(specs)}") from None
                if not isinstance(item, tuple) or len(item) != 2:
                    raise InvalidArgumentError(f"item #{s.index} of the tensors is not a (name, tensor) pair: "
                                               f"{str(item)[:80]}")
                name, t = item
                check_tensor(name, t, s.index)
                if name != spec.name or tuple(t.shape) != spec.shape or str(t.dtype).replace("torch.", "") != spec.dtype:
                    raise TransferError(f"tensor #{s.index} is {name!r} {tuple(t.shape)} {t.dtype}, "
                                        f"the specs say {spec.name!r} {spec.shape} {spec.dtype}")
                if sealer is not None:
                    sealer.put(s, t)
                elif s.nbytes and not (hasher is not None and hasher.fill(i, t)):
                    buf[s.offset: s.offset + s.nbytes].view(t.dtype).view(t.shape).copy_(t)
            write_trailer(buf, plan, seq, seal, lanes=hasher.lanes() if hasher is not None else None)
            if sealer is not None:
                sealer.close()
        return buf

    def _stream(self, items: Iterator, manifest: Manifest, plans: list[BucketPlan], seq: int, chan, seal,
                first=None) -> None:
        """Pack and post every bucket; ``first``: the first bucket's buffer, packed already."""
        for plan in plans:
            if first is not None and plan.index == 0:
                buf = first
            else:
                buf = self._pack(plan, chan, items, manifest.specs, seq, seal,
                                 corrupt=plan.index in self._faults["corrupt"], skip=plan.index in self._faults["skip"])
            if plan.index in self._faults["skip"]:
                continue
            chan.post(plan.index % 2, plan, buf, corrupt=plan.index in self._faults["corrupt"])
        chan.end(abort=False)

    def _drop_ipc(self) -> None:
        if self._ipc is not None:
            self._ipc_finalizer.detach()
            self._ipc.close()
            self._ipc = None

    def _release_buffers(self) -> None:
        """Give back the send buffers (the IPC path's shareable memory, the collective path's
        buffers), the device copies of the next update's hash key and the hash's block tables
        on the group's device; the connections stay.  Safe to call at any time between updates."""
        from ..keyed_hash import drop_layouts

        self._coll_slots = [None, None]
        if self._ipc is not None:
            self._ipc.release_buffers()
        if self._seal_ahead is not None:
            self._seal_ahead[2].release()  # its levels go to the device again when hashed
        if self.group.device.type != "cpu":
            drop_layouts(self.group.device)

    def buffer_bytes(self) -> int:
        """Bytes of bucket memory this sender holds now (its send buffers, and on a device the
        hash's block tables kept in this process): 0 between updates unless ``keep_buffers``."""
        from ..keyed_hash import layout_bytes

        n = sum(t.numel() for t in self._coll_slots if t is not None)
        if self._ipc is not None:
            n += self._ipc.buffer_bytes()
        if self.group.device.type != "cpu":
            n += layout_bytes(self.group.device)
        return n

    def close(self) -> None:
        self._drop_ipc()
        self._coll_slots = [None, None]


__all__ = ["WeightSender", "default_bucket_bytes", "PATHS", "MAX_DEFAULT_BUCKET"]
