"""Ray helpers: a trainer actor and N engine actors build a :class:`~unisleep.transfer.TransferGroup`
and run the :class:`~unisleep.loop.Handoff` — with no port guessed and no secret on a command line.

::

    import ray
    from unisleep.ray import TransferActor, connect

    @ray.remote
    class Trainer(TransferActor):          # rank 0: sends
        def train_and_send(self, version):
            ...
            self.unisleep_sender().send(model.named_parameters(), version=version)

    @ray.remote
    class Engine(TransferActor):           # ranks 1..N: receive
        ...

    trainer = Trainer.remote(); engines = [Engine.remote() for _ in range(n)]
    connect(trainer, engines)              # every actor holds its TransferGroup now

What :func:`connect` does: it asks the trainer actor for a :class:`Ticket` — made ON the trainer's
node, holding that node's address, a port the operating system just gave out there, the group size
and a fresh 256-bit group secret.  The ticket travels to every engine actor through Ray's object
store (an actor method's return value passed as an argument), and each actor joins the group with
it.  Nothing is on a command line or in an environment variable; the secret is left out of the
ticket's ``repr`` and never logged.  Whoever can read the cluster's object store can read the
ticket: a Ray cluster is one trust domain (docs/scale.md).

Ray is imported only when a helper that needs it runs (``pip install 'unisleep[ray]'``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .errors import InvalidArgumentError, UnsupportedError
from .transfer import DEFAULT_TIMEOUT_S, TransferGroup, WeightReceiver, WeightSender

RAY_HINT = "pip install 'unisleep[ray]'"


def require_ray():
    """The ``ray`` module, or a named error that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise UnsupportedError(f"unisleep.ray needs Ray, which is not installed ({e}): {RAY_HINT}") from None
    return ray


@dataclass(frozen=True)
class Ticket:
    """What every member needs to join one transfer group: made on rank 0's node by
    :func:`new_ticket`, carried by Ray's object store.  ``secret`` is not in the ``repr``."""

    rendezvous: str
    world_size: int
    name: str = "default"
    timeout_s: float = DEFAULT_TIMEOUT_S
    secret: bytes = field(default=b"", repr=False)


def node_address() -> str:
    """This node's address as Ray knows it (the one other nodes reach it at); loopback without Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def new_ticket(world_size: int, *, host: Optional[str] = None, name: str = "default",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Ticket:
    """A ticket for a group of ``world_size`` members whose rank 0 runs in THIS process: this node's
    address (or ``host``), a port the operating system gives out now, a fresh secret."""
    from .transfer.secret import new_secret

    if world_size < 2:
        raise InvalidArgumentError(f"a transfer group needs a trainer and at least one engine; world_size={world_size}")
    host = host or node_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))  # the OS picks a free port on exactly this address
        port = s.getsockname()[1]
    addr = f"[{host}]" if ":" in host else host
    return Ticket(f"tcp://{addr}:{port}", world_size, name, timeout_s, new_secret())


def join(ticket: Ticket, rank: int, *, platform=None, device: Optional[int] = None) -> TransferGroup:
    """Join the ticket's group as ``rank`` (0: the trainer, on the node that made the ticket)."""
    if not isinstance(ticket, Ticket):
        raise InvalidArgumentError(f"join() needs a unisleep.ray.Ticket, got {type(ticket).__name__}")
    return TransferGroup.create(ticket.rendezvous, rank=rank, world_size=ticket.world_size, platform=platform,
                                timeout_s=ticket.timeout_s, device=device, name=ticket.name, secret=ticket.secret)


class TransferActor:
    """Mix into a Ray actor class (trainer or engine) to let :func:`connect` build its group.

    After :func:`connect`: ``self.unisleep_group`` (the :class:`TransferGroup`), and
    :meth:`unisleep_sender` (rank 0) or :meth:`unisleep_receiver` (the others)."""

    unisleep_group: Optional[TransferGroup] = None
    unisleep_platform: Any = None  # set before connect() to choose the platform (default: detected)

    def unisleep_ticket(self, world_size: int, name: str = "default", timeout_s: float = DEFAULT_TIMEOUT_S) -> Ticket:
        """Rank 0 only: the ticket of a new group hosted here."""
        self._unisleep_ticket = new_ticket(world_size, name=name, timeout_s=timeout_s)
        return self._unisleep_ticket

    def unisleep_join(self, ticket: Ticket, rank: int) -> dict:
        self.unisleep_group = join(ticket, rank, platform=self.unisleep_platform)
        g = self.unisleep_group
        return {"rank": g.rank, "backend": g.backend, "colocated": g.colocated, "rendezvous": ticket.rendezvous}

    def unisleep_sender(self, **kw) -> WeightSender:
        if self.unisleep_group is None or self.unisleep_group.rank != 0:
            raise InvalidArgumentError("unisleep_sender(): this actor is not rank 0 of a connected group; "
                                       "call unisleep.ray.connect(trainer, engines) first")
        return WeightSender(self.unisleep_group, **kw)

    def unisleep_receiver(self, **kw) -> WeightReceiver:
        if self.unisleep_group is None or self.unisleep_group.rank == 0:
            raise InvalidArgumentError("unisleep_receiver(): this actor is not an engine of a connected group; "
                                       "call unisleep.ray.connect(trainer, engines) first")
        return WeightReceiver(self.unisleep_group, **kw)

    def unisleep_close(self) -> None:
        if self.unisleep_group is not None:
            self.unisleep_group.close()
            self.unisleep_group = None


def connect(trainer, engines: Sequence, *, name: str = "default", timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Build one transfer group of ``trainer`` (rank 0) and ``engines`` (ranks 1..N), all actors
    with :class:`TransferActor` mixed in.  The ticket (address, port, secret) goes from the trainer
    to the engines through the object store.  Returns each member's view (rank, backend, colocated)."""
    ray = require_ray()
    if not engines:
        raise InvalidArgumentError("connect() needs at least one engine actor")
    ticket = trainer.unisleep_ticket.remote(1 + len(engines), name, timeout_s)  # an ObjectRef: stays in the store
    joins = [trainer.unisleep_join.remote(ticket, 0)]
    joins += [e.unisleep_join.remote(ticket, i + 1) for i, e in enumerate(engines)]
    return ray.get(joins, timeout=timeout_s + 30)


__all__ = ["Ticket", "TransferActor", "connect", "join", "new_ticket", "node_address", "require_ray"]
