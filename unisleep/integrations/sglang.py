"""SGLang's weight-update entry points fed from :mod:`unisleep.transfer`.

A :class:`~unisleep.transfer.WeightReceiver` verifies every bucket (manifest, keyed digests,
versions) before it calls its ``apply`` with it — streaming by default: one call per bucket while
the next arrives, two bucket buffers at most (``staged=True``: after the whole update verified);
these adapters are that ``apply`` for an SGLang engine, so SGLang loads only weights that arrived
whole and unchanged:

* :class:`TensorUpdate` — colocated: ``engine.update_weights_from_tensor(named_tensors=...,
  load_format=..., flush_cache=...)`` (SGLang serialises the tensors for its scheduler itself);
* :class:`DistributedUpdate` — the process is rank 0 of SGLang's weight-update group (made by
  ``engine.init_weights_update_group(...)``): it asks the engine for
  ``update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)`` and
  broadcasts each tensor from rank 0 on that group, in the same order, as SGLang's model runner
  receives them.

``engine`` is SGLang's in-process ``sglang.Engine`` (or any object with those methods and
SGLang's keywords, e.g. a client of its HTTP server).

``load_format="flattened_bucket"``: SGLang's model runner then allocates one
``FlattenedTensorBucket`` of every tensor the request names and receives it with **one**
broadcast; :class:`DistributedUpdate` sends exactly that (SGLang's own bucket class,
``sglang.srt.weight_sync.tensor_bucket``, imported when this format is asked for).
:class:`TensorUpdate` refuses it by name: SGLang's ``Engine.update_weights_from_tensor`` then
passes its ``named_tensors`` to the scheduler unserialized, expecting one serialized bucket per TP
rank (its own ``MultiprocessingSerializer`` payload), not tensors.

:func:`init_update_group` is SGLang's rank-0 group setup: it asks the engine to
``init_weights_update_group(...)`` (SGLang's ranks join as ``rank_offset + tp_rank``) while this
process joins as rank 0 with SGLang's own ``init_custom_process_group`` — every wait bounded.
Written against sglang 0.5.10.post1 (the version AReaL 1.0.4 pins): its request types
``UpdateWeightsFromTensorReqInput`` / ``UpdateWeightsFromDistributedReqInput`` and ``Engine``
methods are what tests/test_integrations_sglang.py checks these keywords against.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

from ..errors import EngineError, InvalidArgumentError

__all__ = ["TensorUpdate", "DistributedUpdate", "dtype_name", "init_update_group", "FLATTENED_BUCKET"]

#: SGLang's load format for one flattened broadcast per update request
FLATTENED_BUCKET = "flattened_bucket"
_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
_GROUP_MODULE = "sglang.srt.utils.common"


def dtype_name(dtype) -> str:
    """The dtype as SGLang's request carries it (``getattr(torch, name)`` gives it back)."""
    return str(dtype).removeprefix("torch.")


def _pairs(named_tensors: Iterable) -> list:
    pairs = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
    for p in pairs:
        if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)):
            raise InvalidArgumentError(f"expected (name, tensor) pairs, got {p!r:.80}")
    return pairs


