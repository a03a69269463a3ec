"""A transfer group's data channel: the platform's process-group backend of the current epoch,
bootstrapped through a store whose values carry an HMAC under the group secret, and — for a
backend that connects whoever first sends the number it expects — each pair's proof of the
group secret before a byte of weights moves.  :class:`_DataChannel` is a base class of
:class:`~unisleep.transfer.group.TransferGroup` and uses its state (secret, peers, store,
liveness)."""

from __future__ import annotations

import datetime
import logging
import threading
import time

from ..errors import TransferError, UnsupportedError

log = logging.getLogger("unisleep.transfer")

#: once both ends of a data-channel pair are up, the proof that it is theirs arrives within this
PROOF_S = 5.0


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
        from .netinfo import listening_ports

        old, self._pg = self._pg, None
        if old is not None:
            _shutdown(old)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = _sealed_store_class()(self.store.prefixed(f"pg{epoch}"), self, f"pg{epoch}")
        proof = getattr(self._collective, "PAIR_PROOF", False)
        before = listening_ports() if proof else set()
        try:
            pg = self._collective.create_backend(store, self.rank, self.world_size, timeout, self.device_index,
                                                 host=self.host)
        except Exception as e:
            self.broken = f"the data channel (epoch {epoch}) could not connect: {type(e).__name__}: {e}"
            raise TransferError(f"{self.broken}; recreate the group") from e
        # the backend holds only the C++ side of this Python store: without a Python reference
        # it is collected, and a backend that bootstraps later (on its first collective)
        # finds no ``get`` to call ("Not implemented")
        self._pg_store = store
        if proof:
            ports = {p for _ip, p in listening_ports() - before}
            try:
                self._prove_pairs(pg, epoch, store, ports)
            except IntrusionError as e:
                self._intrusion(str(e))
                _shutdown(pg)
                self.channel_broke(f"the data channel of epoch {epoch} was not the group's")
                raise
            except BaseException:
                _shutdown(pg)
                raise
            self._name_foreign(ports, epoch)
        self._pg = pg
        self._pg_epoch = epoch

    def _prove_pairs(self, pg, epoch: int, store, ports) -> None:
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
        w = pg.alltoall_base(out, inp, [], [], dist.AllToAllOptions())
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
                                                                          f"{PROOF_S:.0f} s though every member is up"))
            if now >= next_live:
                next_live = now + 0.5
                self.check_alive(others)
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
                                                                      f"{str(e)[:200]})")) from None
        got = bytes(out.numpy())
        wrong = [j for j in others if not hmac.compare_digest(got[32 * j: 32 * j + 32], tag(j, self.rank))]
        if wrong:
            raise IntrusionError(self._hijacked(epoch, wrong, ports, "answered with a wrong proof of the group secret"))

    def _hijacked(self, epoch: int, ranks, ports, what: str) -> str:
        foreign = self._foreign(ports)
        who = ", ".join(f"rank {j}" for j in ranks)
        return (f"the data channel (epoch {epoch}): the connections to {who} {what}: a process outside the group "
                f"holds one" + (f" ({'; '.join(foreign)})" if foreign else
                                " (not on this machine, or gone: no connection to it from another user is listed here)")
                + "; no weights were sent over it, and the next update opens a new data channel")

    def _foreign(self, ports) -> list:
        from .netinfo import foreign_connections

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

        def _tag(self, k: str, v: bytes) -> bytes:
            ctx = f"{self._group.group_id}/{self._prefix}/{k}".encode()
            return hmac.new(self._key, ctx + b"\0" + v, hashlib.sha256).digest()

        def set(self, key, value):
            v = value.encode() if isinstance(value, str) else bytes(value)
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


def _shutdown(pg) -> None:
    """Shut a backend down without waiting on work that can never finish (a pair a process
    outside the group holds)."""
    t = threading.Thread(target=lambda: _quiet(pg.shutdown), daemon=True, name="unisleep-transfer-pg-shutdown")
    t.start()
    t.join(2.0)


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass
