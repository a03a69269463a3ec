"""verl checkpoint engine over :mod:`unisleep.transfer`: trainer → rollout weight sync with a
verified, atomic update, the same way on CUDA, ROCm, Ascend and CPU.

verl (PyPI 0.9.x) loads it through its own plug-in point (``verl/checkpoint_engine/base.py``)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=unisleep
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=unisleep.integrations.verl
    # optional: actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.unisleep={...}

Importing this module imports verl and registers :class:`UnisleepCheckpointEngine` as
``"unisleep"`` with ``CheckpointEngineRegistry.register`` (verl imports the module on every
worker before it builds the engine).  The contract, as verl's ``CheckpointEngineManager`` drives
it each weight sync:

1. ``prepare()`` on every actor and rollout worker → metadata (the trainer's rendezvous
   address, from actor rank 0 — the master);
2. ``build_topology(actor_world_size, rollout_world_size, metadata)`` → per-worker kwargs: actor
   rank 0 sends (group rank 0), the other actor ranks sit out (rank -1), rollout worker i is
   group rank i + 1;
3. ``init_process_group(rank=, world_size=, rendezvous=)`` on every worker: one authenticated
   :class:`~unisleep.transfer.TransferGroup` (created once, kept across syncs);
4. actor: ``await send_weights(per_tensor_param, global_steps)``; rollout:
   ``async for name, tensor in receive_weights(global_steps)`` (verl feeds them to its server
   adapter) — both bucket by bucket, see below;
5. ``finalize()``: the sender's bucket buffers are freed; the group stays (unless
   ``rebuild_group``).

What it adds over verl's NCCL/HCCL engines: every tensor is checked against the sender's
manifest (names, shapes, dtypes, keyed digests) before verl sees it; versions must increase (a
replay is refused); the group is authenticated (no pickled metadata: verl's NCCL engine sends
bucket metadata with ``send_pyobj`` over an unauthenticated ZeroMQ socket); one engine for every
vendor and for CPU (gloo), IPC when sender and receiver share a device.

Streaming (the default): rank 0 sends the tensors as verl's generator produces them, a bucket's
worth at a time — each bucket one verified update, a *chunk* of the sync (transfer version
``"<sync>.<chunk>:<last|more>:<global step>"``) — and each rollout worker yields a chunk's
tensors as soon as it has verified, while the next one arrives.  Memory per GPU, whatever the
model size: actor rank 0 holds one bucket of the generator's tensors and the transfer's send
buffer (two buckets); a rollout worker holds the transfer's receive buffer and one bucket of
copies that verl's consumer is taking (two buckets; a bucket is copied only once the consumer
took every tensor of the one before).  A failure part-way ends the rollout's stream at once and
leaves the named error in ``last_error``: :class:`~unisleep.errors.TransferError` with ``outcome
== "untouched"`` when nothing was yielded yet, else :class:`~unisleep.errors.TornWeightsError`
(``outcome == "torn"``: part of the update is loaded; the next complete sync repairs it).  ``staging="host"`` or ``"device"`` (opt-in) holds
the whole update on the rollout (pageable host memory, or the device) until every chunk has
verified, and yields nothing from a broken update — at the cost of one model copy per rollout
worker.

``engine_kwargs.unisleep`` (all optional; Hydra adds new keys with ``+``:
``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.unisleep.timeout_s=120``): ``host``
(rendezvous address; default: the address Ray knows actor rank 0's node by, taken at the first
``prepare()``), ``port`` (default: a free one there), ``secret_file`` (a group secret file,
mode 0600, the same on every node, instead of the fresh secret that actor rank 0 makes and
verl's manager carries to every worker through Ray), ``path`` (``auto`` | ``collective`` |
``ipc``), ``staging`` (``none``: streaming, the default | ``host`` | ``device``: whole-update
staging), ``timeout_s`` (every wait of a sync: the rendezvous, each chunk, verl's consumer taking
a bucket), ``group_name``, ``rebuild_group``.

A sync that breaks off inside verl's manager flow: the trainer's ``send_weights`` raises
:class:`~unisleep.errors.TransferError` (verl's manager re-raises it from ``ray.get``); each
rollout worker's stream to verl's server adapter ends early and the engine keeps the named error
in ``last_error`` (logged), so verl's adapter completes its round and the inference worker's
receive returns — nothing is left waiting, and the next ``update_weights`` goes through.  verl's
manager itself skips ``finalize``, ``resume_kv_cache`` and ``resume_generation`` after the error;
its ``release_kv_cache`` (vLLM sleep level 2) had dropped the rollout's weights before the sync,
so the rollout holds part of the new update (or nothing valid) until the next complete sync.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, AsyncGenerator, Optional

import torch

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError as e:  # the module is only useful inside verl
    raise ImportError(f"unisleep.integrations.verl needs verl (pip install verl; tested with verl "
                      f"0.9.1): {e}") from e

from ..errors import InvalidArgumentError, TornWeightsError, TransferError, UnisleepError

log = logging.getLogger(__name__)

BACKEND = "unisleep"
#: where a rollout worker holds the update: "none" (streaming), or all of it until verified
STAGING = ("none", "host", "device")


@CheckpointEngineRegistry.register(BACKEND)
class UnisleepCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` over a :class:`~unisleep.transfer.TransferGroup` (see the
    module docstring).  Built by verl as ``CheckpointEngineRegistry.new("unisleep",
    bucket_size=..., is_master=..., **engine_kwargs)``; ``bucket_size`` (bytes, from
    ``update_weights_bucket_megabytes``) is the transfer's bucket size."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, host: Optional[str] = None,
                 port: Optional[int] = None, secret_file: Optional[str] = None, path: str = "auto",
                 staging: str = "none", timeout_s: float = 300.0, group_name: str = "verl",
                 rebuild_group: bool = False, insecure: bool = False) -> None:
        if bucket_size is None or int(bucket_size) <= 0:
            raise InvalidArgumentError(f"bucket_size must be > 0 bytes, got {bucket_size!r}")
        if staging not in STAGING:
            raise InvalidArgumentError(f"staging must be one of {STAGING}, got {staging!r}")
        from ..transfer import PATHS

        if path not in PATHS:
            raise InvalidArgumentError(f"path must be one of {PATHS}, got {path!r}")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.host, self.port = host, port
        self.secret_file = secret_file
        self.path, self.staging = path, staging
        self.timeout_s = float(timeout_s)
        self.group_name = group_name
        self.rebuild_group = bool(rebuild_group)
        self.insecure = bool(insecure)
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.rendezvous: Optional[str] = None
        self._ticket = None               # master: the group's ticket (address, port, secret)
        self.group = None
        self._sender = None
        self._receiver = None
        self._updates = 0                 # sender: updates sent in this group
        self._applied: Any = None         # receiver: transfer version received last
        self._rx_thread: Optional[threading.Thread] = None
        self.last_report = None
        #: rollout side: the named error of the last sync that broke off (None after a good one)
        self.last_error: Optional[BaseException] = None

    # ------------------------------------------------------------------ topology
    def prepare(self) -> dict:
        """The master (actor rank 0) makes the group's ticket — once, kept across syncs — and
        returns it; every other worker reports nothing.

        The ticket (:class:`unisleep.ray.Ticket`) is made here, on actor rank 0's Ray node: its
        address is ``host`` or, when none is given, the address Ray knows this node by
        (``ray.util.get_node_ip_address()``, as verl's NCCL engine takes it), a port the
        operating system gives out on that address, and — unless ``secret_file`` is given — a
        fresh 256-bit group secret.  verl's manager carries it to every worker through Ray (the
        ``prepare`` results and ``init_process_group`` arguments travel in Ray's object store),
        so no secret file has to be copied to the rollout nodes; the secret is left out of the
        ticket's ``repr``."""
        if not self.is_master:
            return {}
        if self._ticket is None:
            from dataclasses import replace

            from ..ray import new_ticket

            t = new_ticket(2, host=self.host, name=self.group_name, timeout_s=self.timeout_s)
            if self.port:
                t = replace(t, rendezvous=t.rendezvous.rsplit(":", 1)[0] + f":{int(self.port)}")
            if self.secret_file or self.insecure:
                t = replace(t, secret=b"")
            self._ticket = t
            log.info("unisleep checkpoint engine: the group's rendezvous is %s (actor rank 0's node)", t.rendezvous)
        return {"ticket": self._ticket}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        from dataclasses import replace

        from ..ray import Ticket

        master = metadata[0] if metadata else None
        ticket = master.get("ticket") if isinstance(master, dict) else None
        if not isinstance(ticket, Ticket):
            raise InvalidArgumentError("actor rank 0 must be the unisleep checkpoint engine's master "
                                       "(verl builds the actor's engine with is_master=rank==0)")
        world_size = 1 + int(rollout_world_size)
        ticket = replace(ticket, world_size=world_size)
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world_size] * actor_wg_world_size,
                 "ticket": [ticket] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)),
                   "world_size": [world_size] * rollout_world_size,
                   "ticket": [ticket] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, ticket) -> None:
        """Join the ticket's group (once; kept across syncs unless ``rebuild_group``).  A
        rendezvous: every worker of the topology calls it at about the same time."""
        if rank < 0:
            self.rank, self.world_size = rank, world_size
            return
        rendezvous = ticket.rendezvous
        same = (self.group is not None and self.rank == rank and self.world_size == world_size
                and self.rendezvous == rendezvous)
        if same and not self.rebuild_group:
            return
        self._close_group()
        from ..transfer import TransferGroup

        # the ticket's secret (made by actor rank 0, carried by Ray), unless a secret_file is given
        secret = None if self.secret_file else (ticket.secret or None)
        self.group = TransferGroup.create(rendezvous, rank=rank, world_size=world_size,
                                          timeout_s=self.timeout_s, name=self.group_name, secret=secret,
                                          secret_file=self.secret_file, insecure=self.insecure)
        self.rank, self.world_size, self.rendezvous = rank, world_size, rendezvous
        self._updates, self._applied = 0, None
        log.info("unisleep checkpoint engine: rank %d/%d joined %s", rank, world_size, rendezvous)

    def finalize(self) -> None:
        """End of a sync: the group, the sender and the receiver (their connections) stay for
        the next one — ``rebuild_group``: all closed.  Bucket memory needs nothing here: on an
        accelerator the transfer gives it back at the end of every update (the device belongs to
        whoever works next); on the host platform it keeps its buffers (the kernel would zero
        fresh pages every sync)."""
        if self.rebuild_group:
            self._close_group()

    def _close_group(self) -> None:
        for obj in (self._sender, self._receiver, self.group):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # pragma: no cover - best effort
                    pass
        self._sender = self._receiver = self.group = None

    # ------------------------------------------------------------------ send
    def _sender_for_update(self):
        if self._sender is None:
            from ..transfer import WeightSender

            self._sender = WeightSender(self.group, bucket_bytes=self.bucket_size, path=self.path)
        return self._sender

    def _send_chunk(self, chunk: list, n: int, k: int, last: bool, global_steps) -> Any:
        """One bucket's worth of tensors as one verified update (blocking: run in a thread)."""
        return self._sender_for_update().send(chunk, chunk_tag(n, k, last, global_steps))

    def _abort_chunk(self, n: int, k: int, global_steps, why: str) -> None:
        """Tell every rollout worker that sync ``n`` broke off on the trainer, so none waits for
        the rest until its timeout: an update whose only tensor cannot be produced (the
        transfer aborts it and the receivers hear ``why``)."""
        def broken():
            raise TransferError(why)
            yield  # pragma: no cover - a generator

        try:
            self._sender_for_update().send(broken(), chunk_tag(n, k, True, global_steps),
                                           specs=[("unisleep.sync_aborted", (1,), "uint8")])
        except Exception:  # noqa: BLE001 - the receivers heard it (or are gone); the cause is raised
            pass

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """Actor side.  Rank 0 sends ``weights`` (``(name, tensor)`` pairs, sync or async) as they
        come: every time the next tensor would overflow the bucket, the tensors gathered so far
        go out as one verified update (a chunk of this sync) while the generator waits, so rank
        0 holds one bucket of tensors besides the transfer's send buffer — never the model.
        Returns once every rollout worker verified the last chunk.  The other actor ranks only
        walk the generator (producing each weight is collective over the actor group); after a
        failure rank 0 walks the rest too, so their collectives complete, then raises."""
        from verl.workers.rollout.utils import ensure_async_iterator

        if self.rank is None:
            raise InvalidArgumentError("send_weights before init_process_group")
        if self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != 0:
            raise InvalidArgumentError(f"only group rank 0 sends; this is rank {self.rank}")
        self._updates += 1
        n, k = self._updates, 0
        chunk: list = []
        held = 0
        t0 = time.perf_counter()
        total, reports = 0, []
        it = ensure_async_iterator(weights)
        try:
            async for name, tensor in it:
                t = tensor.detach()
                size = t.numel() * t.element_size()
                if chunk and held + size > self.bucket_size:
                    reports.append(await asyncio.to_thread(self._send_chunk, chunk, n, k, False, global_steps))
                    chunk, held, k = [], 0, k + 1
                chunk.append((str(name), t))
                held += size
                total += size
            if not chunk:
                raise InvalidArgumentError("send_weights got no tensors")
            reports.append(await asyncio.to_thread(self._send_chunk, chunk, n, k, True, global_steps))
        except BaseException as e:
            chunk = []
            why = f"the trainer's sync {n} broke off after {k} chunk(s): {type(e).__name__}: {e}"
            if not isinstance(e, TransferError):  # a transfer error: the receivers have heard it
                await asyncio.to_thread(self._abort_chunk, n, k + 1, global_steps, why[:2000])
            if isinstance(e, Exception):
                try:
                    async for _ in it:  # the other actor ranks are still producing the weights
                        pass
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            if isinstance(e, Exception) and not isinstance(e, UnisleepError):
                # named, for verl's manager (which re-raises it from ray.get) and the trainer's log
                raise TransferError(f"{why}; the rollouts hold part of this update or none of it — run the "
                                    "next sync (verl's update_weights) before they serve again") from e
            raise
        seconds = time.perf_counter() - t0
        self.last_report = reports[-1]
        log.info("unisleep checkpoint engine: sent %d bytes in %d chunk(s) in %.3f s", total,
                 len(reports), seconds)
        return {"unisleep/transfer_s": seconds,
                "unisleep/transfer_gbps": total / seconds / 1e9 if seconds > 0 else 0.0,
                "unisleep/chunks": len(reports)}

    # ------------------------------------------------------------------ receive
    def _join_previous(self) -> None:
        prev = self._rx_thread
        if prev is not None and prev.is_alive():
            prev.join(self.timeout_s + 30)
            if prev.is_alive():
                raise TransferError(
                    f"the previous receive_weights of this rollout worker is still receiving after "
                    f"{self.timeout_s + 30:.0f} s (its consumer stopped early?); nothing was received "
                    "— rebuild the group (rebuild_group) or restart the rollout worker")
        self._rx_thread = None

    def _receive_chunks(self, hand, stop: threading.Event) -> Any:
        """Receive one sync's chunks (blocking: run on a thread), handing each verified bucket to
        ``hand``; return the last chunk's report."""
        from ..transfer import WeightReceiver

        # one receiver per group, kept across syncs (its IPC connection stays); this sync's hand-off
        if self._receiver is None or self._receiver.group is not self.group:
            self._receiver = WeightReceiver(self.group, apply=hand, staged=False,
                                            initial_version=self._applied)
        rx = self._receiver
        rx.apply, rx.version = hand, self._applied
        n = None
        try:
            for k in itertools.count():
                if stop.is_set():
                    raise TransferError("verl's consumer stopped taking the update; the rest was not received")
                report = rx.receive(timeout_s=self.timeout_s)
                self._applied = report.version
                got_n, got_k, last = parse_chunk_tag(report.version)
                if got_k != k or (n is not None and got_n != n):
                    raise TransferError(
                        f"chunk {report.version!r} out of order: expected chunk {k} of sync "
                        f"{n if n is not None else '(a new one)'}; the rollout worker missed part of a sync")
                n = got_n
                if last:
                    return report
        finally:
            rx.apply = _gone

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator:
        """Rollout side: receive the next update and yield its ``(name, tensor)`` pairs in the
        sender's order.

        ``staging="none"`` (default, streaming): each chunk's bucket is verified against the
        sender's manifest, then its tensors are copied once (on the group's device) and yielded
        while the next bucket arrives; a bucket is copied only when verl's consumer has taken
        every tensor of the one before, so this worker holds at most two buckets (the transfer's
        receive buffer and one bucket of copies), whatever the model size.  A failure part-way
        ends the stream early (verl's adapter then completes its round with the inference worker) and
        keeps in ``last_error`` :class:`~unisleep.errors.TransferError` — with ``outcome == "untouched"`` when
        nothing was yielded yet, else :class:`~unisleep.errors.TornWeightsError` with ``outcome
        == "torn"`` (the consumer has loaded part of it: the next complete sync repairs it).

        ``staging="host"`` / ``"device"``: the whole update is held (host: pageable host memory)
        until every chunk has verified, then yielded; a failure yields nothing."""
        if self.rank is None or self.rank < 1 or self.group is None:
            raise InvalidArgumentError("receive_weights needs init_process_group with a rollout rank (>= 1)")
        self._join_previous()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        room = threading.Event()   # verl's consumer took everything handed so far
        stop = threading.Event()   # verl's consumer is gone
        room.set()
        staging = self.staging
        accel = self.group.platform.is_accelerator
        wait_s = self.timeout_s
        staged: list = []

        def hand(named) -> None:  # views of transfer memory, valid during this call only
            if staging == "none":
                if not room.wait(wait_s):
                    raise TransferError(f"verl's consumer did not take the previous bucket within {wait_s:.0f} s "
                                        "(timeout_s); the rest of the update was not received")
                if stop.is_set():
                    raise TransferError("verl's consumer stopped taking the update")
                room.clear()
                copies = [(name, t.clone()) for name, t in named]
                if accel:
                    torch.accelerator.synchronize()
                loop.call_soon_threadsafe(queue.put_nowait, ("bucket", copies))
            else:
                for name, t in named:
                    staged.append((name, t.clone() if staging == "device" else t.to("cpu", copy=True)))
                if accel:
                    torch.accelerator.synchronize()

        def run() -> None:
            try:
                report = self._receive_chunks(hand, stop)
            except BaseException as e:  # handed to the consumer's side
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, ("done", report))

        th = threading.Thread(target=run, name="unisleep-verl-receive", daemon=True)
        self._rx_thread = th
        th.start()
        yielded = 0
        self.last_error = None
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(queue.get(), wait_s + 30)
                except asyncio.TimeoutError:
                    kind, payload = "error", TransferError(
                        f"no bucket from the receiving thread within {wait_s + 30:.0f} s; "
                        f"{yielded} tensor(s) were yielded")
                if kind == "bucket":
                    for pair in payload:
                        yielded += 1
                        yield pair
                    payload = pair = None
                    room.set()
                elif kind == "done":
                    self.last_report = payload
                    log.info("unisleep checkpoint engine: received %s (global step %s)", payload, global_steps)
                    break
                else:
                    err = self._failure(payload, yielded, global_steps)
                    if not isinstance(err, Exception):
                        raise err
                    # The stream ends here instead of raising into verl's server adapter: the
                    # adapter then completes its round with the inference worker (verl's vLLM
                    # adapter sends its last bucket, and the vLLM worker's update_weights_from_ipc
                    # returns) — raised through it, the inference worker would be left waiting
                    # on its socket and the next sync would hang behind it.  The trainer's
                    # send_weights raises the named error, so verl's manager does.
                    self.last_error = err
                    log.error("unisleep checkpoint engine: %s: %s (outcome %s); the stream to verl's "
                              "server adapter ends here", type(err).__name__, err, err.outcome)
                    return
            if staging != "none":
                pairs, staged[:] = list(staged), []
                for pair in pairs:
                    yield pair
        finally:
            stop.set()
            room.set()
            staged.clear()

    def _failure(self, err: BaseException, yielded: int, global_steps) -> BaseException:
        """The named error of an update that broke off (kept in ``last_error``), carrying
        ``outcome``: ``"torn"`` when part of it was handed to verl's server adapter, else
        ``"untouched"`` (none of it was).  In verl's manager flow the rollout's weights were
        already released before the sync began (``release_kv_cache``: vLLM sleep level 2), so
        either way only the next complete sync gives the rollout valid weights."""
        if not isinstance(err, Exception):
            return err
        if yielded:
            e = TornWeightsError(
                f"the weight sync of global step {global_steps} broke off after {yielded} tensor(s) were "
                f"yielded to the rollout: {type(err).__name__}: {err}; the rollout's weights are mixed — "
                "run the next sync (verl's update_weights) before the rollout serves again",
                version=self._applied)
            e.outcome = "torn"
            e.__cause__ = err
            return e
        if not isinstance(err, TransferError):
            e = TransferError(f"the weight sync of global step {global_steps} failed before any tensor was "
                              f"yielded: {type(err).__name__}: {err}; none of this update reached the rollout — run the next "
                              "sync (verl's update_weights) before the rollout serves again")
            e.__cause__ = err
            err = e
        err.outcome = "untouched"
        return err


