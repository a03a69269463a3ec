"""``WeightSender``: the trainer's side of an update (rank 0 of the group) — header,
acknowledgements, buckets streamed double buffered, then every receiver's commit (those steps in
:mod:`.send_update`) — and :func:`default_bucket_bytes`, the bucket size the free memory allows."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Sequence

from ..errors import InvalidArgumentError, VersionError
from .group import TransferGroup
from .ipc_send import IpcSenderState
from . import records as R
from .manifest import Manifest, check_tensor, plan_buckets, spec_of
from .names import short_names, tensor_pairs
from .records import check_version
from .report import TransferReport
from .send_update import _SendUpdate

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


class WeightSender(_SendUpdate):
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
