"""The collective path, both ends: bucket bytes over the group's process-group backend (gloo on
the host platform, the vendor's collective on an accelerator).

* The data channel (:class:`_DataChannel`, a base class of
  :class:`~unisleep.transfer.group.TransferGroup` that uses its state: secret, peers, store,
  liveness): the backend of the current epoch, bootstrapped through a store whose values carry an
  HMAC under the group secret, and — for a backend that connects whoever first sends the number it
  expects — each pair's proof of the group secret before a byte of weights moves.  After an update
  broke off mid-stream the sender moves to the next epoch (a fresh backend) and every receiver
  follows when it reads the next header.
* The sender's channel (:class:`CollectiveSendChannel`, the ``buffer`` / ``post`` / ``end`` verbs
  of every path): a 4-word descriptor (update, bucket, bytes, flags), then the bucket, both
  broadcast from rank 0; two send buffers alternate so packing overlaps the transfer in flight.  A
  host bucket goes in pieces, each broadcast as soon as it is packed (:class:`_Sealer`), and with
  a cipher (:mod:`.cipher`) each piece is encrypted in place just before, then its tag.  Device
  memory is packed, then sent (never encrypted).
* The receiver's loop (:func:`receive`): each descriptor, then its bucket into one of two receive
  buffers (or a fresh one when staged); bucket k-1 is verified and applied while bucket k is in
  flight; encrypted pieces are decrypted as each arrives.
* Every wait on the backend checks the other members' liveness (:func:`wait_work`): a dead peer
  ends it within a few seconds, named, instead of the group's timeout.

The control records of an update on this path (acknowledgement, go, done) travel in the group's
store.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from typing import Any, Optional

from ..errors import TransferError, UnsupportedError
from .cipher import SLACK, pieces, writable_view
from .manifest import BucketPlan, pack_tensor
from .listener_guard import ListenerGuard
from .netinfo import foreign_connections, listening_ports

log = logging.getLogger("unisleep.transfer")

ABORT, END = 1, -1  # descriptor flag: the update was aborted; descriptor bucket index: no more buckets
CIPHERED = 2  # descriptor flag: the bucket's pieces are encrypted, and its tag follows them (.cipher)
PIECED = 4  # descriptor flag: the bucket follows in pieces of cipher.PIECE bytes

#: once both ends of a data-channel pair are up, the proof that it is theirs arrives within this
PROOF_S = 5.0
#: gloo's own timeout for the proof's all-to-all: its threads stop waiting on a pair a stranger
#: holds after this long (the caller never waits on them: the backend is retired off its thread)
PROOF_OP_S = 20.0
#: gloo's own timeout to connect a data channel's pairs once every member arrived to connect it
CONNECT_S = 30.0


class _DataChannel:
    """The data channel (epochs) of :class:`~unisleep.transfer.group.TransferGroup`."""

    def process_group(self, connect: bool = True):
        """The backend object that moves bytes (of the current epoch); raises with the reason when
        it cannot exist.  ``connect=False``: only check that it can exist."""
        if self._shared and not self._collective.SAME_DEVICE_OK:
            raise UnsupportedError(self._collective.same_device_message(self._shared))
        self.check_usable()
        if not connect:
            return self._pg
        if self._pg is None or self._pg_epoch != self.epoch:
            self._connect_pg(self.epoch)
        return self._pg

    def _connect_pg(self, epoch: int) -> None:
        from ..errors import IntrusionError

        old, self._pg = self._pg, None
        if old is not None:
            _retire(old)
            old = None
        store = _sealed_store_class()(self.store.prefixed(f"pg{epoch}"), self, f"pg{epoch}")
        proof = getattr(self._collective, "PAIR_PROOF", False)
        before = listening_ports() if proof else set()
        others = [p.rank for p in self.peers if p.rank != self.rank]
        guard = None
        pg = None
        pending: list = []  # the proof's work, while gloo's threads may still wait on it
        try:
            if proof:
                # gloo's listener takes whoever connects: it opens only once every member is about to
                # connect (so it is open for milliseconds, not while a member is still busy), it is
                # guarded while open, and sealed once the pairs are made (.listener_guard)
                self._arrive(store, epoch, others)
                guard = ListenerGuard({p.uid for p in self.peers}, store.published, self.world_size,
                                      members_local=self.local)
                store.on_set = guard.claim
            pg = self._construct(store, epoch, others, guard)
            # the backend holds only the C++ side of this Python store: without a Python reference
            # it is collected, and a backend that bootstraps later (on its first collective)
            # finds no ``get`` to call ("Not implemented")
            self._pg_store = store
            if proof:
                guard.seal()
                if guard.seal_error:
                    log.warning("transfer group %s: the data channel's listener could not be sealed (%s); the pairs' "
                                "proof still guards it", self.group_id.split("/")[0], guard.seal_error)
                ports = guard.ports or {p for _ip, p in listening_ports() - before}
                self._prove_pairs(pg, epoch, store, ports, guard, pending)
                self._name_foreign(ports, epoch)
                flood = guard.flood()
                if flood:
                    self._intrusion(f"the data channel (epoch {epoch}): {flood}; it is sealed now")
        except BaseException as e:
            # the backend is shut down and destroyed off this thread: its threads may wait on a pair a
            # stranger holds until the proof's own timeout, and its destructor joins them
            if pg is not None:
                _retire(pg, pending)
                pg, pending = None, []
            _quiet(lambda: store.set(f"broken/{self.rank}", f"{type(e).__name__}: {e}"[:2000]))
            if isinstance(e, IntrusionError):
                self._intrusion(str(e))
                self.channel_broke(f"the data channel of epoch {epoch} was not the group's")
            e.__context__ = None  # neither the frames below nor an exception they handled keep the backend
            raise e.with_traceback(None) from None
        finally:
            if guard is not None:
                guard.stop()
        self._pg = pg
        self._pg_epoch = epoch

    def _arrive(self, store, epoch: int, others) -> None:
        """Wait (liveness checked, at most the group's timeout) until every member is about to
        connect the data channel of ``epoch``."""
        store.set(f"arrive/{self.rank}", b"1")
        t0 = time.monotonic()
        next_live = t0
        while True:
            missing = [j for j in others if not store.check([f"arrive/{j}"])]
            if not missing:
                return
            self._given_up(store, epoch, others)
            now = time.monotonic()
            if now >= next_live:
                next_live = now + 0.25
                self.check_alive(missing)
                if now - t0 > self.timeout_s:
                    raise TransferError(f"the data channel (epoch {epoch}): rank {missing[0]} did not come to "
                                        f"connect it within {self.timeout_s:.0f} s")
            time.sleep(0.002 if now - t0 < 0.1 else 0.02)

    def _given_up(self, store, epoch: int, others) -> None:
        """Raise when another member gave this channel up (it said why in the store)."""
        from ..errors import IntrusionError

        for j in others:
            if store.check([f"broken/{j}"]):
                why = _text(store.get(f"broken/{j}"))
                cls = IntrusionError if why.startswith("IntrusionError") else TransferError
                raise cls(f"the data channel (epoch {epoch}): rank {j} gave it up ({why[:600]})"
                          + ("; no weights were sent over it, and the next update opens a new data channel"
                             if cls is IntrusionError else "; recreate the group"))

    def _construct(self, store, epoch: int, others, guard):
        """The backend of ``epoch``, constructed on a thread of its own: this one watches the
        other members' liveness and a member that gives up, and never waits past what it said.  Every member arrived first, so the backend's own
        connect needs at most :data:`CONNECT_S` seconds (its timeout); the collectives carry the
        group's timeout themselves."""
        from ..errors import IntrusionError

        res: dict = {}
        connect_s = min(self.timeout_s, CONNECT_S) if guard is not None else self.timeout_s
        args = (store, self.rank, self.world_size, datetime.timedelta(seconds=connect_s), self.device_index)

        def build():
            try:
                res["pg"] = self._collective.create_backend(*args, host=self.host)
            except BaseException as e:  # noqa: BLE001
                res["error"] = e
            if res.get("abandoned") and "pg" in res:
                _retire(res.pop("pg"))

        t = threading.Thread(target=build, daemon=True, name=f"unisleep-transfer-pg{epoch}-connect")
        t0 = time.monotonic()
        t.start()
        next_live = t0 + 0.25
        try:
            while t.is_alive():
                t.join(0.005)
                now = time.monotonic()
                if now >= next_live:
                    next_live = now + 0.25
                    self.check_alive(others)
                    self._given_up(store, epoch, others)
                    if now - t0 > connect_s + 5:
                        raise TransferError(f"the data channel (epoch {epoch}) did not connect within "
                                            f"{connect_s:.0f} s")
        except BaseException:
            res["abandoned"] = True
            if "pg" in res:
                _retire(res.pop("pg"))
            raise
        if "error" in res:
            e = res.pop("error")
            if guard is not None and guard.strangers():
                raise IntrusionError(self._hijacked(epoch, others, guard.ports, "could not be made",
                                                    guard.strangers())) from None
            self.broken = f"the data channel (epoch {epoch}) could not connect: {type(e).__name__}: {e}"
            raise TransferError(f"{self.broken}; recreate the group") from None
        return res.pop("pg")

    def _prove_pairs(self, pg, epoch: int, store, ports, guard=None, pending: Optional[list] = None) -> None:
        """Before a byte of weights moves over a new data channel, each end of every pair of it
        proves the group secret to the other, over that very connection (an HMAC of the group, the
        epoch and the direction).  A backend that connects whoever first sends the number it
        expects (gloo) can have handed a pair to a process outside the group: then the proof never
        arrives though both members are up (or a wrong one does), and :class:`IntrusionError` names
        it within :data:`PROOF_S` seconds — the weights never went there."""
        import hashlib
        import hmac

        import torch

        from ..errors import IntrusionError

        key = self.subkey("data channel proof")

        def tag(i: int, j: int) -> bytes:
            return hmac.new(key, f"{self.group_id}/pg{epoch}/{i}->{j}".encode(), hashlib.sha256).digest()

        import torch.distributed as dist

        n = self.world_size
        others = [p.rank for p in self.peers if p.rank != self.rank]
        # an all-to-all: every rank sends to every other over their pair, both ways (the pairs the
        # broadcasts of the buckets use)
        inp = torch.frombuffer(bytearray(b"".join(tag(self.rank, j) if j != self.rank else bytes(32)
                                                  for j in range(n))), dtype=torch.uint8)
        out = torch.zeros(32 * n, dtype=torch.uint8)
        store.set(f"ready/{self.rank}", b"1")
        opts = dist.AllToAllOptions()
        opts.timeout = datetime.timedelta(seconds=min(self.timeout_s, PROOF_OP_S))  # gloo's own threads give up
        w = pg.alltoall_base(out, inp, [], [], opts)
        if pending is not None:
            pending.append(w)  # a backend given up is destroyed only once gloo's threads are done with it

        def refused():
            return guard.strangers() if guard is not None else []

        t0 = time.monotonic()
        up: dict[int, float] = {}
        next_live = t0 + 0.5
        delay = 0.0002
        while not w.is_completed():
            now = time.monotonic()
            for j in others:
                if j not in up and store.check([f"ready/{j}"]):
                    up[j] = now
            if len(up) == len(others) and now - max(up.values()) > PROOF_S:
                raise IntrusionError(self._hijacked(epoch, others, ports, f"sent no proof of the group secret within "
                                                                          f"{PROOF_S:.0f} s though every member is up",
                                                    refused()))
            if now >= next_live:
                next_live = now + 0.5
                self.check_alive(others)
                self._given_up(store, epoch, others)  # that member gave this channel up: no proof will come
                late = [j for j in others if j not in up]
                if late and now - t0 > PROOF_S and refused():
                    # this rank's pairs are made, one of them by a stranger (its listener took a
                    # connection from another uid), and a member is still connecting: the stranger
                    # holds that member's pair, whose own connection now finds the listener sealed
                    raise IntrusionError(self._hijacked(epoch, late, ports, f"did not come up within {PROOF_S:.0f} s "
                                                                            "of this rank's, which took a connection "
                                                                            "from outside the group", refused()))
                if now - t0 > self.timeout_s:
                    raise TransferError(f"the data channel (epoch {epoch}) did not prove itself within "
                                        f"{self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - a member that died is named first
            self.check_alive(others)
            raise IntrusionError(self._hijacked(epoch, others, ports, f"failed during their proof ({type(e).__name__}: "
                                                                      f"{str(e)[:200]})", refused())) from None
        got = bytes(out.numpy())
        wrong = [j for j in others if not hmac.compare_digest(got[32 * j: 32 * j + 32], tag(j, self.rank))]
        if wrong:
            raise IntrusionError(self._hijacked(epoch, wrong, ports, "answered with a wrong proof of the group secret",
                                                refused()))

    def _hijacked(self, epoch: int, ranks, ports, what: str, refused=()) -> str:
        foreign = list(dict.fromkeys([*self._foreign(ports), *refused]))
        who = ", ".join(f"rank {j}" for j in ranks)
        return (f"the data channel (epoch {epoch}): the connections to {who} {what}: a process outside the group "
                f"holds one" + (f" ({'; '.join(foreign)})" if foreign else
                                " (not on this machine, or gone: no connection to it from another user is listed here)")
                + "; no weights were sent over it, and the next update opens a new data channel")

    def _foreign(self, ports) -> list:
        if not ports:
            return []
        try:
            return foreign_connections(ports, {p.uid for p in self.peers})
        except OSError:
            return []

    def _name_foreign(self, ports, epoch: int) -> None:
        """Connections of another user to this data channel's listening ports that gloo keeps
        waiting (they sent a number no pair expects): named, though the channel proved itself."""
        for f in self._foreign(ports):
            self._intrusion(f"a connection to this rank's data channel (epoch {epoch}) that is not a member: {f}")

    def channel_broke(self, why: str) -> None:
        """The data channel may be out of step (an update broke off mid-stream): the sender moves
        to the next epoch with its next update."""
        if self.rank == 0:
            self.epoch += 1
            log.info("transfer group %s: data channel reset to epoch %d (%s)", self.group_id.split("/")[0], self.epoch, why)


_SEALED: list = []


def _sealed_store_class():
    """A store for the collective's own bootstrap (addresses, unique ids): every value it writes
    carries an HMAC-SHA256 tag under the group secret, and a value read back without a valid tag
    (planted to point a member at someone else's socket) is logged as an intrusion and waited
    past until the genuine one is there."""
    if _SEALED:
        return _SEALED[0]
    import hashlib
    import hmac

    import torch.distributed as dist

    class SealedStore(dist.Store):
        def __init__(self, inner, group: "TransferGroup", prefix: str):
            super().__init__()
            self._inner, self._group, self._prefix = inner, group, prefix
            self._key = group.subkey("collective bootstrap")
            self.published: list = []  # what this rank wrote (its own addresses: .listener_guard)
            self.on_set = None  # told of each value this rank wrote, before the store has it

        def _tag(self, k: str, v: bytes) -> bytes:
            ctx = f"{self._group.group_id}/{self._prefix}/{k}".encode()
            return hmac.new(self._key, ctx + b"\0" + v, hashlib.sha256).digest()

        def set(self, key, value):
            v = value.encode() if isinstance(value, str) else bytes(value)
            if len(self.published) < 64:
                self.published.append(v)
                if self.on_set is not None:
                    self.on_set(v)
            self._inner.set(key, self._tag(key, v) + v)

        def get(self, key):
            deadline = time.monotonic() + self._group.timeout_s
            while True:
                raw = bytes(self._inner.get(key))
                tag, v = raw[:32], raw[32:]
                if len(raw) >= 32 and hmac.compare_digest(tag, self._tag(key, v)):
                    return v
                self._group._intrusion(f"the collective's bootstrap record {self._prefix}/{key} fails authentication "
                                       "(planted by a process without the group secret)")
                if time.monotonic() > deadline:
                    raise TransferError(f"the collective's bootstrap record {key} never authenticated")
                time.sleep(0.01)

        def wait(self, keys, timeout=None):
            return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

        def add(self, key, amount):
            return self._inner.add(key, amount)

        def check(self, keys):
            return self._inner.check(keys)

        def delete_key(self, key):
            return self._inner.delete_key(key)

        def num_keys(self):
            return self._inner.num_keys()

        def set_timeout(self, timeout):
            return self._inner.set_timeout(timeout)

    _SEALED.append(SealedStore)
    return SealedStore


_RETIRED: "queue.SimpleQueue" = queue.SimpleQueue()
_REAPER: list = []
_REAPER_LOCK = threading.Lock()
#: the longest a retired backend waits for its pending work before it is destroyed all the same
#: (gloo's own timeout of that work, :data:`PROOF_OP_S` or the group's, ends it before)
RETIRE_WAIT_S = 600.0


def _retire(pg, works=()) -> None:
    """Shut a backend down and let it go on a thread of its own, never the caller's, once gloo's
    threads are done with ``works`` (its work still in flight: the proof's all-to-all on a pair a
    process outside the group holds ends only at its own timeout).  Destroying it earlier would
    join those threads while holding the interpreter lock, freezing every thread of the process
    (tried on 2026-12-03 with torch 2.13.0: the callers froze up to 11 s after the intrusion)."""
    _RETIRED.put((time.monotonic() + RETIRE_WAIT_S, pg, list(works)))
    with _REAPER_LOCK:
        if not _REAPER:
            t = threading.Thread(target=_reap, daemon=True, name="unisleep-transfer-pg-reaper")
            _REAPER.append(t)
            t.start()


def _done(works) -> bool:
    try:
        return all(w.is_completed() for w in works)
    except Exception:  # noqa: BLE001 - a work that cannot say is done with
        return True


def _reap() -> None:
    waiting: list = []  # (deadline, backend, works)
    while True:
        try:
            waiting.append(_RETIRED.get(timeout=0.05) if waiting else _RETIRED.get())
        except queue.Empty:
            pass
        now = time.monotonic()
        keep = []
        for item in waiting:
            if now < item[0] and not _done(item[2]):
                keep.append(item)
                continue
            pg = item[1]
            item = None
            _quiet(pg.shutdown)
            del pg  # the destructor runs here
        waiting = keep


def _text(v) -> str:
    try:
        return bytes(v).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001
        return "?"


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


def wait_work(group: "TransferGroup", work) -> None:
    """Wait for a collective's work object, checking the other ranks' liveness meanwhile: a dead
    peer ends the wait within a few seconds (and names the peer) instead of the group timeout."""
    if not hasattr(work, "is_completed"):
        work.wait()
        return
    delay, t0, next_live = 0.0002, time.monotonic(), time.monotonic() + 0.5
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_live:
            next_live = now + 0.5
            group.check_alive([p.rank for p in group.peers if p.rank != group.rank])
            if now - t0 > group.timeout_s:
                raise TransferError(f"a collective did not complete within {group.timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.001)
    work.wait()


# ---------------------------------------------------------------------------- the sender's end
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
        self.opts.timeout = datetime.timedelta(seconds=sender.group.timeout_s)  # the backend's own is its connect's
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
        return self.s._host_buffer(slot, nbytes)

    def begin(self, plan: BucketPlan, buf) -> Optional["_Sealer"]:
        """Host memory: the bucket's descriptor goes out now, and each piece of it as soon as it is
        packed (and, with a cipher, encrypted from where the tensors are straight into ``buf``:
        one pass over the bytes) — :class:`_Sealer`.  Device memory: None (packed, then sent)."""
        if buf.device.type != "cpu":
            return None
        d = self._desc(plan.index, plan.total_bytes, PIECED | (CIPHERED if self.cipher is not None else 0))
        self._open = _Sealer(self, plan, buf, [self._bcast(d), d, buf])
        return self._open

    def post(self, slot: int, plan: BucketPlan, buf) -> None:
        n = plan.total_bytes
        if self._open is None:
            d = self._desc(plan.index, n, 0)
            self.pending[slot] = [self._bcast(d), self._bcast(buf[:n]), d, buf]
            return
        sealer, self._open = self._open, None
        assert sealer is not None and sealer.plan is plan, "an encrypted bucket is posted after it was packed"
        self.pending[slot] = sealer.works

    def end(self, abort: bool, why: str = "") -> None:
        """The update's end (``abort``: broken off; the reason is in the store)."""
        if self._open is not None:  # a bucket broke off while packed: send the rest, unsealed (its tag fails)
            sealer, self._open = self._open, None
            sealer.abandon()
            self.pending[sealer.plan.index % 2] = sealer.works
        for slot in (0, 1):
            self._finish_pending(slot)
        wait_work(self.s.group, self._bcast(self._desc(END, 0, ABORT if abort else 0)))


class _Sealer:
    """One host bucket being packed for the collective: every piece of :data:`~.cipher.PIECE`
    bytes is broadcast as soon as it is packed, so packing overlaps the transfer even within one
    bucket.  With a cipher each tensor is encrypted from its own memory into the bucket (the
    padding between tensors is zeroed and encrypted in place), and the tag follows the last piece;
    :meth:`seal` (after the trailer was written behind the data) makes the rest final, :meth:`close`
    sends it."""

    def __init__(self, chan: CollectiveSendChannel, plan: BucketPlan, buf, works: list):
        self.chan, self.plan, self.buf, self.works = chan, plan, buf, works
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
        self._flush(final=False)

    def seal(self) -> None:
        """After the trailer was written behind the data: the rest of the bucket is final (and
        encrypted); the piece that holds the trailer has not left yet."""
        self._gap(self.plan.data_bytes)
        if self.enc is not None:
            self.enc.piece(self.mv, self.done, self.plan.total_bytes)
        self.done = self.plan.total_bytes

    def close(self) -> None:
        """After :meth:`seal`: the rest goes, then (encrypted) the tag."""
        import torch

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
            self.works.append(self.chan._bcast(self.buf[off:end]))
            self.sent += 1


# ---------------------------------------------------------------------------- the receiver's end
def receive(rx, st: "RecvState") -> None:
    """The receiver's loop: every bucket of update ``st.seq`` from the group's backend into ``st``
    (bucket k-1 is verified and applied while bucket k is in flight), until the sender's end
    descriptor."""
    import torch
    import torch.distributed as dist

    pg = rx.group.process_group()
    dev = rx.group.device
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = datetime.timedelta(seconds=rx.group.timeout_s)  # the backend's own is its connect's
    pending = None  # (bucket, buffer, its work or None, authentic or None)

    def settle(p) -> None:
        if p[2] is not None:
            wait_work(rx.group, p[2])
        st.take(p[0], p[1], authentic=p[3])

    while True:
        d = torch.empty(4, dtype=torch.int64, device=dev)
        wait_work(rx.group, pg.broadcast([d], opts))
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
        if rx.staged:
            full = torch.empty(nbytes + SLACK, dtype=torch.uint8, device=dev)
        else:
            slot = k % 2
            full = rx._rot[slot]
            if full is None or full.numel() < nbytes + SLACK:
                full = rx._rot[slot] = torch.empty(nbytes + SLACK, dtype=torch.uint8, device=dev)
        rx._buffer_s += time.perf_counter() - tb
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
                wait_work(rx.group, w)
            continue
        tag = torch.empty(16, dtype=torch.uint8)
        wt = pg.broadcast([tag], opts)
        if pending is not None:
            settle(pending)
        dec = st.cipher.decryptor(k, nbytes)
        mv = writable_view(full)
        for off, end, w in works:
            wait_work(rx.group, w)
            dec.piece(mv, off, end)
        wait_work(rx.group, wt)
        pending = (k, buf, None, dec.check(bytes(tag.numpy())))