def _check(result: Any, what: str) -> Any:
    """SGLang answers ``(success, message)`` (or an object with ``success``/``message``)."""
    ok, msg = None, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, msg = result[0], (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        ok, msg = bool(result.success), getattr(result, "message", "")
    elif isinstance(result, dict) and "success" in result:
        ok, msg = bool(result["success"]), result.get("message", "")
    if ok is False:
        raise EngineError(f"SGLang refused {what}: {msg}")
    return result


class TensorUpdate:
    """``apply`` for a :class:`~unisleep.transfer.WeightReceiver`: hands the verified
    ``(name, tensor)`` pairs of one update to ``engine.update_weights_from_tensor``.  A refusal
    by SGLang raises :class:`~unisleep.errors.EngineError` (the receiver then keeps its previous
    version)."""

    def __init__(self, engine, *, load_format: Optional[str] = None, flush_cache: bool = True):
        if not hasattr(engine, "update_weights_from_tensor"):
            raise InvalidArgumentError(f"{type(engine).__name__} has no update_weights_from_tensor (an sglang.Engine has)")
        if load_format == FLATTENED_BUCKET:
            raise InvalidArgumentError(
                "TensorUpdate(load_format='flattened_bucket') is refused: SGLang's update_weights_from_tensor then "
                "expects one serialized FlattenedTensorBucket per TP rank, not tensors; use load_format=None "
                "(SGLang serialises the tensors itself), or DistributedUpdate(..., load_format='flattened_bucket')")
        self.engine, self.load_format, self.flush_cache = engine, load_format, flush_cache

    def __call__(self, named_tensors) -> Any:
        pairs = _pairs(named_tensors)
        return _check(self.engine.update_weights_from_tensor(
            named_tensors=pairs, load_format=self.load_format, flush_cache=self.flush_cache), "update_weights_from_tensor")


class DistributedUpdate:
    """``apply`` for a :class:`~unisleep.transfer.WeightReceiver` running as rank 0 of SGLang's
    weight-update group ``group`` (a ``torch.distributed`` group this process joined with
    SGLang's ``init_weights_update_group`` parameters): one ``update_weights_from_distributed``
    request, and each tensor broadcast from rank 0 in the request's order.  The request runs on
    a thread while the broadcasts run here; its refusal, or a failed broadcast, raises."""

    def __init__(self, engine, group, *, group_name: str = "weight_update_group", flush_cache: bool = True,
                 load_format: Optional[str] = None, src: int = 0, bucket_class=None, timeout_s: float = 300.0):
        if not hasattr(engine, "update_weights_from_distributed"):
            raise InvalidArgumentError(
                f"{type(engine).__name__} has no update_weights_from_distributed (an sglang.Engine has)")
        self.engine, self.group, self.group_name = engine, group, group_name
        self.flush_cache, self.load_format, self.src = flush_cache, load_format, src
        self.timeout_s = float(timeout_s)
        # SGLang's FlattenedTensorBucket (flattened_bucket only): given, or imported from SGLang
        self.bucket_class = bucket_class
        if load_format == FLATTENED_BUCKET and bucket_class is None:
            import importlib

            self.bucket_class = importlib.import_module(_BUCKET_MODULE).FlattenedTensorBucket

    def request(self, pairs: list) -> dict:
        """The request's keywords (``UpdateWeightsFromDistributedReqInput``'s fields)."""
        return {"names": [n for n, _ in pairs], "dtypes": [dtype_name(t.dtype) for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs], "group_name": self.group_name,
                "flush_cache": self.flush_cache, "load_format": self.load_format}

    def __call__(self, named_tensors) -> Any:
        import torch.distributed as dist

        pairs = _pairs(named_tensors)
        kwargs = self.request(pairs)
        box: dict = {}

        def ask():
            try:
                box["result"] = self.engine.update_weights_from_distributed(**kwargs)
            except BaseException as e:  # re-raised below, in the caller's thread
                box["error"] = e

        t = threading.Thread(target=ask, name="unisleep-sglang-request", daemon=True)
        t.start()
        try:
            if self.load_format == FLATTENED_BUCKET:
                # SGLang's receiver: one bucket of every named tensor, one broadcast
                flat = self.bucket_class(named_tensors=[(n, x.contiguous()) for n, x in pairs]).get_flattened_tensor()
                dist.broadcast(flat, src=self.src, group=self.group)
            else:
                for _, tensor in pairs:
                    dist.broadcast(tensor.contiguous(), src=self.src, group=self.group)
        finally:
            t.join(self.timeout_s)
        if t.is_alive():
            raise EngineError(f"SGLang's update_weights_from_distributed did not answer within {self.timeout_s:.0f} s "
                              "after every broadcast was sent")
        if "error" in box:
            raise EngineError(f"SGLang's update_weights_from_distributed failed: {box['error']}") from box["error"]
        return _check(box.get("result"), "update_weights_from_distributed")


def init_update_group(engine, *, master_port: int, world_size: int, master_address: str = "127.0.0.1",
                      group_name: str = "weight_update_group", backend: str = "gloo", rank_offset: int = 1,
                      timeout_s: float = 300.0, make_group=None, allow_remote: bool = False):
    """SGLang's weight-update group with this process as rank 0: ``engine.init_weights_update_group(
    master_address, master_port, rank_offset, world_size, group_name, backend)`` on a thread (SGLang's
    ranks join) while this process joins with SGLang's own ``init_custom_process_group`` (or
    ``make_group``, the same signature).  Returns the group for :class:`DistributedUpdate`.

    ``backend``: ``"gloo"`` (host tensors) or the platform's collective SGLang's workers use.
    SGLang's group is a plain ``torch.distributed`` group, **not authenticated**: whoever reaches
    the port can join it, so a ``master_address`` off loopback is refused unless
    ``allow_remote=True`` (docs/security.md); unisleep's own transfer group in front
    (``WeightReceiver``) is what verifies the bytes before they enter it.  Raises :class:`EngineError` when SGLang refuses or does not answer within
    ``timeout_s``."""
    import datetime

    from ..addresses import is_loopback

    if not is_loopback(master_address) and not allow_remote:
        raise InvalidArgumentError(
            f"master_address={master_address!r} is not a loopback address: SGLang's weight-update group is not "
            "authenticated (any process reaching the port joins it); keep trainer-side rank 0 and SGLang on one "
            "machine, or pass allow_remote=True on a network you trust (docs/security.md)")
    if not (isinstance(world_size, int) and world_size >= 2):
        raise InvalidArgumentError(f"world_size must count this process and SGLang's ranks (>= 2), got {world_size!r}")
    if make_group is None:
        import importlib

        make_group = importlib.import_module(_GROUP_MODULE).init_custom_process_group
    box: dict = {}

    def ask():
        try:
            box["result"] = engine.init_weights_update_group(
                master_address=master_address, master_port=int(master_port), rank_offset=int(rank_offset),
                world_size=int(world_size), group_name=group_name, backend=backend)
        except BaseException as e:  # re-raised below, in the caller's thread
            box["error"] = e

    t = threading.Thread(target=ask, name="unisleep-sglang-group", daemon=True)
    t.start()
    try:
        group = make_group(backend=backend, init_method=f"tcp://{master_address}:{int(master_port)}",
                           world_size=int(world_size), rank=0, group_name=group_name,
                           timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        t.join(timeout_s)
    if t.is_alive():
        raise EngineError(f"SGLang's init_weights_update_group did not answer within {timeout_s:.0f} s")
    if "error" in box:
        raise EngineError(f"SGLang's init_weights_update_group failed: {box['error']}") from box["error"]
    _check(box.get("result"), "init_weights_update_group")
    return group
