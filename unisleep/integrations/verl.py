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
   adapter);
5. ``finalize()``: the sender's bucket buffers are freed; the group stays (unless
   ``rebuild_group``).

What it adds over verl's NCCL/HCCL engines: every tensor is checked against the sender's
manifest (names, shapes, dtypes, keyed digests) and **nothing is yielded to the rollout until
the whole update has arrived and verified** — a broken or tampered update raises and the rollout
keeps serving its previous weights; versions must increase (a replay is refused); the group is
authenticated (no pickled metadata: verl's NCCL engine sends bucket metadata with
``send_pyobj`` over an unauthenticated ZeroMQ socket); one engine for every vendor and for CPU
(gloo), IPC when sender and receiver share a device.

``engine_kwargs.unisleep`` (all optional): ``host`` (rendezvous address, default 127.0.0.1 —
give the trainer node's address and a ``secret_file`` for rollouts on other machines),
``port`` (default: a free one), ``secret_file`` (group secret, mode 0600, readable by every
worker), ``path`` (``auto`` | ``collective`` | ``ipc``), ``staging`` (``host`` | ``device``:
where the rollout side holds the update until it is complete; host = pinned host memory),
``timeout_s``, ``group_name``, ``rebuild_group``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncGenerator, Optional

import torch

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError as e:  # the module is only useful inside verl
    raise ImportError(f"unisleep.integrations.verl needs verl (pip install verl; tested with verl "
                      f"0.9.1): {e}") from e

from ..errors import InvalidArgumentError

log = logging.getLogger(__name__)

BACKEND = "unisleep"
STAGING = ("host", "device")


@CheckpointEngineRegistry.register(BACKEND)
class UnisleepCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` over a :class:`~unisleep.transfer.TransferGroup` (see the
    module docstring).  Built by verl as ``CheckpointEngineRegistry.new("unisleep",
    bucket_size=..., is_master=..., **engine_kwargs)``; ``bucket_size`` (bytes, from
    ``update_weights_bucket_megabytes``) is the transfer's bucket size."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, host: str = "127.0.0.1",
                 port: Optional[int] = None, secret_file: Optional[str] = None, path: str = "auto",
                 staging: str = "host", timeout_s: float = 300.0, group_name: str = "verl",
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
        self.group = None
        self._sender = None
        self._receiver = None
        self._updates = 0                 # sender: updates sent in this group
        self._applied: Any = None         # receiver: transfer version yielded last
        self.last_report = None

    # ------------------------------------------------------------------ topology
    def prepare(self) -> dict:
        """The master (actor rank 0) names the rendezvous; every other worker reports nothing."""
        if not self.is_master:
            return {}
        if self.rendezvous is None:
            from ..engines.vllm_server import free_port

            port = self.port or free_port(self.host)
            self.rendezvous = f"tcp://{self.host}:{port}"
        return {"rendezvous": self.rendezvous}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0] if metadata else None
        if not isinstance(master, dict) or not master.get("rendezvous"):
            raise InvalidArgumentError("actor rank 0 must be the unisleep checkpoint engine's master "
                                       "(verl builds the actor's engine with is_master=rank==0)")
        world_size = 1 + int(rollout_world_size)
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world_size] * actor_wg_world_size,
                 "rendezvous": [master["rendezvous"]] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)),
                   "world_size": [world_size] * rollout_world_size,
                   "rendezvous": [master["rendezvous"]] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, rendezvous: str) -> None:
        """Join the group (once; kept across syncs unless ``rebuild_group``).  A rendezvous:
        every worker of the topology calls it at about the same time."""
        if rank < 0:
            self.rank, self.world_size = rank, world_size
            return
        same = (self.group is not None and self.rank == rank and self.world_size == world_size
                and self.rendezvous == rendezvous)
        if same and not self.rebuild_group:
            return
        self._close_group()
        from ..transfer import TransferGroup

        self.group = TransferGroup.create(rendezvous, rank=rank, world_size=world_size,
                                          timeout_s=self.timeout_s, name=self.group_name,
                                          secret_file=self.secret_file, insecure=self.insecure)
        self.rank, self.world_size, self.rendezvous = rank, world_size, rendezvous
        self._updates, self._applied = 0, None
        log.info("unisleep checkpoint engine: rank %d/%d joined %s", rank, world_size, rendezvous)

    def finalize(self) -> None:
        """Free the sender's bucket buffers; keep the group (``rebuild_group``: close it)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
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
    @torch.no_grad()
    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """Actor side.  Rank 0 sends ``weights`` (``(name, tensor)`` pairs, sync or async) as one
        update and returns once every rollout worker verified it; the other actor ranks only
        walk the generator (producing each weight is collective over the actor group)."""
        from verl.workers.rollout.utils import ensure_async_iterator

        if self.rank is None:
            raise InvalidArgumentError("send_weights before init_process_group")
        if self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != 0:
            raise InvalidArgumentError(f"only group rank 0 sends; this is rank {self.rank}")
        items = []
        async for name, tensor in ensure_async_iterator(weights):
            t = tensor.detach()
            if t.device.type != "cpu":  # host copy: the update never sits twice on the device
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                dst.copy_(t, non_blocking=True)
                t = dst
            items.append((str(name), t))
        if items and items[-1][1].is_pinned():
            torch.accelerator.synchronize()
        if not items:
            raise InvalidArgumentError("send_weights got no tensors")
        self._updates += 1
        tag = f"{self._updates}:{global_steps if global_steps is not None else 'none'}"
        if self._sender is None:
            from ..transfer import WeightSender

            self._sender = WeightSender(self.group, bucket_bytes=self.bucket_size, path=self.path)
        report = await asyncio.to_thread(self._sender.send, items, tag)
        self.last_report = report
        log.info("unisleep checkpoint engine: sent %s", report)
        return {"unisleep/transfer_s": report.seconds, "unisleep/transfer_gbps": report.gbps}

    # ------------------------------------------------------------------ receive
    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator:
        """Rollout side: receive the next update, verify all of it, then yield its ``(name,
        tensor)`` pairs in the sender's order.  Nothing is yielded when the update fails
        (TransferError): the rollout keeps its weights."""
        if self.rank is None or self.rank < 1 or self.group is None:
            raise InvalidArgumentError("receive_weights needs init_process_group with a rollout rank (>= 1)")
        staged: list = []
        pin = self.staging == "host" and self.group.platform.is_accelerator

        def stage(named) -> None:
            for name, t in named:  # views of transfer memory, valid during this call only
                if self.staging == "device":
                    staged.append((name, t.detach().clone()))
                else:
                    dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                    dst.copy_(t, non_blocking=pin)
                    staged.append((name, dst))
            if pin:
                torch.accelerator.synchronize()

        from ..transfer import WeightReceiver

        rx = WeightReceiver(self.group, apply=stage, staged=False, initial_version=self._applied)
        try:
            report = await asyncio.to_thread(rx.receive, timeout_s=self.timeout_s)
        except BaseException:
            staged.clear()
            raise
        finally:
            rx.close()
        self._applied = report.version
        self.last_report = report
        log.info("unisleep checkpoint engine: received %s (global step %s)", report, global_steps)
        for pair in staged:
            yield pair


__all__ = ["UnisleepCheckpointEngine", "BACKEND"]
