"""``TransferGroup``: a private trainer↔engine group from a rendezvous address.

It has its own store (:mod:`.store`, served by rank 0, the sender) and the platform's
process-group backend constructed directly on it, so the default process group of either side
(the trainer's data-parallel group, the engine's tensor-parallel group) is never created or
touched.  The store carries the update's header (and, on the collective path, its other control
records: acknowledgements, go, done), the heartbeats and the backend's bootstrap values; the bytes
go over the backend or a Unix socket.

Security (see docs/security.md): rank 0 opens the listening socket itself, bound to exactly the
address of the rendezvous (a loopback rendezvous listens on loopback only).  Only members use the
store: a connection proves the group secret before it may read or write anything, and every
frame after is authenticated; the store bounds its connections, keys and values.  Every control
record is JSON with a schema, authenticated with HMAC-SHA256 under the group secret over its key,
update number and epoch (:mod:`.records`); nothing read from the store is unpickled.  What is
refused (a record that fails authentication, a connection that cannot prove the secret) is logged
as an intrusion (``intrusions``).  Each member beats a heartbeat into the store; a waiting side
notices a dead peer within a few seconds and names it.  The data channel (the process-group
backend) has an epoch: after an update broke off mid-stream the sender moves to a fresh backend
(epoch + 1) and every receiver follows when it reads the next header.

The vendor part (which backend class, how a device is identified) is the platform's collective
module, named by its backend descriptor (:class:`unisleep.backend.Backend`).

Liveness: each member beats a heartbeat (a counter) into the group's store; a waiting side notices
a dead or frozen peer within :data:`DEAD_AFTER_S` seconds of its last beat (at once when it is a
process of this machine that exited) and names it.  How long a heartbeat has been silent is the
store's answer (its clock, the time of the key's last change), not this side's memory of when it
last looked: a side that was busy elsewhere (a trainer's generator, a send the kernel's buffers
took) and looks again knows at once.

This module: the rendezvous (the address, rank 0's listening socket), who the members are
(:class:`Peer`), creating the group, the control records, liveness, intrusions, closing.  The data
channel (the backend of each epoch, its sealed bootstrap, the pairs' proofs) is the collective
path's, in :mod:`.collective`.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets as _secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from ..addresses import is_loopback
from ..errors import InvalidArgumentError, TransferError, UnsupportedError
from ..platform import Platform, detect_platform
from . import records as R
from .collective import _DataChannel
from .netinfo import _boot_id, _netns, _pidns
from .secret import resolve_secret
from .store import LocalStore, RecordTooLargeError, RemoteStore, StoreAuthError, StoreServer
from .waiting import WaitNotice

log = logging.getLogger("unisleep.transfer")

DEFAULT_TIMEOUT_S = 300.0
HEARTBEAT_S = 0.5
#: a peer whose heartbeat did not move for this long is dead
DEAD_AFTER_S = 4.0
#: entries kept in ``TransferGroup.intrusions`` (the last one then counts the rest)
MAX_INTRUSIONS = 256


def parse_rendezvous(rendezvous: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port)."""
    u = urlparse(rendezvous if "://" in rendezvous else f"tcp://{rendezvous}")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or not port:
        raise InvalidArgumentError(f"rendezvous must look like tcp://HOST:PORT, got {rendezvous!r}")
    return u.hostname, int(port)


