"""``WeightReceiver``: the engine's side of an update (ranks >= 1 of the group), and
:class:`RecvState`, the buckets of one update as they arrive.

One update (:meth:`WeightReceiver.receive`), in order: the header — on the IPC connection when
this side holds one to the sender's socket, else taken from the store; the checks
before a byte moves (the way the header names, the data channel, the guard, the version, the
target and the coverage) — a refusal is the acknowledgement; the IPC socket connected when the
path needs it; the acknowledgement; ``go``; the buckets through the path's receiving loop
(:mod:`.collective`, :mod:`.socket_path`, :mod:`.ipc`), each verified against the manifest and
applied at once into the live weights (streaming, the default: no bucket is kept once applied) —
or, when the receiver is ``staged``, held until the whole update is good; the guard checked again;
the commit and ``done``.  A failure part-way is rolled back or marks the weights torn
(:mod:`.rollback`), and the sender hears why."""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..errors import (IncompleteUpdateError, InvalidArgumentError, InvalidTransitionError, LifecycleClosedError,
                      TransferError, UnisleepError, UpdateMemoryError, VersionError)
from . import records as R
from . import rollback
from . import collective, ipc, socket_path
from .cipher import BucketCipher
from .group import TransferGroup
from .ipc import IpcConn, IpcGoneError, connect_ipc, handshake_receiver, ipc_text
from .manifest import (BucketPlan, Manifest, TensorSpec, UpdateSeal, check_bucket, plan_buckets, short_names, spec_of,
                       tensor_pairs)
from .records import check_version
from .report import TransferReport

log = logging.getLogger("unisleep.transfer")


def _out_of_memory(e: BaseException) -> bool:
    """``e`` says this process could not get memory (host or device)."""
    import errno

    return (isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
            or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
            or "DefaultCPUAllocator: can't allocate memory" in str(e))


class WeightReceiver:
    """Engine side (rank ≥ 1 of ``group``).

    Apply with ``apply`` — a callable taking a list of ``(name, tensor)`` pairs, e.g.
    ``model.load_weights`` (the tensors are views of transfer memory, valid during the call) — or
    in place into ``target``: a mapping name → tensor, an ``nn.Module`` (parameters and buffers,
    e.g. ones adopted by a :class:`~unisleep.MemoryLifecycle`).

    ``guard``: a :class:`~unisleep.MemoryLifecycle` (its ``guard_tags``, default ``"weights"``
    or else every tag, must be awake) or a callable returning True when the target may be written.
    A closed guard makes ``receive`` raise :class:`InvalidTransitionError` before a byte moves
    (:class:`~unisleep.errors.LifecycleClosedError` when the lifecycle itself was closed).

    ``staged`` (default False: streaming): each bucket is verified against the manifest's keyed
    digests and applied into the live weights while the next one arrives — at most two bucket
    buffers of extra memory, whatever the model size.  An update that fails part-way stays all or
    nothing without a second copy: nothing applied yet — the previous version serves; buckets
    applied and the guard lifecycle holds a retained level-1 backup proven equal to the weights
    when the update began — they are rolled back from it, byte-exact; otherwise the weights are
    *torn*: :attr:`torn` says which version is incomplete, :meth:`check_serving` (and the guard
    lifecycle's) raises :class:`~unisleep.errors.TornWeightsError` until an update covering the
    torn one's tensors completes.  The raised error's ``outcome`` (``"untouched"``,
    ``"rolled_back"`` or ``"torn"``) and its message say which.  ``staged=True``: every bucket is
    held until the whole update is verified, then applied — the previous weights keep serving
    meanwhile (costs one update's size of memory on the group's device).

    ``rollback`` (default True): with a :class:`~unisleep.MemoryLifecycle` guard whose backend
    retains backups, each update first proves the retained backup equal to the weights (one
    keyed-digest pass over the guarded tags) so that it can roll back to it; False skips the
    proof (a failure part-way then marks the weights torn).

    ``require_complete``: the update must cover the receiver's weights — ``True``: the names of
    ``target`` (or, with ``apply=``, the names adopted into the guard lifecycle's guarded tags);
    or a collection of names.  Names matched by ``preserve`` (globs) or by the guard lifecycle's
    :meth:`~unisleep.MemoryLifecycle.preserve` patterns may be left out (a level-2 sleep keeps
    them; the report's ``omitted`` lists them); an update leaving out any other is refused at the
    acknowledgement, before any byte moves, with :class:`~unisleep.errors.IncompleteUpdateError`.
    Default False: partial updates (some tensors only) are accepted.

    ``initial_version``: the version the target holds now; every update must come after it
    (``allow_equal_versions=True``: or equal to it).  A replayed or older update is refused.
    """

    def __init__(self, group: TransferGroup, *, apply: Optional[Callable] = None, target=None, guard=None,
                 staged: bool = False, guard_tags: Optional[Sequence[str]] = None, initial_version: Any = None,
                 allow_equal_versions: bool = False, rollback: bool = True,
                 require_complete: Union[bool, Iterable[str]] = False, preserve: Union[str, Sequence[str], None] = None):
        if group.is_sender:
            raise InvalidArgumentError("WeightReceiver runs on ranks >= 1; rank 0 is the sender")
        if apply is not None and target is not None:
            raise InvalidArgumentError("give apply= or target=, not both")
        if apply is None and target is None:
            raise InvalidArgumentError("a receiver needs apply= (e.g. model.load_weights) or target= (tensors to update in place)")
        for flag, val in (("staged", staged), ("rollback", rollback)):
            if not isinstance(val, bool):
                raise InvalidArgumentError(f"{flag} must be True or False, got {val!r}")
        pats = [preserve] if isinstance(preserve, str) else list(preserve or [])
        if not all(isinstance(p, str) and p for p in pats):
            raise InvalidArgumentError(f"preserve must be a glob or a list of globs over tensor names, got {preserve!r}")
        if require_complete is True:
            if target is None and not (guard is not None and hasattr(guard, "preserved_patterns")):
                raise InvalidArgumentError(
                    "require_complete=True needs target= (its names) or a MemoryLifecycle guard (its adopted names); "
                    "with apply= alone give the names the update must cover: require_complete=[...]")
            expect = None
        elif require_complete is False or require_complete is None:
            expect = None
        elif isinstance(require_complete, (str, bytes)) or not all(isinstance(n, str) for n in require_complete):
            raise InvalidArgumentError("require_complete must be True, False or a collection of tensor names, got "
                                       f"{require_complete!r}")
        else:
            expect = frozenset(require_complete)
        self.group = group
        self.apply = apply
        self.target = target
        self.guard = guard
        self.guard_tags = list(guard_tags) if guard_tags else None
        self.staged = staged
        self.rollback = rollback
        self.require_complete = require_complete is True or expect is not None
        self._expect = expect
        self.preserve = pats
        self.version: Any = initial_version
        self.consistent = True
        #: the incomplete update while the weights are torn (:class:`~unisleep.lifecycle.rollback.Torn`), else None
        self.torn = None
        self._meta: dict[str, tuple] = {}
        self._conn: Optional[IpcConn] = None
        self._stream = None  # socket for the bucket bytes of the socket path
        self._sock_name: Optional[str] = None
        self._ready = False
        self.allow_equal_versions = allow_equal_versions
        self._imports: dict[str, Any] = {}
        self._rot: list = [None, None]
        self._buffer_s = 0.0  # seconds this update spent mapping or allocating bucket memory
        self.last_report: Optional[TransferReport] = None

    # ---------------------------------------------------------------- checks before bytes
    def check_serving(self) -> None:
        """Raise :class:`~unisleep.errors.TornWeightsError` while an update failed part-way left the
        weights torn (naming the incomplete version and the fix); call it before generating."""
        if self.torn is not None:
            raise self.torn.error("WeightReceiver")

    def check_guard(self) -> None:
        """Raise :class:`InvalidTransitionError` if the target memory may not be written now
        (:class:`LifecycleClosedError` when the guarding lifecycle is closed)."""
        g = self.guard
        if g is None:
            return
        if getattr(g, "closed", False) is True:
            raise LifecycleClosedError(
                "cannot receive weights: the receiver's guard, a MemoryLifecycle, is closed (its memory was "
                "released); create a new lifecycle, adopt the target into it, and guard the receiver with that. "
                "Nothing was transferred."
            )
        if hasattr(g, "state") and callable(g.state):
            st = g.state()
            tags = self.guard_tags or (["weights"] if "weights" in st else list(st))
            closed = [t for t in tags if st.get(t) == "closed"]
            if closed:
                raise LifecycleClosedError(
                    f"cannot receive weights: the guard reports tag(s) {', '.join(map(repr, closed))} closed (the "
                    "lifecycle's memory was released); create a new lifecycle for the target. Nothing was transferred."
                )
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

    def _coverage(self, specs: Sequence[TensorSpec]) -> list[str]:
        """The preserved names the update leaves out (sorted); raises (``kind`` "coverage", with
        ``missing``) when it leaves out others.  Nothing to check unless ``require_complete``."""
        if not self.require_complete:
            return []
        lc = rollback.guard_lifecycle(self)
        if self._expect is not None:
            expect = set(self._expect)
        elif self.target is not None:
            expect = set(self._target_map())
        else:
            expect = {n for t in rollback.guard_tags(self, lc) for n in lc.names(t)}
        pats = list(self.preserve) + (lc.preserved_patterns() if lc is not None else [])
        left = expect - {s.name for s in specs}
        kept = sorted(n for n in left if any(fnmatch.fnmatchcase(n, p) for p in pats))
        missing = sorted(left - set(kept))
        if missing:
            e = TransferError(f"the update leaves out {len(missing)} tensor(s) of the receiver's weights that are not "
                              f"preserved across its sleep: {short_names(missing)}; send every tensor (or preserve "
                              "the frozen ones: preserve= globs, or the lifecycle's preserve())")
            e.kind, e.missing = "coverage", missing
            raise e
        return kept

    def _header_plan(self, hdr: dict) -> tuple:
        """The specs and bucket plan an authentic header describes, or an error (with ``kind``) for
        the sender: specs that do not match their id, metadata never received, a target they do
        not fit, counts that do not add up."""
        def bad(kind: str, msg: str) -> TransferError:
            e = TransferError(msg)
            e.kind = kind
            return e

        if not 0 < hdr["bucket_bytes"] <= 1 << 40 or hdr["buckets"] < 0 or hdr["bytes"] < 0:
            raise bad("header", f"bucket size {hdr['bucket_bytes']}, {hdr['buckets']} buckets, {hdr['bytes']} bytes: "
                                "not an update")
        if hdr["specs"] is not None:
            specs_ = tuple(spec_of(s, i) for i, s in enumerate(hdr["specs"]))
            if Manifest(specs_).meta_id != hdr["meta_id"]:
                raise bad("metadata", "the specs do not match their id")
            self._meta = {hdr["meta_id"]: specs_}
        specs = self._meta.get(hdr["meta_id"])
        if specs is None:
            raise bad("metadata", f"metadata {hdr['meta_id']} was never received here; resend with the tensor specs")
        problem = self._check_target(specs)
        if problem:
            raise bad("target", problem)
        plans = plan_buckets(specs, hdr["bucket_bytes"])
        if len(plans) != hdr["buckets"] or sum(s.nbytes for s in specs) != hdr["bytes"]:
            raise bad("metadata", "the bucket count or size does not match the specs")
        return specs, plans, self._coverage(specs)

    # ---------------------------------------------------------------- one update
    def receive(self, *, timeout_s: Optional[float] = None) -> TransferReport:
        """Receive, verify and apply the next update; return its report.

        Raises :class:`InvalidTransitionError` (guard closed: nothing moved),
        :class:`~unisleep.errors.IncompleteUpdateError` (coverage required and not met: nothing
        moved) or :class:`TransferError` (refused, incomplete, corrupt, sender died or timed out,
        ``apply`` raised); in every such case ``version`` is still the previous one, and the
        error's ``outcome`` says what became of the weights: ``"untouched"`` (nothing applied;
        always so with ``staged=True`` unless ``apply`` itself failed), ``"rolled_back"``
        (restored byte-exact from the guard lifecycle's retained backup) or ``"torn"`` (see
        :attr:`torn`).  A timeout leaves the group in step: the next ``receive`` takes the next
        update.  A complete update clears a torn mark once it covers the torn update's tensors.
        """
        try:
            return self._receive(timeout_s)
        except UnisleepError as e:
            if getattr(e, "outcome", None) is None:
                e.outcome = "untouched"
            raise

    def _receive(self, timeout_s: Optional[float]) -> TransferReport:
        """Header, checks, acknowledgement, ``go``, the buckets, the commit and ``done``."""
        g = self.group
        g.check_usable()
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                                          and 0 < timeout_s < float("inf")):
            raise InvalidArgumentError(f"timeout_s must be a positive number of seconds (or None: the group's), "
                                       f"got {timeout_s!r}")
        t0 = time.perf_counter()
        intrusions0 = len(g.intrusions)
        u = self._take_header(timeout_s)
        specs, plans, omitted = self._check_header(u)
        self._acknowledge(u)
        # the update's keys are made while the sender collects the acknowledgements, and the
        # retained backup to roll back to is proven equal to the weights
        seal = UpdateSeal.prepared(g, u.seq, u.epoch, plans) if u.hdr["verify"] else None
        point = rollback.restore_point(self)
        self._wait_go(u, timeout_s)
        t_ack = time.perf_counter()
        crypt = BucketCipher.of(g, u.seq, u.epoch) if u.hdr["cipher"] != "none" else None
        state = RecvState(self, u.seq, specs, plans, u.hdr["verify"], seal, u.epoch, cipher=crypt, control=u.control)
        self._buffer_s = 0.0
        keep = u.hdr["keep_buffers"]
        try:
            if u.via == "socket" and u.connected:  # the sender admits it once every receiver acknowledged
                handshake_receiver(self._conn, min(g.timeout_s, 30.0))
                self._ready = True
            path = ipc if u.hdr["path"] == "ipc" else socket_path if u.via == "socket" else collective
            path.receive(self, state)
            t_recv = time.perf_counter()
            state.finish(u.version)
            self.check_guard()  # nobody put the weights to sleep meanwhile
            state.commit()
            t_commit = time.perf_counter()
            if not keep:  # the update has ended: its bucket memory goes back before the sender hears "done"
                self._release_buffers()
        except Exception as e:
            if not keep:
                try:
                    self._release_buffers()
                except Exception:  # noqa: BLE001 - the update's own error is the one raised
                    pass
            raise self._failed(u, state, point, e) from e
        finally:
            if seal is not None:
                seal.release()
        prev, self.version = self.version, u.version
        self.consistent = True
        rollback.clear(self, [sp.name for sp in specs])
        t1 = time.perf_counter()
        if u.control == "ipc":
            try:
                self._conn.send("done", u=u.seq, ok=True)
            except TransferError:  # the sender hung up (it says why); this side has the update
                self._drop_ipc()
        else:
            g.put(f"u{u.seq}/done/{g.rank}", {"ok": True, "msg": "", "version": u.version}, u.seq, u.epoch)
        self.last_report = TransferReport(u.version, prev, u.hdr["path"], len(specs), u.hdr["bytes"], len(plans),
                                          t1 - t0, metadata_reused=u.hdr["specs"] is None,
                                          verified=state.verify or crypt is not None,
                                          phases={"handshake": t_ack - t0, "stream": t_recv - t_ack,
                                                  "commit": t_commit - t_recv, "buffers": self._buffer_s,
                                                  "release": t1 - t_commit},
                                          intrusions=list(g.intrusions[intrusions0:]), omitted=omitted)
        return self.last_report

    # ---------------------------------------------------------------- the steps of one update
    def _take_header(self, timeout_s: Optional[float]) -> "_Incoming":
        """The next update's header (the update numbers increase): on the IPC connection when
        this side holds one (:meth:`_ipc_header`), else from the store."""
        g = self.group
        try:
            got = self._ipc_header(timeout_s) if self._conn is not None and self._ready else None
            if got is None:
                got = g.take("hdr", R.HEADER, seq=None, epoch=None, timeout_s=timeout_s, peer="the sender (rank 0)",
                             watch=[0], accept=lambda rs, _e, _b: rs > g.last_seq,
                             what=f"the next update from the sender (still serving version {self.version!r})",
                             resume=True)
            seq, epoch, hdr = got
        except R.MalformedRecordError as e:  # authentic, but this side cannot take it: the sender hears why
            # (the header's path cannot be read: answered where the sender may listen — on the IPC
            # connection when there is one, else in the store)
            g.last_seq = e.seq
            if self._conn is not None and self._ready:
                try:
                    self._conn.send("ack", u=e.seq, ok=False, kind="header", msg=ipc_text(str(e)))
                except TransferError:
                    self._drop_ipc()
            try:
                g.put(f"u{e.seq}/ack/{g.rank}", {"ok": False, "kind": "header", "msg": str(e)[:4000],
                                                 "connected": False}, e.seq, e.epoch)
            except TransferError:
                pass
            raise TransferError(f"update {e.seq} refused: {e}; still serving version {self.version!r}") from None
        g.last_seq = seq
        if epoch != g.epoch:
            g.epoch = epoch  # the sender moved the data channel on after a broken update
        return _Incoming(seq, epoch, hdr)

    def _ipc_header(self, timeout_s: Optional[float]) -> Optional[tuple]:
        """The next update's ``(seq, epoch, header)`` on the IPC connection, where the sender
        sends it to a receiver connected already (a store round trip less per update).  None:
        read it in the store — the sender said so (a header too long for a message, or a path
        that does not answer on the connection), or the connection closed or is out of step
        (dropped: this side connects again).  While nothing comes, the sender's liveness is
        checked and the store looked at every quarter second: a header there that this
        connection never announces (another sender's) is taken from there.  Ends within
        ``timeout_s`` (None: the group's) with a :class:`TransferError`, the connection kept."""
        import select

        g = self.group
        limit = g.timeout_s if timeout_s is None else timeout_s
        what = f"the next update from the sender (still serving version {self.version!r})"
        t0 = time.monotonic()
        while True:
            left = limit - (time.monotonic() - t0)
            try:
                ready = select.select([self._conn.sock], [], [], min(0.25, max(0.0, left)))[0]
            except (OSError, ValueError):
                self._drop_ipc()
                return None
            if ready:
                try:
                    msg, fds = self._conn.recv(what)
                except TransferError:  # it hung up, or a message that does not open: connect again
                    self._drop_ipc()
                    return None
                for fd in fds:
                    os.close(fd)
                if msg["op"] == "hdr" and msg["u"] > g.last_seq and not fds:
                    if self._hung_up():  # sent before the sender closed this connection (that update
                        self._drop_ipc()  # was called off): the store says what comes next
                        return None
                    hdr = ipc.header_of(msg)
                    return None if hdr is None else (msg["u"], msg["k"], hdr)
                if msg["op"] in ("go", "end", "hdr") and msg["u"] <= g.last_seq and not fds:
                    continue  # a late word of an earlier update
                self._drop_ipc()  # out of step: the header is in the store too
                return None
            if time.monotonic() - t0 >= limit:
                raise TransferError(f"waiting for {what}: timed out after {time.monotonic() - t0:.1f} s")
            g.check_alive([0])
            try:
                return g.take("hdr", R.HEADER, seq=None, epoch=None, timeout_s=0.01, peer="the sender (rank 0)",
                              watch=[], accept=lambda rs, _e, _b: rs > g.last_seq, what=what, resume=True)
            except R.MalformedRecordError:
                raise
            except TransferError:  # nothing newer there
                if g.broken:
                    raise

    def _check_header(self, u: "_Incoming") -> tuple:
        """Everything that can refuse the update before a byte moves — the way the header names,
        the data channel, the guard, the version, the target and the coverage; a refusal is the
        acknowledgement (the sender raises it) and raises here.  Returns (specs, plans, omitted)."""
        g, hdr, via = self.group, u.hdr, u.via
        if (hdr["path"] == "ipc") != (via == "ipc") or (via == "socket" and not g.local) or (
                hdr["cipher"] != "none" and via != "backend") or u.control != ("ipc" if via in ("ipc", "socket") else "store"):
            msg = (f"path {hdr['path']!r} via {via!r} with cipher {hdr['cipher']!r} and control {u.control!r} is not a "
                   "way to this receiver")
            self._refuse(u, "header", msg)
            raise TransferError(f"update {u.seq} refused: {msg}")
        try:
            if via == "backend":
                g.process_group()  # the data channel of this epoch (a new one connects with the sender's)
        except Exception as e:
            self._refuse(u, "channel", str(e))
            raise
        try:
            self.check_guard()
        except InvalidTransitionError as e:
            self._refuse(u, "asleep", str(e))
            raise
        why = check_version(u.version, self.version, self.allow_equal_versions, "this receiver")
        if why:
            self._refuse(u, "version", why)
            raise VersionError(f"update {u.seq} refused: {why}; still serving version {self.version!r}")
        try:
            return self._header_plan(hdr)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the sender hears it
            kind = getattr(e, "kind", "header")
            msg = str(e) if isinstance(e, UnisleepError) else f"{type(e).__name__}: {e}"
            self._refuse(u, kind, msg)
            if kind == "coverage":
                raise IncompleteUpdateError(f"update {u.seq} (version {u.version!r}) refused before any byte moved: "
                                            f"{msg}; still serving version {self.version!r}", missing=e.missing) from None
            raise TransferError(f"update {u.seq} (version {u.version!r}) refused before any byte moved: {msg}") from None

    def _refuse(self, u: "_Incoming", kind: str, msg: str) -> None:
        """Refuse the update on its control plane (the IPC connection: connected first, if this side can;
        when it cannot, the refusal is raised here all the same and the sender hears of this
        receiver within its timeout)."""
        try:
            self._answer(u, False, kind, msg)
        except Exception as e:  # noqa: BLE001 - the refusal is the error raised
            log.warning("update %d: the refusal (%s) could not reach the sender: %s", u.seq, kind, e)

    def _acknowledge(self, u: "_Incoming") -> None:
        """Say yes: the IPC path connects (and proves the group secret) first; the Unix-stream path
        connects when this side has no live connection to the sender's socket (its handshake
        follows ``go``), and its acknowledgement in the store says so."""
        if u.sock and u.control == "store":
            try:
                u.connected = self._connect(u.hdr["ipc"] or "")
            except Exception as e:
                msg = f"cannot connect to the sender's IPC socket: {type(e).__name__}: {e}"
                self._refuse(u, "ipc", msg)
                if isinstance(e, UnisleepError):
                    raise
                raise TransferError(f"update {u.seq}: {msg}") from e
        self._answer(u, True)

    def _answer(self, u: "_Incoming", ok: bool, kind: str = "", msg: str = "") -> None:
        """The acknowledgement (or refusal) of the header, on the update's control plane."""
        if u.control == "store":
            g = self.group
            g.put(f"u{u.seq}/ack/{g.rank}", {"ok": ok, "kind": kind, "msg": msg[:4000], "connected": u.connected},
                  u.seq, u.epoch)
            return
        self._connect(u.hdr["ipc"] or "")
        if not self._ready:
            try:
                handshake_receiver(self._conn, min(self.group.timeout_s, 30.0))
            except BaseException:
                self._drop_ipc()
                raise
            self._ready = True
        try:
            self._conn.send("ack", u=u.seq, ok=ok, kind=kind, msg=ipc_text(msg))
        except TransferError as e:  # the sender closed this connection: this update is over, the next connects
            self._drop_ipc()
            raise TransferError(f"update {u.seq}: the sender closed the IPC connection ({e}); still serving version "
                                f"{self.version!r}") from e

    def _wait_go(self, u: "_Incoming", timeout_s: Optional[float]) -> None:
        """The sender's ``go`` (every receiver said yes), or its call-off (raised)."""
        if u.control == "ipc":
            go = self._ipc_go(u.seq, timeout_s)
        else:
            go = self.group.take(f"u{u.seq}/go", R.GO, seq=u.seq, epoch=u.epoch, timeout_s=timeout_s,
                                 peer="the sender (rank 0)", watch=[0], what=f"the sender to start update {u.seq}")
        if not go["go"]:
            if u.connected:  # the sender never admitted this connection
                self._drop_ipc()
            raise TransferError(f"update {u.seq} (version {u.version!r}) was called off by the sender: {go['why']}; "
                                f"still serving version {self.version!r}")

    def _failed(self, u: "_Incoming", state: "RecvState", point, e: Exception) -> Exception:
        """The update failed once bytes moved: what became of the weights (untouched, rolled back
        or torn) is settled, the sender hears why on the update's control plane, and the error to
        raise (its ``outcome`` set) is returned."""
        g = self.group
        why = f"{type(e).__name__}: {e}"
        if state.apply_failed:
            why = f"applying bucket {state.apply_failed[0]} raised {why}"
        outcome, tail = rollback.settle(self, state, point, u.version, why)
        if isinstance(e, VerifyError):
            err: Exception = TransferError(f"{e}; {tail}")
        else:
            dead = g.peer_dead(0) if type(e) in (TransferError, IpcGoneError) else None
            if dead:  # the sender's socket closed because it died: say so
                g.broken = dead
                err = TransferError(f"update {u.seq} (version {u.version!r}) broke off: the sender died ({dead}; "
                                    f"{e}); {tail}; recreate the group")
            elif state.apply_failed:
                err = TransferError(f"update {u.seq} (version {u.version!r}) broke off: {why}; {tail}")
            elif _out_of_memory(e):  # this side's own memory, not the sender
                arrived = len(state.got) + len(state.rejected)
                err = UpdateMemoryError(
                    f"update {u.seq} (version {u.version!r}) broke off: this side ran out of memory for its next "
                    f"bucket ({arrived} of {len(state.plans)} buckets had arrived, the largest "
                    f"{max((p.total_bytes for p in state.plans), default=0)} bytes): {type(e).__name__}: {e}; "
                    f"{tail}; free memory on this side or give the sender a smaller bucket_bytes")
            elif isinstance(e, UnisleepError):
                err = type(e)(f"{e}; {tail}")
            else:
                err = TransferError(f"update {u.seq} (version {u.version!r}) broke off (the sender died, "
                                    f"timed out or the connection failed): {type(e).__name__}: {e}; {tail}")
        err.outcome = outcome
        text = f"{type(err).__name__}: {err}"
        if u.control == "store":  # the done record first: the sender looks there when the connection fails
            try:
                g.put(f"u{u.seq}/done/{g.rank}", {"ok": False, "msg": text[:4000], "version": None}, u.seq, u.epoch)
            except Exception:  # noqa: BLE001
                pass
        elif isinstance(e, VerifyError) and self._conn is not None:
            try:  # the connection is in step: the sender waits for the verdict there
                self._conn.send("done", u=u.seq, ok=False, msg=ipc_text(text))
            except TransferError:
                self._drop_ipc()
        elif self._conn is not None and self._ready:  # the reason, before this side hangs up
            try:
                self._conn.send("error", u=u.seq, msg=ipc_text(text))
            except Exception:  # noqa: BLE001
                pass
        if u.sock and not isinstance(e, VerifyError):
            self._drop_ipc()  # the connection may be out of step: connect again on the next update
        return err

    def _ipc_go(self, seq: int, timeout_s: Optional[float]) -> dict:
        """The sender's ``go`` for update ``seq`` on the IPC connection (as the store's record)."""
        try:
            while True:
                msg, fds = self._conn.recv(f"the sender to start update {seq}", timeout_s)
                for fd in fds:
                    os.close(fd)
                if msg["op"] == "go" and msg["u"] < seq and not fds:
                    continue  # the call-off of an earlier update, meant for another receiver
                if msg["op"] == "hdr" and msg["u"] <= seq and not fds:
                    continue  # this update's header, taken from the store meanwhile (or an earlier one)
                if msg["op"] == "go" and msg["u"] == seq and not fds:
                    return {"go": msg["ok"], "why": msg["msg"]}
                raise TransferError(f"the sender sent {msg['op']!r} (update {msg['u']}) on the IPC socket while this "
                                    f"receiver waited for it to start update {seq}")
        except TransferError as e:
            self._drop_ipc()  # out of step: connect again on the next update
            dead = self.group.peer_dead(0)
            if dead:
                self.group.broken = dead
                raise TransferError(f"update {seq} broke off: the sender died ({dead}); still serving version "
                                    f"{self.version!r}; recreate the group") from e
            raise TransferError(f"update {seq}: no start from the sender ({e}); still serving version "
                                f"{self.version!r}") from e

    # ---------------------------------------------------------------- the IPC connection
    def _connect(self, name: str) -> bool:
        """Connect to the sender's IPC socket ``name`` unless this side holds a live connection to
        it (one the sender has closed — it was out of step — is dropped first); returns whether it
        connected anew (the handshake is the caller's)."""
        if self._conn is not None and self._sock_name == name and self._ready and not self._hung_up():
            return False
        self._drop_ipc()
        if not name.startswith("\0unisleep-transfer-"):
            raise TransferError(f"the header names an IPC socket {name!r} that is not a unisleep transfer socket")
        self._conn = connect_ipc(self.group, name)
        self._sock_name, self._ready = name, False
        return True

    def _hung_up(self) -> bool:
        """Whether the sender closed this side's IPC connection (what it sent before is read
        first: a late word of an earlier update is skipped where it is read)."""
        import select
        import socket

        sock = self._conn.sock
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False  # nothing to read: not closed
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _release_buffers(self) -> None:
        """Give back the bucket memory of the update that ended: the sender's buffers this side
        mapped (the connection stays) and its own receive buffers."""
        from ..keyed_hash import drop_layouts

        self._rot = [None, None]
        imports, self._imports = self._imports, {}
        for imp in imports.values():
            imp.close()
        if self.group.device.type != "cpu":
            drop_layouts(self.group.device)

    def buffer_bytes(self) -> int:
        """Bytes of bucket memory this receiver holds now (mapped from the sender, its own
        receive buffers, on a device the hash's block tables kept in this process): 0 between
        updates unless the sender keeps its buffers."""
        from ..keyed_hash import layout_bytes

        n = sum(imp.nbytes for imp in self._imports.values()) + sum(t.numel() for t in self._rot if t is not None)
        if self.group.device.type != "cpu":
            n += layout_bytes(self.group.device)
        return n

    def _drop_ipc(self) -> None:
        for imp in self._imports.values():
            imp.close()
        self._imports.clear()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._conn is not None:
            self._conn.close()
        self._conn = self._sock_name = None
        self._ready = False

    def close(self) -> None:
        self._drop_ipc()
        self._rot = [None, None]


