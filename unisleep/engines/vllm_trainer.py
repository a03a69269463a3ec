"""Trainer side of the ``unisleep`` vLLM weight-transfer engine.

    from unisleep.engines.vllm_trainer import VLLMWeightPusher
    pusher = VLLMWeightPusher(engine)            # VLLMHTTPEngine or VLLMEngine
    pusher.init()                                # /init_weight_transfer_engine + our group, together
    pusher.push(model.state_dict().items(), version="step-3")
    ...
    pusher.close()

:meth:`VLLMWeightPusher.push` runs vLLM's protocol: check that the engine's weights are awake
(refuses with :class:`~unisleep.errors.InvalidTransitionError` "wake the weights first",
vLLM #57853), ``start_weight_update``, then for each chunk ``update_weights`` in a thread while
this process sends the chunk over the :class:`~unisleep.transfer.TransferGroup`, then
``finish_weight_update(version)``.  With ``route="engine"`` (the default) the engine must have
been started with ``--weight-transfer-config '{"backend": "unisleep"}'`` (vLLM >= 0.25);
``route="extension"`` runs the same session through the unisleep worker methods
(:mod:`unisleep.vllm_worker.extension`, over ``collective_rpc``; the engine started with
``--worker-extension-cls unisleep.vllm_worker.extension.UnisleepWorkerExtension``) — the path
for vLLM 0.24, and for every later version.

The group is authenticated with a 256-bit secret: by default a fresh one in a 0600 file in this
user's private run directory, whose *path* goes to the engine in ``init_info`` (the engine must
run on this machine as this user, or as root); give ``secret_file=`` (a path both sides can read)
or ``UNISLEEP_TRANSFER_SECRET_FILE`` on both sides for anything else (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from ..errors import EngineError, InvalidArgumentError, TransferError
from .vllm_server import free_port

log = logging.getLogger(__name__)

#: how the session reaches the workers: vLLM's weight-transfer routes with the unisleep engine
#: (vLLM >= 0.25), or the unisleep worker methods over collective_rpc (vLLM >= 0.24)
ROUTES = ("engine", "extension")
#: seconds :meth:`VLLMWeightPusher.close` waits for the engine to close its side of the group
CLOSE_ENGINE_S = 10.0


@dataclass
class PushReport:
    version: str
    tensors: int
    nbytes: int
    chunks: int
    seconds: float
    phases: dict = field(default_factory=dict)


class _Call(threading.Thread):
    """Run one blocking engine call in a thread, keeping its exception."""

    def __init__(self, fn, *args, **kwargs) -> None:
        super().__init__(daemon=True, name="unisleep-vllm-call")
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.error: Optional[BaseException] = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # handed to the caller
            self.error = e


class VLLMWeightPusher:
    """Sends weights from this (trainer) process into a vLLM engine using the unisleep backend."""

    def __init__(self, engine, *, rendezvous: Optional[str] = None, host: str = "127.0.0.1",
                 timeout_s: float = 120.0, world_size: int = 2, group_name: str = "vllm",
                 path: str = "auto", secret_file: Optional[str] = None, insecure: bool = False,
                 route: str = "engine", staging: str = "none") -> None:
        if route not in ROUTES:
            raise InvalidArgumentError(f"route must be one of {ROUTES}, got {route!r}")
        self.engine = engine
        self.route = route
        if route == "extension":
            from ..vllm_worker.extension import ExtensionRoute

            self._verbs = ExtensionRoute(engine)
        else:
            self._verbs = engine
        self.rendezvous = rendezvous or f"tcp://{host}:{free_port(host)}"
        # the group secret: a file of mode 0600 whose path (never the secret) goes to the engine;
        # by default a fresh one in this user's private run directory (same-machine engines)
        self.secret_file = secret_file
        self.insecure = insecure
        self._own_secret_file: Optional[str] = None
        self._updates = 0
        self.timeout_s = float(timeout_s)
        self.world_size = int(world_size)
        self.group_name = group_name
        self.path = path   # WeightSender path: "auto" (IPC when colocated), "collective", "ipc"
        self.group = None
        # where the engine holds an update: "none" (each verified bucket into the model at once),
        # "host" / "device" (all of it until complete; a broken update leaves the model untouched)
        self.staging = staging

    # ---- setup -----------------------------------------------------------------------
    def init_info(self) -> dict:
        return {"rendezvous": self.rendezvous, "rank_offset": 1, "world_size": self.world_size,
                "timeout_s": self.timeout_s, "group_name": self.group_name,
                "secret_file": self.secret_file or "", "insecure": self.insecure,
                "staging": self.staging}

    def _prepare_secret(self) -> None:
        import os

        from ..addresses import is_loopback
        from ..transfer.group import parse_rendezvous
        from ..transfer.secret import ENV_SECRET, ENV_SECRET_FILE, private_dir, write_secret_file

        if self.secret_file or os.environ.get(ENV_SECRET) or os.environ.get(ENV_SECRET_FILE):
            return  # given: the engine must be given the same (docs/security.md)
        host, port = parse_rendezvous(self.rendezvous)
        if not is_loopback(host):
            return  # TransferGroup refuses without a secret (unless insecure=True) and says how
        path = os.path.join(private_dir(), f"vllm-{port}-{self.group_name}.secret")
        write_secret_file(path)
        self.secret_file = self._own_secret_file = path

    def init(self) -> "VLLMWeightPusher":
        """``/init_weight_transfer_engine`` and this side's group, concurrently (a rendezvous)."""
        if self.group is not None:
            return self
        self._prepare_secret()
        call = _Call(self._verbs.init_weight_transfer, self.init_info())
        call.start()
        try:
            self.join()
        finally:
            call.join(self.timeout_s + 30)
        if call.error is not None:
            self.close()
            raise call.error
        return self

    def join(self) -> "VLLMWeightPusher":
        """Only this side's group (rank 0), for a framework whose own client sends
        ``/init_weight_transfer_engine`` to its servers at the same time (SkyRL's
        ``init_weight_update_communicator``): blocks until every engine worker joined, or
        ``timeout_s`` (:class:`~unisleep.errors.TransferError`).  The servers must be given
        :meth:`init_info`'s rendezvous, world size, group name and secret file."""
        from ..transfer import TransferGroup

        if self.group is not None:
            return self
        self._updates = 0
        self.group = TransferGroup.create(self.rendezvous, rank=0, world_size=self.world_size,
                                          timeout_s=self.timeout_s, name=self.group_name,
                                          secret_file=self.secret_file, insecure=self.insecure)
        return self

    # ---- one update ------------------------------------------------------------------
    def push(self, named_tensors: Iterable, version: str, *, chunks: int = 1,
             partial: bool = False, check_awake: bool = True,
             specs: Optional[Sequence] = None) -> PushReport:
        """Send ``named_tensors`` ((name, tensor) pairs, checkpoint names) as ``version``.

        Raises :class:`InvalidTransitionError` before anything is sent when the engine reports its
        weights asleep; :class:`TransferError` when the engine refused or failed the update (its
        message carries the route, status and body).  ``chunks`` splits the update into several
        ``/update_weights`` calls (the last one is marked final).

        ``specs`` (``(name, shape, dtype)`` of every tensor, in order): ``named_tensors`` may then
        be a lazy generator, read one bucket at a time and never held whole (one
        ``/update_weights`` call: ``chunks`` must be 1) — for trainers that gather each tensor
        just before it is sent (FSDP).
        """
        items = self._items(named_tensors, chunks) if specs is None else self._lazy(named_tensors, chunks, specs)
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        if check_awake:
            self._verbs.check_weights_awake()  # InvalidTransitionError: "wake the weights first"
        self._verbs.start_weight_update()
        phases["start"] = time.perf_counter() - t0
        try:
            n_parts = self._send_chunks(items, str(version), chunks, partial)
        except BaseException:
            self._abort()
            raise
        phases["update"] = time.perf_counter() - t0 - phases["start"]
        self._verbs.finish_weight_update(str(version))
        phases["finish"] = time.perf_counter() - t0 - phases["start"] - phases["update"]
        nbytes = items.nbytes if isinstance(items, _Lazy) else sum(int(t.numel()) * t.element_size() for _, t in items)
        if isinstance(items, _Lazy):
            return PushReport(str(version), len(items.specs), nbytes, n_parts, time.perf_counter() - t0, phases)
        return PushReport(str(version), len(items), nbytes, n_parts,
                          time.perf_counter() - t0, phases)

    def send(self, named_tensors: Iterable, version: str, *, chunks: int = 1,
             partial: bool = False) -> PushReport:
        """Only the middle of the protocol: the ``/update_weights`` chunks and their bytes, for a
        caller that runs start/finish itself — :class:`unisleep.loop.Handoff`::

            handoff.reacquire(lambda eng: pusher.send(model.named_parameters(), "7"), version="7")

        (Handoff checks the weights are awake, calls ``start_weight_update``, this, then
        ``finish_weight_update("7")``, and aborts the session if this raises.)"""
        items = self._items(named_tensors, chunks)
        t0 = time.perf_counter()
        n_parts = self._send_chunks(items, str(version), chunks, partial)
        dt = time.perf_counter() - t0
        nbytes = sum(int(t.numel()) * t.element_size() for _, t in items)
        return PushReport(str(version), len(items), nbytes, n_parts, dt, {"update": dt})

    def _items(self, named_tensors: Iterable, chunks: int) -> list:
        if self.group is None:
            raise InvalidArgumentError("call init() before sending")
        items = [(str(n), t.detach() if hasattr(t, "detach") else t) for n, t in named_tensors]
        if not items:
            raise InvalidArgumentError("nothing to send")
        if chunks < 1:
            raise InvalidArgumentError(f"chunks must be >= 1, got {chunks}")
        return items

    def _lazy(self, named_tensors: Iterable, chunks: int, specs: Sequence) -> "_Lazy":
        from ..transfer.manifest import spec_of

        if self.group is None:
            raise InvalidArgumentError("call init() before sending")
        if chunks != 1:
            raise InvalidArgumentError(f"a lazy update (specs=) is sent in one chunk, got chunks={chunks}")
        checked = [spec_of(s, i) for i, s in enumerate(specs)]  # InvalidArgumentError naming the entry
        if not checked:
            raise InvalidArgumentError("nothing to send")
        return _Lazy(named_tensors, checked)

    def _abort(self) -> None:
        abort = getattr(self._verbs, "abort_weight_update", None)
        if abort is None:
            return
        try:
            abort()
        except Exception:  # the original error is the one to report
            log.debug("abort_weight_update failed", exc_info=True)

    def _send_chunks(self, items: list, version: str, chunks: int, partial: bool) -> int:
        from ..transfer import WeightSender

        lazy = items if isinstance(items, _Lazy) else None
        parts = [lazy.tensors] if lazy is not None else _split(items, chunks)
        # the transfer version: this pusher's update number and vLLM's label; the engine checks
        # that the numbers increase (the chunks of one update share theirs)
        self._updates += 1
        tag = f"{self._updates}:{version}"
        if len(tag) > 256:
            raise InvalidArgumentError(f"version {version!r} is too long (at most ~240 characters)")
        sender = WeightSender(self.group, path=self.path, allow_equal_versions=True)
        try:
            for i, part in enumerate(parts):
                final = i == len(parts) - 1
                call = _Call(self._verbs.update_weights,
                             {"version": str(version), "final": final, "partial": bool(partial)})
                call.start()
                send_error: Optional[BaseException] = None
                try:
                    sender.send(part, version=tag, specs=None if lazy is None else lazy.specs)
                except BaseException as e:  # raised below, once the engine's call has been joined
                    send_error = e
                call.join(self.timeout_s + 30)
                if call.is_alive():
                    raise TransferError(f"/update_weights did not return within "
                                        f"{self.timeout_s + 30:.0f} s (chunk {i + 1}/{len(parts)})")
                if call.error is not None:
                    err = call.error
                    if isinstance(err, EngineError):
                        raise TransferError(f"the engine refused chunk {i + 1}/{len(parts)} of "
                                            f"version {version}: {err}") from err
                    raise err
                if send_error is not None:
                    raise send_error
        finally:  # its IPC socket and exported buffers go now, not at garbage collection
            sender.close()
        return len(parts)

    def close(self) -> None:
        """End the session: the engine's side first (``shutdown_weight_transfer``, waited for at most
        :data:`CLOSE_ENGINE_S`), then this side's group, whose store the engine's group reaches —
        closed the other way round, the engine's workers would see the store vanish and warn that
        rank 0 may have died.  An engine that cannot answer (gone, or busy past the wait) does not
        hold the close up: its group then notices the store is gone by itself."""
        group, self.group = self.group, None
        if group is not None:
            shutdown = getattr(self._verbs, "shutdown_weight_transfer", None)
            if shutdown is not None:
                call = _Call(shutdown)
                call.start()
                call.join(CLOSE_ENGINE_S)
                if call.is_alive() or call.error is not None:
                    log.debug("the engine's shutdown_weight_transfer did not finish: %s",
                              call.error or f"still running after {CLOSE_ENGINE_S:g} s")
            try:
                group.close()
            except Exception:  # pragma: no cover
                pass
        own, self._own_secret_file = self._own_secret_file, None
        if own is not None:
            import os

            try:
                os.unlink(own)
            except OSError:
                pass
            self.secret_file = None

    def __enter__(self) -> "VLLMWeightPusher":
        return self.init()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Lazy:
    """A lazy update: the tensors' generator and their checked specs (``TensorSpec``)."""
    tensors: Iterable
    specs: list

    @property
    def nbytes(self) -> int:
        import math

        from ..transfer.manifest import _torch_dtype

        return sum(math.prod(s.shape) * _torch_dtype(s.dtype).itemsize for s in self.specs)


def _split(items: Sequence, chunks: int) -> list[list]:
    chunks = max(1, min(chunks, len(items)))
    size = -(-len(items) // chunks)
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


__all__ = ["VLLMWeightPusher", "PushReport", "ROUTES"]
