"""``WeightSender``: the trainer's side of an update (rank 0 of the group), and
:func:`default_bucket_bytes`, the bucket size the free memory allows.

One update (:meth:`WeightSender.send`), in order: the arguments checked and the manifest made
(nothing sent yet); the path resolved; the header posted in the store and sent on every IPC connection the sender
holds (a receiver connected there waits for it on that connection); every receiver's
acknowledgement (on the path's control plane: its IPC connection on the IPC and Unix-socket paths,
where a receiver without one connects first, else the store) — a refusal calls the update off before any byte
moved; ``go``; the buckets packed (hashed or encrypted in the same pass) and streamed
double buffered through the path's channel (:mod:`.collective`, :mod:`.socket_path`,
:mod:`.ipc`); then every receiver's commit, and the report.

Test seam: :meth:`WeightSender._sends_bucket` and :meth:`WeightSender._bucket_packed` are called
once per bucket and do nothing here; a test's subclass (tests/transfer/faults.py) overrides them
to drop a bucket or alter one on its way.  No production channel takes a fault argument."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from .. import hostmem
from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError, VersionError
from . import records as R
from .cipher import SLACK, BucketCipher
from .collective import CollectiveSendChannel
from .group import TransferGroup
from .ipc import IpcSenderState, IpcSendChannel, ipc_text
from .manifest import (BucketPlan, Manifest, UpdateSeal, check_tensor, dtype_name, pack_tensor, plan_buckets,
                       short_names, spec_of, tensor_pairs, write_trailer)
from .records import check_version, named_error
from .report import TransferReport
from .socket_path import SocketSendChannel

log = logging.getLogger("unisleep.transfer")

MiB = 2**20
PATHS = ("auto", "collective", "ipc")
#: the largest bucket a sender takes (more than any machine's memory)
MAX_BUCKET_BYTES = 1 << 40


#: the largest default bucket, on every path.  Colocated IPC on a device once took up to 4 GiB
#: (fewer hand-overs when its buffers are kept); with bucket memory made per update and given
#: back (the default on an accelerator), 1 GiB buckets verify 8 GiB sooner than 2 or 4 GiB ones:
#: the first bucket's packing and the last one's check overlap nothing (docs/benchmarks.md)
MAX_DEFAULT_BUCKET = 1024 * MiB


def default_bucket_bytes(group: TransferGroup, path: str = "collective") -> int:
    """Two send buffers take at most 1/8 of the free memory of the group's device (or of the
    host's available memory); clamped to [16 MiB, 1 GiB].  ``path`` ("collective" or "ipc") is
    accepted for every path: the rule is the same."""
    free = None
    if group.platform.is_accelerator:
        try:
            import torch

            free = int(torch.accelerator.get_memory_info(group.device_index)[0])
        except Exception:  # torch's query differs by version and vendor build: the platform's own count then
            devs = group.platform.devices
            if group.device_index < len(devs):
                free = devs[group.device_index].free_bytes
    else:
        free = hostmem.meminfo().get("MemAvailable")  # absent when /proc/meminfo cannot be read
    if not free:
        return 256 * MiB
    return max(16 * MiB, min(MAX_DEFAULT_BUCKET, free // 16 // MiB * MiB))


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
        self._released_s = 0.0  # seconds this update spent giving bucket memory back before its end
        self._last_meta_id: Optional[str] = None
        self._coll_slots: list = [None, None]
        self._ipc: Optional[IpcSenderState] = None
        self._seal_ahead: Optional[tuple] = None  # (seq, epoch, seal) made while the last update committed
        self._no_records = -1  # the last update of the IPC path (it left no records in the store)
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
        self.group.check_usable()
        t0 = time.perf_counter()
        why = check_version(version, self.version, self.allow_equal_versions, "this sender")
        if why:
            raise VersionError(why)
        manifest, items = self._manifest(named_tensors, specs)
        u = self._plan(version, manifest, items, t0)
        try:  # on success the update gives its bucket memory back itself (timed: the "release" phase)
            return self._run(u)
        except BaseException:
            if not u.keep:  # the update failed: its bucket memory goes back all the same
                try:
                    self._release_buffers()
                except Exception as e:  # noqa: BLE001 - the update's own error is the one raised
                    log.warning("giving back the bucket memory of a failed update also failed: %s", e)
            raise

    # ---------------------------------------------------------------- before anything is sent
    def _manifest(self, named_tensors, specs) -> tuple[Manifest, Iterator]:
        """The update's manifest and an iterator over its ``(name, tensor)`` pairs; raises
        :class:`InvalidArgumentError` for a bad argument (nothing is sent)."""
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
        return manifest, items

    def _plan(self, version: Any, manifest: Manifest, items: Iterator, t0: float) -> "_Update":
        """The update's path, bucket plan, number and header (the IPC socket opened if its path
        needs one)."""
        g = self.group
        keep = self.keep_buffers
        if keep is None:
            keep = not g.platform.is_accelerator
        if not isinstance(keep, bool):
            raise InvalidArgumentError(f"keep_buffers must be True, False or None, got {keep!r}")
        path, via, cipher = self.resolve()
        if self._path_buckets is not None:  # sized once per path, so the plan stays the same
            if path not in self._path_buckets:
                self._path_buckets[path] = default_bucket_bytes(g, path)
            self.bucket_bytes = self._path_buckets[path]
        plans = plan_buckets(manifest.specs, self.bucket_bytes)
        seq, g._seq = g._seq, g._seq + 1
        sock = path == "ipc" or via == "socket"  # through the IPC socket's authenticated connections
        if sock and self._ipc is None:
            self._ipc = IpcSenderState(g)
            # its accept thread keeps the channel alive: a sender dropped without close()
            # still gives back its socket and the buffers it kept
            self._ipc_finalizer = weakref.finalize(self, self._ipc.close)
        self._buffer_s = 0.0
        self._released_s = 0.0  # bucket memory given back during the update (the IPC path)
        u = _Update(seq=seq, epoch=g.epoch, version=version, manifest=manifest, items=items, plans=plans, path=path,
                    via=via, cipher=cipher, sock=sock, keep=keep, t0=t0,
                    reuse=manifest.meta_id == self._last_meta_id,
                    digests=self.verify and cipher == "none",  # an encrypted bucket is authenticated by its tag
                    # one control plane per path: the acknowledgement, go and done of the paths
                    # through the IPC socket (IPC, and the Unix stream, whose socket comes over
                    # that connection) travel on its authenticated connections (sealed like the
                    # store's records; rank 0's store is a thread of this process, and every
                    # request to it waits for this thread's interpreter lock), the collective's
                    # in the store
                    control="ipc" if sock else "store")
        u.header = {
            "version": version, "previous_version": self.version, "meta_id": manifest.meta_id,
            "specs": None if u.reuse else [[s.name, list(s.shape), s.dtype] for s in manifest.specs],
            "bucket_bytes": self.bucket_bytes, "path": path, "via": via, "cipher": cipher, "buckets": len(plans),
            "bytes": manifest.nbytes, "ipc": self._ipc.name if sock else None, "verify": u.digests,
            "keep_buffers": keep, "control": u.control,
        }
        if not u.reuse:
            # the receivers that read this header replace the metadata they keep with its specs: if
            # this update then breaks off, the last good update's id is no longer theirs to reuse
            self._last_meta_id = None
        return u

    # ---------------------------------------------------------------- one update, in order
    def _run(self, u: "_Update") -> TransferReport:
        """Header, acknowledgements, ``go``, the buckets, every commit, the report."""
        g = self.group
        intrusions0 = len(g.intrusions)
        g.put("hdr", u.header, u.seq, u.epoch)  # for the receivers not connected to the IPC socket
        if self._ipc is not None:  # the connected ones wait for it there (or hear it is in the store)
            self._ipc.announce(u.seq, u.epoch, u.header if u.control == "ipc" else None)
        # the update's keys: made while the last update committed, else now, while the receivers
        # read the header (not after "go")
        ahead, self._seal_ahead = self._seal_ahead, None
        if u.digests:
            u.seal = (ahead[2] if ahead is not None and ahead[:2] == (u.seq, u.epoch) and ahead[2].fits(u.plans)
                      else UpdateSeal.prepared(g, u.seq, u.epoch, u.plans))
        u.crypt = BucketCipher.of(g, u.seq, u.epoch) if u.cipher != "none" else None
        first, packing = self._pack_first(u)
        # the last update's records are dropped while the receivers answer (after the first
        # bucket's packing is queued: nothing waits on them) — unless it was an IPC update (it left
        # no record in the store)
        if u.seq and self._no_records != u.seq - 1:
            for k in ("go", "abort", *(f"ack/{r}" for r in g.receivers), *(f"done/{r}" for r in g.receivers)):
                g.drop(f"u{u.seq - 1}/{k}")
        if u.control == "ipc":
            self._no_records = u.seq
        connect = self._acknowledgements(u, packing)
        t_ack = time.perf_counter()
        try:
            self._stream_buckets(u, connect, first)
        finally:
            if u.seal is not None:
                u.seal.release()
        t_sent = time.perf_counter()
        # meanwhile the receivers verify and commit, the next update's keys are made (derived from
        # the group secret, the epoch and the update number: nothing new is learnt)
        if u.digests:
            self._seal_ahead = (u.seq + 1, u.epoch, UpdateSeal.prepared(g, u.seq + 1, u.epoch, u.plans))
        self._commits(u)
        prev, self.version = self.version, u.version
        self._last_meta_id = u.manifest.meta_id
        t_done = time.perf_counter()
        release_s = 0.0
        if not u.keep:  # every receiver has given its mappings back: the memory goes now
            self._release_buffers()
            release_s = time.perf_counter() - t_done
        t1 = time.perf_counter()
        self.last_report = TransferReport(u.version, prev, u.path, len(u.manifest.specs), u.manifest.nbytes,
                                          len(u.plans), t1 - u.t0, metadata_reused=u.reuse,
                                          verified=u.digests or u.cipher != "none",
                                          phases={"handshake": t_ack - u.t0, "stream": t_sent - t_ack,
                                                  "commit_wait": t_done - t_sent, "buffers": self._buffer_s,
                                                  "release": release_s + self._released_s},
                                          intrusions=list(g.intrusions[intrusions0:]))
        return self.last_report

    def _pack_first(self, u: "_Update") -> tuple:
        """Colocated: the first bucket is packed (and hashed) while the receivers read the header
        and answer; its bytes stay in this process's own buffer until ``go``.  Returns (its
        buffer or None, the error packing it raised or None: said once the receivers answered)."""
        if u.path != "ipc" or not u.plans or self._ipc.busy[0]:
            return None, None
        u.chan = IpcSendChannel(self, u.seq, give_back=not u.keep)
        try:
            return self._pack(u, u.plans[0], u.chan), None
        except Exception as e:  # the generator, a spec mismatch: said once the receivers answered
            return None, e
        except BaseException as e:
            self._call_off(u, f"{type(e).__name__}: {e}")
            raise

    def _acknowledgements(self, u: "_Update", packing: Optional[BaseException]) -> list[int]:
        """Every receiver's answer to the header: nothing moves before every one said yes.  Returns
        the receivers that connect to the IPC socket anew; a refusal (or the first bucket's packing
        error) calls the update off and raises."""
        g = self.group
        refusals, connect = [], []
        try:
            g.check_alive(g.receivers)  # a dead receiver: say so now, not after a timeout
            if u.via == "backend":
                g.process_group()  # a new epoch connects here; the receivers follow when they read the header
            for r in g.receivers:
                what = f"receiver rank {r} to accept update {u.seq} (version {u.version!r}); is receive() running?"
                if u.control == "ipc":  # a receiver not connected yet connects (and proves the secret) first
                    ack = self._ipc_record(r, "ack", u.seq, what)
                else:
                    ack = g.take(f"u{u.seq}/ack/{r}", R.ACK, seq=u.seq, epoch=u.epoch, peer=f"receiver rank {r}",
                                 watch=[r], what=what)
                if not ack["ok"]:
                    refusals.append((r, ack))
                elif ack["connected"]:
                    connect.append(r)
        except BaseException as e:
            self._call_off(u, f"{type(e).__name__}: {e}")
            raise
        if refusals:
            self._call_off(u, "a receiver refused")
            r, ack = refusals[0]
            if any(a["kind"] == "metadata" for _, a in refusals):
                self._last_meta_id = None
            cls = {"asleep": InvalidTransitionError, "version": VersionError}.get(ack["kind"], TransferError)
            raise cls(f"receiver rank {r} refused update {u.seq} (version {u.version!r}); nothing was sent: {ack['msg']}")
        if packing is not None:  # every receiver that read the header hears why, as "called off"
            self._call_off(u, f"{type(packing).__name__}: {packing}")
            if isinstance(packing, UnisleepError):
                raise packing
            raise TransferError(f"update {u.seq} (version {u.version!r}) aborted on the sender: "
                                f"{type(packing).__name__}: {packing}") from packing
        return connect

    def _stream_buckets(self, u: "_Update", connect: list[int], first) -> None:
        """``go``, then every bucket packed and posted through the path's channel, then its end; a
        failure aborts the update (every receiver hears why) and raises, naming a dead receiver."""
        g = self.group
        if u.control == "store":
            g.put(f"u{u.seq}/go", {"go": True, "why": ""}, u.seq, u.epoch)
        live = None  # the channel, once every receiver is connected to it
        try:
            if u.control == "ipc":
                for r in g.receivers:
                    conn = self._ipc.conns.get(r)
                    if conn is None:
                        raise TransferError(f"receiver rank {r}'s IPC connection closed after it acknowledged")
                    conn.send("go", u=u.seq)
            if u.via == "socket":  # the receivers that said they connect anew
                self._ipc.accept(connect)
                missing = sorted(set(g.receivers) - set(self._ipc.conns))
                if missing:  # a receiver that kept a connection this side has closed: it connects next time
                    raise TransferError(f"receivers {missing} answered without connecting to the IPC socket, whose "
                                        "connection to them this side had closed")
            live = u.chan or self._channel(u)
            for plan in u.plans:
                buf = first if first is not None and plan.index == 0 else self._pack(u, plan, live)
                if buf is not None:
                    live.post(plan.index % 2, plan, buf)
            live.end(abort=False)
        except Exception as e:  # the generator, a spec mismatch, the transport...
            ended = False
            why = f"{type(e).__name__}: {e}"
            try:
                if u.control == "store":
                    g.put(f"u{u.seq}/abort", {"why": why[:4000]}, u.seq, u.epoch)
                if live is not None:
                    live.end(abort=True, why=why)
                    ended = True
            except Exception:  # telling the receivers is best effort: the original error is raised below
                pass
            if u.sock and not ended:
                self._drop_ipc()  # the socket is out of step; an ended one stays (the receivers read 'end')
            else:
                g.channel_broke(f"update {u.seq} broke off")
            dead = self._dead_receivers()
            if isinstance(e, UnisleepError) and not dead:
                raise
            if dead:
                g.broken = dead[0]
                raise TransferError(f"update {u.seq} (version {u.version!r}) broke off: {'; '.join(dead)}; recreate "
                                    f"the group ({type(e).__name__}: {str(e)[:300]})") from e
            raise TransferError(f"update {u.seq} (version {u.version!r}) aborted on the sender: {type(e).__name__}: "
                                f"{e}") from e

    def _commits(self, u: "_Update") -> None:
        """Wait for every receiver's verdict (verified and committed, or why not)."""
        g = self.group
        errors = []
        try:
            for r in g.receivers:
                what = f"receiver rank {r} to verify and commit version {u.version!r}"
                if u.control == "ipc":
                    done = self._ipc_record(r, "done", u.seq, what)
                else:
                    done = g.take(f"u{u.seq}/done/{r}", R.DONE, seq=u.seq, epoch=u.epoch, peer=f"receiver rank {r}",
                                  watch=[r], what=what)
                if not done["ok"]:
                    errors.append(f"rank {r}: {done['msg']}")
        except BaseException:
            if u.via == "backend":
                g.channel_broke(f"update {u.seq}: no answer")
            raise
        if errors:
            raise named_error(f"update {u.seq} (version {u.version!r}) was rejected; receivers keep their previous "
                              "version: " + "; ".join(errors))

    def _channel(self, u: "_Update"):
        """The path's send channel (the ``buffer`` / ``begin`` / ``post`` / ``end`` verbs)."""
        if u.path == "ipc":
            return IpcSendChannel(self, u.seq, give_back=not u.keep)
        if u.via == "socket":
            return SocketSendChannel(self, u.seq)
        return CollectiveSendChannel(self, u.seq, u.crypt)

    def _pack(self, u: "_Update", plan: BucketPlan, chan):
        """Pack (and, on a device, hash in the same pass; on an encrypting channel, encrypt in the
        same pass and send each piece as soon as it is sealed) the next tensors of the update into
        the channel's buffer for ``plan``; returns the buffer (None: the bucket is not sent)."""
        import torch

        send = self._sends_bucket(plan)
        buf = chan.buffer(plan.index % 2, plan.total_bytes)
        seal, specs = u.seal, u.manifest.specs
        # a device bucket is hashed while it is packed (one pass over each tensor)
        hasher = seal.hasher(buf, plan) if seal is not None and plan.slots and buf.device.type != "cpu" else None
        sealer = chan.begin(plan, buf) if hasattr(chan, "begin") and send else None
        with torch.no_grad():
            for i, s in enumerate(plan.slots):
                spec = specs[s.index]
                try:
                    item = next(u.items)
                except StopIteration:
                    raise TransferError(f"the tensors ran out at {spec.name!r} (#{s.index}); the specs list {len(specs)}") from None
                if not isinstance(item, tuple) or len(item) != 2:
                    raise InvalidArgumentError(f"item #{s.index} of the tensors is not a (name, tensor) pair: "
                                               f"{str(item)[:80]}")
                name, t = item
                check_tensor(name, t, s.index)
                if name != spec.name or t.shape != spec.shape or dtype_name(t.dtype) != spec.dtype:
                    raise TransferError(f"tensor #{s.index} is {name!r} {tuple(t.shape)} {t.dtype}, "
                                        f"the specs say {spec.name!r} {spec.shape} {spec.dtype}")
                if sealer is not None:
                    sealer.put(s, t)
                elif s.nbytes and not (hasher is not None and hasher.fill(i, t)):
                    pack_tensor(buf, s.offset, s.nbytes, t)
            write_trailer(buf, plan, u.seq, seal, lanes=hasher.lanes() if hasher is not None else None)
            if sealer is not None:
                sealer.seal()
            if send:
                self._bucket_packed(plan, buf)
            if sealer is not None:
                sealer.close()
        return buf if send else None

    # ---------------------------------------------------------------- test seam (no-ops here)
    def _sends_bucket(self, plan: BucketPlan) -> bool:
        """Whether bucket ``plan`` goes out (asked before it is packed; its tensors are consumed
        either way).  Always True here; a test's subclass drops a bucket to show that the receiver
        names what never arrived."""
        return True

    def _bucket_packed(self, plan: BucketPlan, buf) -> None:
        """Called once per bucket that goes out, once it is packed, its trailer written and (on an
        encrypting channel) encrypted, before the trailer's bytes leave this process (a host
        channel streams a bucket while it is packed: the data before the trailer may have left
        already).  Does nothing here; a test's subclass alters the trailer there to show that the
        receiver refuses the bucket."""

    # ---------------------------------------------------------------- helpers of the steps
    def _host_buffer(self, slot: int, nbytes: int):
        """Send buffer ``slot`` of the collective and Unix-stream channels, at least ``nbytes`` (+
        :data:`~.cipher.SLACK`); a bucket larger than the usual size (one big tensor) gets a buffer
        of its own."""
        import torch

        cur = self._coll_slots[slot]
        if cur is None or cur.numel() < nbytes + SLACK:
            t0 = time.perf_counter()
            try:
                if nbytes > self.bucket_bytes + 4096:
                    return torch.empty(nbytes + SLACK, dtype=torch.uint8, device=self.group.device)
                cur = self._coll_slots[slot] = torch.empty(max(nbytes, self.bucket_bytes + 4096) + SLACK,
                                                           dtype=torch.uint8, device=self.group.device)
            finally:
                self._buffer_s += time.perf_counter() - t0
        return cur

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

    def _ipc_record(self, r: int, op: str, seq: int, what: str) -> dict:
        """Receiver ``r``'s ``ack`` or ``done`` of update ``seq`` from its IPC connection, as the
        store's record would say it (an ``error`` there is a ``done`` that failed)."""
        msg = self._ipc.answer(r, op, seq, what)
        ok = msg["op"] == op and msg["ok"]
        return {"ok": ok, "kind": msg["kind"] if msg["op"] == op else "error", "msg": msg["msg"], "connected": False}

    def _call_off(self, u: "_Update", why: str) -> None:
        """Before any byte moved: withdraw the header (a late receiver waits for the next one)
        and tell those waiting for ``go`` — on the update's control plane: on every IPC connection
        (the receivers that connected meanwhile admitted first; a receiver that is not waiting there
        skips it as a word of an earlier update), or in the store."""
        g = self.group
        g.drop("hdr")
        if u.control == "ipc":
            try:
                self._ipc.admit_queued()
            except TransferError:
                pass
            for r in list(self._ipc.conns):
                conn = self._ipc.conns[r]
                try:
                    conn.send("go", u=u.seq, ok=False, msg=ipc_text(why))
                except TransferError:
                    self._ipc._forget(r, conn)  # gone: that receiver connects again
            return
        try:
            g.put(f"u{u.seq}/go", {"go": False, "why": why[:4000]}, u.seq, u.epoch)
        except TransferError:
            pass


@dataclass(eq=False)
class _Update:
    """One update of a :class:`WeightSender` while it runs: what its header says and what its
    steps share."""

    seq: int
    epoch: int
    version: Any
    manifest: Manifest
    items: Iterator  # the (name, tensor) pairs, consumed as the buckets are packed
    plans: list
    path: str  # "ipc" or "collective"
    via: str  # "ipc", "socket" or "backend"
    cipher: str  # "aes-256-gcm" or "none"
    sock: bool  # through the IPC socket's authenticated connections (the IPC and Unix-stream paths)
    keep: bool  # the bucket memory is kept after the update
    t0: float
    reuse: bool  # the receivers have its specs already (the header carries only their id)
    digests: bool  # every tensor has a keyed digest in its bucket's trailer
    control: str  # where the acknowledgement, go and done travel: "ipc" (the IPC path) or "store"
    header: dict = field(default_factory=dict)
    seal: Optional[UpdateSeal] = None  # the digests' keys
    crypt: Optional[BucketCipher] = None
    chan: Any = None  # the IPC channel the first bucket was packed into while the receivers answered