class VerifyError(TransferError):
    """The update's bytes fail the manifest (missing, corrupt, out of place), or the sender
    aborted it and said so: refused, and the IPC socket is still in step."""


class RecvState:
    """Buckets of one update as they arrive: verified, then applied at once (or staged);
    ``rx`` is the :class:`~unisleep.transfer.receiver.WeightReceiver` receiving them.

    ``touched`` counts the buckets whose apply began (an apply that raises may have written part
    of its bucket), ``touched_names`` their tensors; ``applied`` the buckets applied whole.  A
    streaming update keeps no reference to a bucket once it is applied (``got`` records only
    which arrived)."""

    def __init__(self, rx: Any, seq: int, specs: Sequence[TensorSpec], plans: list[BucketPlan], verify: bool,
                 seal=None, epoch: int = 0, cipher=None, control: str = "store"):
        self.rx, self.seq, self.specs, self.plans, self.verify = rx, seq, specs, plans, verify
        self.seal, self.epoch, self.cipher, self.control = seal, epoch, cipher, control
        self.why = ""  # an abort's reason, as the IPC path's end message says it
        self.got: dict[int, Any] = {}
        self.rejected: set[int] = set()
        self.corrupt: list[str] = []
        self.problems: list[str] = []
        self.aborted = False
        self.applied = 0
        self.touched = 0
        self.touched_names: list[str] = []
        self.apply_failed: list[int] = []  # the bucket whose apply raised
        self._tmap: Optional[dict] = None

    def take(self, k: int, buf, authentic: Optional[bool] = None) -> None:
        """Bucket ``k`` arrived in ``buf``; ``authentic``: the verdict of its AES-GCM tag when it
        came encrypted (its tensors are then not digested again)."""
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
        if authentic is False:
            self.problems.append(f"bucket {k} fails authentication (its AES-GCM tag): altered or forged on the way")
            self.corrupt += [self.specs[s.index].name for s in plan.slots]
            self.rejected.add(k)
            return
        if self.verify or authentic:
            problem, bad = check_bucket(buf, plan, self.seq, self.seal if self.verify else None)
            if problem:
                self.problems.append(problem)
            if bad:
                self.corrupt += [self.specs[plan.slots[i].index].name for i in bad]
                self.rejected.add(k)
                return
        self.got[k] = buf if self.rx.staged else None
        if not self.rx.staged and not self.corrupt and not self.problems:
            self._apply(plan, buf)

    def end(self, msg: dict) -> None:
        """The sender's ``end`` message (IPC connection) closes the update this side receives
        (aborted or not); an end for another update is an error."""
        if msg["u"] != self.seq:
            raise TransferError(f"the sender ended update {msg['u']} while this side received update {self.seq}")
        self.aborted = bool(msg["abort"])
        self.why = msg["msg"]

    def finish(self, version) -> None:
        """Raise :class:`VerifyError` unless every bucket arrived and passed (the receiver adds
        what became of the weights: untouched, rolled back or torn)."""
        if self.aborted:
            why = self.why or "no reason given"
            if self.control == "store":  # the reason is a record of the update's control plane
                try:
                    why = self.rx.group.take(f"u{self.seq}/abort", R.ABORT, seq=self.seq, epoch=self.epoch,
                                             timeout_s=5.0, peer="the sender (rank 0)", watch=[0],
                                             what="the sender's reason")["why"]
                except TransferError:
                    pass
            raise VerifyError(f"the sender aborted update {self.seq} (version {version!r}): {why}")
        missing_b = [p for p in self.plans if p.index not in self.got and p.index not in self.rejected]
        missing = [self.specs[s.index].name for p in missing_b for s in p.slots]
        if missing or self.corrupt or self.problems:
            parts = []
            if missing:
                parts.append(f"incomplete: {len(missing)} tensor(s) never arrived (buckets "
                             f"{short_names([str(p.index) for p in missing_b])}): {short_names(missing)}")
            if self.corrupt:
                parts.append(f"corrupt: {len(self.corrupt)} tensor(s) fail the manifest's keyed digest: {short_names(self.corrupt)}")
            if self.problems:
                parts.append("; ".join(self.problems[:4]))
            raise VerifyError(f"update {self.seq} (version {version!r}) refused: " + "; ".join(parts))

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
        self.touched += 1
        self.touched_names += [name for name, _ in pairs]
        try:
            if self.rx.apply is not None:
                self.rx.apply(pairs)
            else:
                if self._tmap is None:
                    self._tmap = self.rx._target_map()
                tmap = self._tmap
                with torch.no_grad():
                    for name, v in pairs:
                        tmap[name].copy_(v)
        except BaseException:
            self.apply_failed.append(plan.index)
            raise
        self.applied += 1

    def commit(self) -> None:
        if not self.rx.staged:
            return
        for plan in self.plans:
            self._apply(plan, self.got[plan.index])
        self.got.clear()


@dataclass(eq=False)
class _Incoming:
    """The update a :class:`WeightReceiver` takes: its header and what its steps share."""

    seq: int
    epoch: int
    hdr: dict
    connected: bool = False  # this side connected to the sender's IPC socket anew for it

    @property
    def version(self) -> Any:
        return self.hdr["version"]

    @property
    def via(self) -> str:
        return self.hdr["via"]

    @property
    def control(self) -> str:
        """Where the acknowledgement, go and done travel: ``"ipc"`` (the IPC path) or ``"store"``."""
        return self.hdr["control"]

    @property
    def sock(self) -> bool:
        """Through the sender's IPC socket (the IPC and Unix-stream paths)."""
        return self.hdr["path"] == "ipc" or self.hdr["via"] == "socket"

