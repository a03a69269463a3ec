"""The ``unisleep`` weight-transfer engine for vLLM: receives weights over :mod:`unisleep.transfer`.

Registered by :mod:`unisleep.vllm_worker.plugin`; selected with
``--weight-transfer-config '{"backend": "unisleep"}'`` (or ``LLM(...,
weight_transfer_config={"backend": "unisleep"})``).  It runs vLLM's own protocol
(``/init_weight_transfer_engine`` → ``/start_weight_update`` → ``/update_weights`` ×N →
``/finish_weight_update``) on every platform unisleep supports, CPU included: the bytes travel over
a private :class:`~unisleep.transfer.TransferGroup` (gloo on host, the platform's collective on
accelerators), never over the worker's own process group.

vLLM versions: the engine needs the session API of vLLM's ``WeightTransferEngine`` (the engine
owns ``start_weight_update`` / ``finish_weight_update``; vLLM >= 0.25).  vLLM 0.24's engine API
has no session: its worker starts the layerwise reload before the engine receives a byte, so a
refused update would leave the model unusable, and its worker synchronizes an accelerator after
every chunk (which raises on CPU).  On 0.24 the engine therefore refuses to be built, with an
error naming the path that works there: the worker extension
(:mod:`unisleep.vllm_worker.extension`, ``VLLMWeightPusher(engine, route="extension")``).

Differences from vLLM's built-in engines, on purpose:

* **Streaming by default.**  Each verified bucket is checked against the checkpoint the engine
  was loaded from (names, shapes) and loaded into the model at once, inside one layerwise reload
  per update (begun at the first bucket, finished in ``finish_weight_update``): the transfer
  holds two bucket buffers and vLLM the layer it is completing — never a second copy of the
  model.  A failure part-way ends the reload with every uncompleted layer put back; when some
  layer already holds new weights the engine's receiver is marked torn (``torn``) and the error
  says so (``outcome``); the next complete update repairs it.  Do not generate during an update:
  the model is inside vLLM's layerwise reload until ``finish_weight_update``.
  ``init_info.staging="host"`` (pageable host memory) or ``"device"`` (refused at
  ``start_weight_update`` unless the update, sized from the checkpoint, fits in 90 % of the free
  device memory) holds the whole update until ``finish_weight_update`` instead: a failed,
  corrupt or incomplete update then leaves the served weights exactly as they were — vLLM's
  engines leave the model in meta-tensor state, which kills the engine at the next forward.
* **No accelerator sync on host.**  The base ``update_weights`` calls
  ``torch.accelerator.synchronize()``, which raises on CPU.
* **Refuses to write into sleeping weights** (vLLM #57853), before anything is received and
  again before the apply: with sleep mode on, the update goes ahead only when the allocator that
  holds the weights (unisleep's, vLLM's, or a platform plugin's) reports them awake; when none
  can tell, it refuses and says why (fail closed).

init_info: ``{"rendezvous": "tcp://127.0.0.1:PORT", "rank_offset": 1, "world_size": 2,
"timeout_s": 300, "secret_file": "/path/of/a/0600/file", "staging": "none"}`` — worker rank = ``rank_offset +
dp_index * tp_pp_size + worker rank``; the trainer is rank 0.  The group secret travels as a file
path (or ``UNISLEEP_TRANSFER_SECRET_FILE`` in the engine's environment), never as the secret:
every control record of the group is authenticated with it (docs/security.md).  update_info:
``{"version": str|None, "final": true, "partial": false, "allow_equal_versions": false}`` —
versions must increase from one update to the next (the chunks of one update share theirs);
``{"abort": true}`` drops what was staged (or ends the layerwise reload) and closes vLLM's update session (vLLM has no abort
route: the call answers with an error naming :data:`~unisleep.vllm_worker.receiver.ABORTED`, and the worker
closes the session as it does for every failed chunk).
The apply step uses vLLM's ``initialize_layerwise_reload`` → ``model.load_weights`` →
``finalize_layerwise_reload``, as its own checkpoint-format engines do.  The session logic lives
in :class:`~unisleep.vllm_worker.receiver.ReceiverCore`, shared with the worker extension.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..errors import UnsupportedError
from .receiver import ReceiverCore


def _import_base():
    """vLLM's engine base module: its canonical path on vLLM main
    (``vllm.backends.distributed.weight_transfer``), else the released one."""
    import importlib

    for name in ("vllm.backends.distributed.weight_transfer.base",
                 "vllm.distributed.weight_transfer.base"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise
    raise ModuleNotFoundError("vLLM has no weight-transfer engines (vllm.distributed.weight_transfer); "
                              "unisleep's engine needs vLLM >= 0.25, its worker extension >= 0.24")


_base = _import_base()
WeightTransferEngine = _base.WeightTransferEngine
WeightTransferInitInfo = _base.WeightTransferInitInfo
WeightTransferUpdateInfo = _base.WeightTransferUpdateInfo

log = logging.getLogger(__name__)

#: True when this vLLM's engine base class owns the update session (vLLM >= 0.25)
SESSION_API = hasattr(WeightTransferEngine, "start_weight_update")

LEGACY_API_REFUSAL = (
    "unisleep's weight-transfer engine needs vLLM >= 0.25: this vLLM's engine API (0.24) starts "
    "the layerwise reload in the worker before the engine receives a byte, so a refused or broken "
    "update would leave the model unusable, and its worker synchronizes an accelerator after "
    "every chunk. Drop --weight-transfer-config (weight_transfer_config=) and use unisleep's "
    "worker extension instead: --worker-extension-cls "
    "unisleep.vllm_worker.extension.UnisleepWorkerExtension (worker_extension_cls=) with "
    "VLLMWeightPusher(engine, route='extension'), or upgrade vLLM.")


@dataclass
class UnisleepInitInfo(WeightTransferInitInfo):
    rendezvous: str = ""
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 300.0
    group_name: str = "vllm"
    secret_file: str = ""    # path of the group secret (mode 0600), never the secret itself
    insecure: bool = False   # a non-loopback group without a secret (warns)
    staging: str = "none"    # "none" (streaming), or whole-update staging: "host" or "device" (fit-checked)


@dataclass
class UnisleepUpdateInfo(WeightTransferUpdateInfo):
    version: Optional[str] = None   # expected version of this chunk (checked against the sender)
    final: bool = True              # last chunk: check coverage now
    partial: bool = False           # allow an update that covers only some tensors
    abort: bool = False             # drop the staged tensors and close the session; receives nothing
    allow_equal_versions: bool = False  # accept a version equal to the one applied last


class UnisleepWeightTransferEngine(ReceiverCore,
                                   WeightTransferEngine[UnisleepInitInfo, UnisleepUpdateInfo]):
    init_info_cls = UnisleepInitInfo
    update_info_cls = UnisleepUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device=None, model=None) -> None:
        if not SESSION_API:  # vLLM 0.24 builds engines as (config, parallel_config, model)
            log.error("unisleep weight transfer: %s", LEGACY_API_REFUSAL)
            raise UnsupportedError(LEGACY_API_REFUSAL)
        super().__init__(config, vllm_config, device, model)
        from .methods import register_worker_methods

        register_worker_methods()  # memory figures by method name (no insecure serialization)
        self._init_core()

    @staticmethod
    def trainer_send_weights(iterator: Iterable, trainer_args: Any) -> None:
        """vLLM's trainer-side entry point (abstract in vLLM 0.24-0.27's base class): send
        ``iterator``'s ``(name, tensor)`` pairs with a
        :class:`~unisleep.engines.vllm_trainer.VLLMWeightPusher`.

        ``trainer_args``: the pusher (already ``init()``-ed), or a dict ``{"pusher": pusher,
        "version": "step-7", "chunks": 1, "partial": False}``; the whole protocol (start,
        chunks, finish) runs, as :meth:`VLLMWeightPusher.push` does."""
        def is_pusher(x) -> bool:  # a VLLMWeightPusher (the trainer side, not imported into the worker)
            return callable(getattr(x, "push", None)) and callable(getattr(x, "init", None))

        args = {"pusher": trainer_args} if is_pusher(trainer_args) else trainer_args
        if not isinstance(args, dict) or not is_pusher(args.get("pusher")):
            raise TypeError("trainer_args must be a VLLMWeightPusher or {'pusher': VLLMWeightPusher, "
                            f"'version': ...}}, got {type(trainer_args).__name__}")
        version = args.get("version")
        if version is None:
            raise TypeError("trainer_args needs 'version' (the weight version being sent)")
        args["pusher"].push(iterator, version=str(version), chunks=int(args.get("chunks", 1)),
                            partial=bool(args.get("partial", False)))


__all__ = ["UnisleepWeightTransferEngine", "UnisleepInitInfo", "UnisleepUpdateInfo",
           "SESSION_API", "LEGACY_API_REFUSAL"]