def store_address(host: str, port: int) -> tuple[str, int]:
    """The one address of the group's store for the rendezvous ``host:port``, resolved the same
    way on every member: rank 0 listens there and every other member connects there, never to
    another address the name also has (another user may listen there and relay: ``localhost`` is
    ``::1`` too where ``/etc/hosts`` says so, as Debian and Ubuntu ship).  ``localhost`` is
    127.0.0.1; a literal address is itself; a name is its first address from the resolver, and a
    name with several loopback addresses is refused (:class:`InvalidArgumentError`, before
    anything is created).  A name the resolver does not know (yet) is returned as it is."""
    import ipaddress

    h = host.strip("[]")
    if h.lower() == "localhost":
        return "127.0.0.1", port
    try:
        return str(ipaddress.ip_address(h)), port
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, port, type=socket.SOCK_STREAM)
    except OSError:
        return h, port
    ips = list(dict.fromkeys(str(a[0]).split("%", 1)[0] for *_x, a in infos))
    loop = [ip for ip in ips if ipaddress.ip_address(ip).is_loopback]
    if len(loop) > 1:
        raise InvalidArgumentError(f"the rendezvous name {h!r} resolves to {len(loop)} loopback addresses "
                                   f"({', '.join(loop)}): a member could connect to one the group's rank 0 does not "
                                   f"listen on, where another user can listen; use tcp://{loop[-1]}:{port} or "
                                   f"tcp://127.0.0.1:{port}")
    return ips[0], port


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host:port`` (not on every interface): the address
    :func:`store_address` gives, where every member connects."""
    ip, port = store_address(host, port)
    infos = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)[:1]
    err: Optional[OSError] = None
    for family, kind, proto, _name, addr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(128)
            s.set_inheritable(False)
            return s
        except OSError as e:
            s.close()
            err = e
    raise OSError(getattr(err, "errno", None), f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}")


@dataclass(frozen=True)
class Peer:
    rank: int
    device_key: str
    host: str
    pid: int
    uid: int = -1
    pidns: int = 0
    boot: str = ""
    netns: int = 0

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"
def _peer_of(body: dict) -> Peer:
    return Peer(body["rank"], body["device_key"], body["host"], body["pid"], body["uid"], body["pidns"], body["boot"],
                body["netns"])


def _same_device_ranks(peers: list[Peer]) -> set[int]:
    seen: dict[str, list[int]] = {}
    for p in peers:
        seen.setdefault(p.device_key, []).append(p.rank)
    return {r for ranks in seen.values() if len(ranks) > 1 for r in ranks}


class TransferGroup(_DataChannel):
    """A weight-transfer group: rank 0 sends, ranks 1..world_size-1 receive.

    Create it on every member at about the same time (it is a rendezvous)::

        group = TransferGroup.create("tcp://10.0.0.1:29555", rank=0, world_size=2)   # trainer
        group = TransferGroup.create("tcp://10.0.0.1:29555", rank=1, world_size=2)   # engine

    Attributes: ``rank``, ``world_size``, ``platform``, ``backend`` (torch backend name),
    ``device`` (torch device of the buckets), ``peers`` (device identity of each rank),
    ``colocated`` (every receiver shares the sender's device, so IPC can be used),
    ``timeout_s``, ``epoch`` (generation of the data channel), ``intrusions`` (what was
    refused: forged records, foreign connections).
    """

    def __init__(self, *, store, rank: int, world_size: int, platform: Platform, device_index: int,
                 timeout_s: float, peers: list[Peer], host: str, port: int, server=None,
                 secret: bytes, group_id: str, insecure: bool, hb_store=None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.platform = platform
        self.device_index = device_index
        self.timeout_s = timeout_s
        self.peers = peers
        self.host, self.port = host, port
        self._server = server  # rank 0: the group's store (docs/security.md)
        self._collective = platform.backend.collective_module()
        self.closed = False
        self.insecure = insecure
        self.group_id = group_id
        self._secret = secret
        self._rec_key = R.derive_key(secret, "records")
        self.intrusions: list[str] = []
        self._intrusions_more = 0
        self.epoch = 0
        self._pg = None
        self._pg_store = None  # the Python store under _pg, kept alive with it
        self._pg_epoch = -1
        self._pg_error: Optional[str] = None
        self.broken: Optional[str] = None  # why this group must be recreated
        self._seq = 0  # sender: number of the next update
        self.last_seq = -1  # receiver: the last update whose header it took
        self._seen: dict[str, int] = {}  # key -> the store's version of the record last taken there (take(resume=True))
        # liveness
        self._hb_store = hb_store
        self._hb_stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._secret_path: Optional[str] = None
        self.heartbeat_error: Optional[str] = None  # the last failure of this member's heartbeat, if any

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, rendezvous: str, rank: int, world_size: int, *, platform=None,
               timeout_s: float = DEFAULT_TIMEOUT_S, device: Optional[int] = None,
               name: str = "default", secret=None, secret_file: Optional[str] = None,
               insecure: bool = False) -> "TransferGroup":
        """Join the group at ``rendezvous`` (``tcp://HOST:PORT``; rank 0 hosts the store there,
        listening on that address only).

        ``platform``: ``None`` (detect), a name or a :class:`Platform` — decides the backend
        (host: gloo; accelerators: the vendor's collective).  ``device``: this rank's device index
        (default: the current one).  ``name`` separates several groups on one store address.
        ``secret`` / ``secret_file``: the group secret (see :mod:`unisleep.transfer.secret`; a
        loopback group of one user needs none); ``insecure=True`` lets a non-loopback group run
        without one.  Multi-node is the same call with a routable address (docs/security.md).
        """
        _check_create_args(rank, world_size, timeout_s, name, device, insecure)
        plat = platform if isinstance(platform, Platform) else detect_platform(platform)
        host, port = parse_rendezvous(rendezvous)
        loopback = is_loopback(host)
        ip, _ = store_address(host, port)  # the store's one address, as rank 0 binds it (refused here when ambiguous)
        stale = _stale_loopback_secret(port, name) if rank == 0 and loopback else None
        # a rank 0 that writes the loopback secret file binds first: one that cannot bind writes none;
        # every other source of the secret is resolved (and refused) before anything is bound
        from .secret import ENV_SECRET, ENV_SECRET_FILE

        writes = rank == 0 and loopback and secret is None and not secret_file and \
            not os.environ.get(ENV_SECRET) and not os.environ.get(ENV_SECRET_FILE)

        def resolve():
            return resolve_secret(secret=secret, secret_file=secret_file, rank=rank, loopback=loopback,
                                  insecure=insecure, port=port, name=name, timeout_s=timeout_s)

        if not writes:
            key, source = resolve()
        listener = None
        if rank == 0:
            try:
                listener = listen_socket(host, port)
            except OSError as e:
                from .netinfo import port_holder

                holder = port_holder(ip, port) if e.errno == errno.EADDRINUSE else ""
                raise TransferError(f"cannot open the group's store at {host}:{port} (rank 0/{world_size}): {e}"
                                    + (f"; the port is held by {holder}: stop it or choose another port"
                                       if holder else "")) from e
        if writes:
            try:
                key, source = resolve()
            except BaseException:
                listener.close()
                raise
        if source == "insecure":
            log.warning("transfer group %s on %s:%d runs WITHOUT a secret (insecure=True): anyone who can reach "
                        "that address can feed this group weights", name, host, port)
        server = None
        try:
            if rank == 0:
                server = StoreServer(listener, R.derive_key(key, "store"), world_size,
                                     stale_key=R.derive_key(stale, "store") if source == "loopback file" and stale
                                     and stale != key else None)
                store, hb_store = LocalStore(server, timeout_s), LocalStore(server, timeout_s)
            else:
                key, store = _connect_store(ip, port, key, rank, timeout_s, source, name)
                hb_store = RemoteStore.connect(ip, port, R.derive_key(key, "store"), rank, timeout_s)
        except StoreAuthError as e:
            raise TransferError(f"rank {rank}/{world_size}: {e}") from None
        except TransferError:
            if server is not None:
                server.close()
            raise
        except Exception as e:
            if server is not None:
                server.close()
            raise TransferError(f"cannot reach the group's store at {host}:{port} (rank {rank}/{world_size}): {e}") \
                from e
        coll = plat.backend.collective_module()
        if device is None:
            device = 0
            if plat.is_accelerator:
                import torch

                device = torch.accelerator.current_device_index()
        me = Peer(rank, coll.device_key(device), socket.gethostname(), os.getpid(), os.getuid(), _pidns(), _boot_id(),
                  _netns())
        grp = cls(store=store, rank=rank, world_size=world_size, platform=plat, device_index=device,
                  timeout_s=timeout_s, peers=[], host=host, port=port, server=server, secret=key,
                  group_id=f"{name}/", insecure=source == "insecure", hb_store=hb_store)
        if server is not None:
            server.on_intrusion = grp._intrusion
        if rank == 0 and source == "loopback file":
            from .secret import loopback_secret_path

            grp._secret_path = loopback_secret_path(port, name)  # removed when the group closes
        try:
            grp._join(me, source, secret_file, name)
        except BaseException:
            grp.close()
            raise
        return grp

    def _join(self, me: Peer, source: str, secret_file, name: str) -> None:
        nonce = _secrets.token_hex(16) if self.rank == 0 else ""
        p0 = None
        if self.rank == 0:
            self.group_id = f"{name}/{nonce}"
            self._put_peer(me, nonce)
        else:
            # rank 0's record carries the group nonce; a stale loopback secret file is re-read
            raw0 = self._wait_raw("peer/0", "rank 0 (the sender) to join")
            deadline = time.monotonic() + self.timeout_s
            while p0 is None:
                try:
                    p0 = self._open_peer(raw0, 0)
                except R.ForgedRecordError as e:
                    if time.monotonic() > deadline:
                        raise TransferError(f"rank 0's record never authenticated: {e}") from None
                    if source == "loopback file":
                        from .secret import loopback_secret_path, read_secret_file

                        self._set_secret(read_secret_file(loopback_secret_path(self.port, name)))
                    else:
                        self._intrusion(str(e))
                    time.sleep(0.05)
                    raw0 = self.store.fetch("peer/0", 1 << 17) or raw0
            nonce = p0[1]
            self.group_id = f"{name}/{nonce}"
            self._put_peer(me, "")
        peers = []
        for r in range(self.world_size):
            if r == self.rank:
                peers.append(me)
                continue
            if r == 0:
                peers.append(p0[0])
                continue
            body = self.take(f"peer/{r}", R.PEER, seq=0, epoch=0, what=f"rank {r} to join the group",
                             peer=f"rank {r}", watch=False,
                             notice=WaitNotice(f"transfer group {name!r} at {self.host}:{self.port}: rank {self.rank} "
                                               f"is waiting for rank {r} of {self.world_size} to join (a process "
                                               f"calling TransferGroup.create with rank={r})", self.timeout_s))
            peers.append(_peer_of(body))
            if body["insecure"] != self.insecure:
                raise TransferError(f"rank {r} runs {'without' if body['insecure'] else 'with'} a secret, this rank "
                                    f"{'without' if self.insecure else 'with'}: give both the same secret")
        self.peers = peers
        self._shared = _same_device_ranks(peers)
        self._start_heartbeat()
        if self._shared and not self._collective.SAME_DEVICE_OK:
            log.info("ranks %s share a device: no collective backend, colocated IPC only", sorted(self._shared))
        elif not getattr(self._collective, "PAIR_PROOF", False):
            self._connect_pg(0)  # (a backend whose pairs must prove themselves connects when first used)

    def _set_secret(self, secret: bytes) -> None:
        self._secret = secret
        self._rec_key = R.derive_key(secret, "records")

    def _put_peer(self, me: Peer, nonce: str) -> None:
        body = {"rank": me.rank, "device_key": me.device_key[:4096], "host": me.host[:4096], "boot": me.boot[:4096],
                "pid": me.pid, "pidns": me.pidns, "netns": me.netns, "uid": me.uid, "nonce": nonce or "0",
                "insecure": self.insecure}
        gid = self.group_id if me.rank else "peer0"  # rank 0's record brings the group nonce
        self.store.set(f"peer/{me.rank}", R.seal(self._rec_key, gid, f"peer/{me.rank}", 0, 0, body))

    def _open_peer(self, raw: bytes, r: int) -> tuple[Peer, str]:
        _, _, body = R.open_record(self._rec_key, "peer0", raw, name="peer/0", peer="rank 0", schema=R.PEER, seq=0,
                                   epoch=0, limit=1 << 16)
        return _peer_of(body), body["nonce"]

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> str:
        return self._collective.BACKEND

    @property
    def device(self):
        import torch

        return torch.device(self.platform.torch_device(self.device_index))

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @property
    def receivers(self) -> list[int]:
        return list(range(1, self.world_size))

    @property
    def colocated(self) -> bool:
        """Every receiver is on the sender's device (same GPU; on host: same machine)."""
        return all(p.device_key == self.peers[0].device_key for p in self.peers)

    @property
    def local(self) -> bool:
        """Every member runs on this machine (same boot) in this network namespace: they can reach
        each other's Unix sockets."""
        me = self.peers[self.rank]
        return all(p.boot == me.boot and p.netns == me.netns and p.host == me.host for p in self.peers)

    @property
    def ipc_available(self) -> bool:
        return self.colocated and self.platform.backend.ipc is not None

    def ipc_module(self):
        if self.platform.backend.ipc is None:
            raise UnsupportedError(
                f"colocated IPC is not implemented on the {self.platform.name} platform; "
                "use path='collective' with the engine on another device"
            )
        return self.platform.backend.ipc_module()

    def subkey(self, purpose: str) -> bytes:
        """A key derived from the group secret for ``purpose`` (never the secret itself)."""
        return R.derive_key(self._secret, purpose)

    def hash_key(self, seq: int, epoch: int, nbytes: Optional[int] = None):
        """The keyed-digest key of update ``seq`` (the same on every member), derived from a
        sub-key of the group secret and the update's context (group, epoch, update number);
        ``nbytes``: the update's largest tensor (only the key levels it needs are derived;
        every member passes the same), None: every level."""
        from ..keyed_hash import HashKey

        return HashKey.derive(self.subkey("digest"), f"{self.group_id}/{epoch}/{seq}".encode(), nbytes)
    # ------------------------------------------------------------------ control plane
    def _intrusion(self, msg: str) -> None:
        """Record (and log) something refused; at most :data:`MAX_INTRUSIONS` entries are kept, the
        last one then counts the rest (a flood cannot grow this list or the log without bound)."""
        with self._lock:
            if msg in self.intrusions[-8:]:
                return
            if len(self.intrusions) >= MAX_INTRUSIONS:
                self._intrusions_more += 1
                self.intrusions[-1] = (f"... and {self._intrusions_more} more refused since (the latest: {msg[:300]}); "
                                       "see the unisleep.transfer log")
                if self._intrusions_more % 1000:
                    return
            else:
                self.intrusions.append(msg)
        log.warning("transfer group %s (rank %d): intrusion refused: %s", self.group_id.split("/")[0], self.rank, msg)

    def put(self, key: str, body: dict, seq: int, epoch: int) -> None:
        try:
            self.store.set(key, R.seal(self._rec_key, self.group_id, key, seq, epoch, body))
        except TransferError:
            raise
        except Exception as e:
            self.broken = "the connection to the group's store is lost (its host, rank 0, may have died)"
            raise TransferError(f"lost the connection to the transfer store writing {key} "
                                f"(its host, rank 0, may have died): {e}; recreate the group") from e

    def _wait_raw(self, key: str, what: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        notice = WaitNotice(f"transfer group at {self.host}:{self.port}: rank {self.rank} is waiting for {what}",
                            self.timeout_s)
        while True:
            notice.tick()
            try:
                _ver, raw = self.store.watch(key, 1 << 17, 0, min(0.25, max(0.0, deadline - time.monotonic())))
            except RecordTooLargeError as e:
                raise TransferError(f"waiting for {what}: {e}") from None
            except Exception as e:
                raise TransferError(f"lost the connection to the transfer store waiting for {what}: {e}") from e
            if raw is not None:
                return raw
            if time.monotonic() > deadline:
                raise TransferError(f"waiting for {what}: timed out after {self.timeout_s:.0f} s")

    def take(self, key: str, schema: dict, *, seq: Optional[int], epoch: Optional[int], what: str = "",
             timeout_s: Optional[float] = None, peer: str = "a peer", watch=True, accept=None,
             notice=None, resume: bool = False) -> dict:
        """Wait for an authentic record at ``key`` and return its body.

        The store answers as soon as the key changes (no polling).  Records that fail
        authentication are logged as intrusions and skipped (the genuine one overwrites them).
        ``watch``: ranks whose death ends the wait at once (True: every other rank).
        ``accept(seq, epoch, body)`` may reject an authentic but stale record (return False: keep
        waiting).  ``notice``: a :class:`~.waiting.WaitNotice` told of every turn of the wait.
        ``resume``: wait only for a record written after the one the last such take
        of ``key`` returned (a key rewritten for every update: the previous record is not fetched
        and opened again)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        ranks = [p.rank for p in self.peers if p.rank != self.rank] if watch is True else list(watch or ())
        seen = self._seen.get(key, 0) if resume else 0  # the version of the last value looked at: wait for a newer one
        next_live = t0 + 0.2
        limit = R.MAX_RECORD + R.HEAD.size + R.TAG_BYTES
        while True:
            now = time.monotonic()
            if notice is not None:
                notice.tick()
            if now - t0 >= t:
                raise TransferError(f"waiting for {what or key}: timed out after {now - t0:.1f} s")
            if now >= next_live and ranks:
                next_live = now + 0.25
                self.check_alive(ranks)
            wait = max(0.0, min(next_live - now if ranks else 0.25, t - (now - t0)))
            try:
                seen, raw = self.store.watch(key, limit, seen, wait)
            except RecordTooLargeError as e:  # its size is known, its bytes were not fetched
                self._intrusion(str(e))
                time.sleep(min(0.05, wait))
                continue
            except Exception as e:
                self.broken = "the connection to the group's store is lost (its host, rank 0, may have died)"
                raise TransferError(f"waiting for {what or key}: lost the connection to the transfer store after "
                                    f"{time.monotonic() - t0:.1f} s (its host, rank 0, may have died): {e}; "
                                    "recreate the group") from e
            if raw is None:
                continue
            try:
                rs, re_, body = R.open_record(self._rec_key, self.group_id, raw, name=key, peer=peer, schema=schema,
                                              seq=seq, epoch=epoch)
                if accept is None or accept(rs, re_, body):
                    if resume:
                        self._seen[key] = seen
                    return body if accept is None else (rs, re_, body)
                if resume:  # stale for good (a header this side took on its IPC connection): not fetched again
                    self._seen[key] = seen
            except R.ForgedRecordError as e:
                self._intrusion(str(e))
            except R.MalformedRecordError as e:  # authentic: the caller answers it, unless it is stale
                if accept is None or accept(e.seq, e.epoch, None):
                    raise

    def check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception as e:
            raise TransferError(f"lost the connection to the transfer store: {e}") from e

    def drop(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # a key left behind is harmless (keys are per update and epoch); the store may be gone
            pass

    # ------------------------------------------------------------------ liveness
    def _start_heartbeat(self) -> None:
        key = f"hb/{self.rank}"
        hb = self._hb_store
        hb.add(key, 1)
        gname = self.group_id.split("/")[0]

        def beat():
            failing = False
            while not self._hb_stop.wait(HEARTBEAT_S):
                try:
                    hb.add(key, 1)
                    if failing:
                        log.warning("transfer group %s rank %d: its heartbeat beats again", gname, self.rank)
                        failing = False
                except Exception as e:  # never silently: said, then retried while the store is there
                    self.heartbeat_error = f"{type(e).__name__}: {e}"
                    if isinstance(e, (ConnectionError, OSError)):
                        log.warning("transfer group %s rank %d: the heartbeat stopped: %s", gname, self.rank, e)
                        self.broken = self.broken or f"rank {self.rank} lost the group's store: {e}"
                        return
                    if not failing:
                        log.warning("transfer group %s rank %d: a heartbeat failed (%s); retrying", gname, self.rank,
                                    self.heartbeat_error)
                        failing = True

        self._hb_thread = threading.Thread(target=beat, daemon=True, name=f"unisleep-transfer-hb-{self.rank}")
        self._hb_thread.start()

    def peer_dead(self, r: int) -> Optional[str]:
        """Why rank ``r`` is dead (None: it seems alive)."""
        p = self.peers[r] if r < len(self.peers) else None
        if p is not None and p.boot == self.peers[self.rank].boot and p.pidns == _pidns() and p.pid > 0:
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state in ("Z", "X"):
                    return f"{p.describe()} has exited"
            except FileNotFoundError:
                return f"{p.describe()} has exited"
            except (OSError, IndexError):
                pass
        try:
            got = self.store.aged(f"hb/{r}", 32)
            if got is not None:
                int(got[1].decode("ascii"))
        except (TransferError, UnicodeDecodeError, ValueError) as e:  # only a member could have written it
            self._intrusion(f"rank {r}'s heartbeat in the store is not a counter: {e}")
            return None
        except Exception as e:  # any failure to read the store is the answer: it is gone
            return f"the group's store is gone (rank 0 may have died): {e}"
        if got is not None and got[0] > DEAD_AFTER_S:
            who = p.describe() if p is not None else f"rank {r}"
            return f"{who} gave no sign of life for {got[0]:.1f} s (dead or frozen)"
        return None

    def check_alive(self, ranks) -> None:
        for r in ranks:
            why = self.peer_dead(r)
            if why:
                self.broken = why
                raise TransferError(f"{why}; recreate the group")

    def check_usable(self) -> None:
        if self.closed:
            raise TransferError("this transfer group is closed; create a new one")
        if self.broken:
            raise TransferError(f"this transfer group is broken ({self.broken}); recreate the group on every member")

    def close(self) -> None:
        """Shut the backend down, stop the heartbeat, close the store connections (rank 0: the store
        itself, so the other members' next step says the group is gone)."""
        if self.closed:
            return
        self.closed = True
        self._hb_stop.set()
        if self._secret_path is not None:
            try:
                os.unlink(self._secret_path)
            except OSError:
                pass
            self._secret_path = None
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # closing: a backend already broken by a dead peer may refuse its shutdown
                pass
        for st in (self._hb_store, self.store):
            try:
                st.close()
            except Exception:  # closing: a client whose server went first may fail to close; nothing is lost
                pass
        if self._server is not None:
            self._server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"TransferGroup(rank={self.rank}/{self.world_size}, platform={self.platform.name}, "
                f"backend={self.backend}, device={self.device}, colocated={self.colocated}, epoch={self.epoch})")


def _connect_store(host: str, port: int, key: bytes, rank: int, timeout_s: float, source: str,
                   name: str) -> tuple[bytes, "RemoteStore"]:
    """A receiver's connection to rank 0's store: (the secret it proved, the connection).  A
    loopback group's secret file may still be one of an earlier group on the same port when this
    rank reads it first: it is read again until rank 0's new one opens the store."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return key, RemoteStore.connect(host, port, R.derive_key(key, "store"), rank,
                                            max(0.1, deadline - time.monotonic()))
        except StoreAuthError:
            if source != "loopback file" or time.monotonic() > deadline:
                raise
            from .secret import loopback_secret_path, read_secret_file

            time.sleep(0.05)
            key = read_secret_file(loopback_secret_path(port, name))


def _stale_loopback_secret(port: int, name: str) -> Optional[bytes]:
    """The secret in an earlier group's loopback secret file for this port and name (a group that was
    never closed leaves it behind), or None; rank 0 replaces it, and a member that read it first is
    then refused without an intrusion alarm."""
    from .secret import loopback_secret_path, read_secret_file

    path = loopback_secret_path(port, name)
    if not os.path.exists(path):
        return None
    try:
        return read_secret_file(path)
    except InvalidArgumentError:
        return None


def _check_create_args(rank, world_size, timeout_s, name, device, insecure) -> None:
    """:class:`InvalidArgumentError` at once for an argument of :meth:`TransferGroup.create` that
    cannot be right (before any socket is opened or waited on)."""
    if not R._is_int(world_size) or world_size < 2:
        raise InvalidArgumentError(f"world_size must be an integer >= 2 (a sender and at least one receiver), "
                                   f"got {world_size!r}")
    if not R._is_int(rank) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e9:
        raise InvalidArgumentError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not isinstance(name, str) or not R.NAME.fullmatch(name):
        raise InvalidArgumentError(f"group name must be 1-128 letters, digits, '.', '_' or '-'; got {name!r}")
    if device is not None and (not R._is_int(device) or device < 0):
        raise InvalidArgumentError(f"device must be a device index >= 0 or None (the current one), got {device!r}")
    if not isinstance(insecure, bool):
        raise InvalidArgumentError(f"insecure must be True or False, got {insecure!r}")

__all__ = ["TransferGroup", "Peer", "parse_rendezvous", "DEFAULT_TIMEOUT_S"]
