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
SGLang's keywords, e.g. a client of its HTTP server).  SGLang is imported by none of this.
Written against sglang 0.5.10.post1 (the version AReaL 1.0.4 pins): its request types
``UpdateWeightsFromTensorReqInput`` / ``UpdateWeightsFromDistributedReqInput`` and ``Engine``
methods are what tests/test_integrations_sglang.py checks these keywords against.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

from ..errors import EngineError, InvalidArgumentError

__all__ = ["TensorUpdate", "DistributedUpdate", "dtype_name"]


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
                 load_format: Optional[str] = None, src: int = 0):
        if not hasattr(engine, "update_weights_from_distributed"):
            raise InvalidArgumentError(
                f"{type(engine).__name__} has no update_weights_from_distributed (an sglang.Engine has)")
        self.engine, self.group, self.group_name = engine, group, group_name
        self.flush_cache, self.load_format, self.src = flush_cache, load_format, src

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
            for _, tensor in pairs:
                dist.broadcast(tensor.contiguous(), src=self.src, group=self.group)
        finally:
            t.join()
        if "error" in box:
            raise EngineError(f"SGLang's update_weights_from_distributed failed: {box['error']}") from box["error"]
        return _check(box.get("result"), "update_weights_from_distributed")