def _gone(named) -> None:
    """The hand-off of a receiver between syncs: no consumer takes a bucket."""
    raise TransferError("no receive_weights is running on this rollout worker")


def chunk_tag(n: int, k: int, last: bool, global_steps) -> str:
    """The transfer version of chunk ``k`` of sync ``n``: ``"<n>.<k>:<last|more>:<global_steps>"``
    (versions increase chunk by chunk and sync by sync; a replay is refused)."""
    return f"{n}.{k}:{'last' if last else 'more'}:{global_steps if global_steps is not None else 'none'}"


def parse_chunk_tag(tag) -> tuple:
    """``(n, k, last)`` of a :func:`chunk_tag`; TransferError for anything else."""
    try:
        nk, mark, _ = str(tag).split(":", 2)
        n, k = (int(x) for x in nk.split("."))
        if mark not in ("last", "more"):
            raise ValueError(mark)
    except ValueError:
        raise TransferError(f"the sender's version {tag!r} is not a chunk of a verl sync "
                            "(<sync>.<chunk>:<last|more>:<global step>): is the trainer running "
                            "the same unisleep?") from None
    return n, k, mark == "last"


__all__ = ["UnisleepCheckpointEngine", "BACKEND", "STAGING", "chunk_tag", "parse_chunk_tag"]
