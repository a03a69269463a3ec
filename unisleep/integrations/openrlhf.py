"""OpenRLHF over :mod:`unisleep.transfer`: a vLLM worker extension with OpenRLHF's weight-sync
methods, and the trainer's model-update group that feeds it.

OpenRLHF (0.11.0, which pins vLLM 0.27.1; 0.11.1/0.11.2 pin 0.29.0 with the same calls) syncs
weights per parameter: the trainer (DeepSpeed rank 0) calls
``engine.update_weight.remote(name, dtype, shape, empty_cache)`` on every vLLM engine actor —
which runs ``collective_rpc("update_weight", args=(name, dtype, shape, empty_cache))`` on the
workers' ``worker_extension_cls`` — and broadcasts the tensor over ``_model_update_group``
(``self._model_update_group.broadcast(param.data, src=0, stream=...)``); ``empty_cache`` is True
for the last parameter.  Two lines switch that to unisleep (docs/integrations/openrlhf.md):

* ``openrlhf/trainer/ray/vllm_engine.py`` (``create_vllm_engines``)::

      "worker_extension_cls": "unisleep.integrations.openrlhf.UnisleepWorkerWrap",

* ``openrlhf/trainer/ray/ppo_actor.py`` (``_init_vllm_sync_group``, the non-Ray branch)::

      self._model_update_group = unisleep.integrations.openrlhf.trainer_group(
          master_address, master_port, world_size)

What changes for the run: every parameter is checked against the sender's manifest (shape,
dtype, keyed digest), the announced shape and dtype and the checkpoint before it is applied, then
loaded into the model as it arrives, inside one layerwise reload per sync (begun at the first
parameter, finished at the last, ``empty_cache=True``): nothing of the sync is held but the layer
vLLM is completing.  A refused parameter is not applied and ends the sync: the layers already
completed keep the new weights, the others are put back, and the error's ``outcome`` says which
(``"untouched"`` / ``"torn"``).  ``UNISLEEP_OPENRLHF_STAGING=host`` (pageable host memory) or
``device`` in the engines' environment stages the whole sync and applies it at the last
parameter instead (a broken sync then leaves the model untouched).  The group is authenticated
(OpenRLHF's IPC path calls a function received over the wire, ``func(*args)`` of a pickled
handle); sleeping weights are refused (vLLM #57853); the same code runs on CUDA, ROCm, Ascend
and CPU (gloo), over IPC when the trainer and the engine share a device.

``update_weight_cuda_ipc(name, dtype, shape, ipc_handles=None, empty_cache=False)`` receives the
same way (the group takes IPC by itself when colocated); it refuses OpenRLHF's own
``ipc_handles`` rather than call the function they name.  OpenRLHF takes that path only with
``--vllm.sync_backend nccl``, ``--train.colocate_all`` and no ``--train.async_enable``; with
unisleep give another ``--vllm.sync_backend`` (any: unisleep picks the platform's collective)
so the trainer uses ``_model_update_group``.

The group's address is the trainer node's (OpenRLHF passes its IP): across processes of one
machine as one user nothing else is needed; otherwise give every process the group secret with
``UNISLEEP_TRANSFER_SECRET_FILE`` (a 0600 file; e.g. Ray's ``runtime_env.env_vars``) —
docs/security.md.  OpenRLHF itself is not imported here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ..vllm_worker.extension import UnisleepWorkerExtension, _receiver
from ..errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger(__name__)

#: the group name OpenRLHF uses (ppo_actor._init_vllm_sync_group)
GROUP_NAME = "openrlhf"
#: where the worker holds a sync: "none" (default: each parameter into the model as it arrives),
#: "host" or "device" (the whole sync staged, applied at its last parameter)
STAGING_ENV = "UNISLEEP_OPENRLHF_STAGING"
#: the name each broadcast tensor travels under (the worker files it under update_weight's name)
TRANSFER_NAME = "param"


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class UnisleepWorkerWrap(UnisleepWorkerExtension):
    """OpenRLHF's ``WorkerWrap`` methods (same names and arguments), backed by unisleep.transfer.
    Also carries the ``unisleep_*`` worker methods of its base class (so
    ``VLLMWeightPusher(engine, route="extension")`` works on the same engine)."""

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                           world_size: int, group_name: str, backend: Optional[str] = None,
                           use_ray: bool = False) -> None:
        """Join the trainer's group at ``tcp://master_address:master_port`` as rank
        ``rank_offset + worker rank`` (OpenRLHF's layout).  ``backend`` is not used: unisleep
        takes the platform's collective (gloo on CPU) or IPC."""
        if use_ray:
            raise UnsupportedError("unisleep's OpenRLHF worker extension does not use "
                                   "ray.util.collective: drop --vllm.sync_with_ray")
        if not group_name:
            raise InvalidArgumentError("group name must not be empty")
        import torch

        rank = int(rank_offset) + (torch.distributed.get_rank() if torch.distributed.is_initialized()
                                   else int(getattr(self.vllm_config.parallel_config, "rank", 0)))
        rx = _receiver(self)
        info = rx.parse_init_info({"rendezvous": f"tcp://{master_address}:{int(master_port)}",
                                   "rank_offset": 0, "world_size": int(world_size),
                                   "group_name": str(group_name)})
        rx.fixed_rank = rank  # OpenRLHF's layout, not vLLM's DP one
        info.staging = os.environ.get(STAGING_ENV, "none") or "none"
        rx.init_transfer_engine(info)
        self._unisleep_openrlhf = {"round": 0}
        log.info("unisleep (OpenRLHF): worker joined %s as rank %d/%d (backend %r not used)",
                 info.rendezvous, rank, world_size, backend)

    def update_weight(self, name: str, dtype, shape, empty_cache: bool = False) -> None:
        """Receive parameter ``name`` (OpenRLHF broadcasts it now), verified against the sender's
        manifest, the announced shape and dtype and the checkpoint, then loaded into the model
        at once (the default, ``staging="none"``: one layerwise reload per sync, begun at the
        first parameter and finished at ``empty_cache``, OpenRLHF's last one) or staged (an
        opt-in: ``UNISLEEP_OPENRLHF_STAGING=host|device``) and applied whole at the last."""
        rx = _receiver(self, create=False)
        if rx is None or rx.group is None:
            raise RuntimeError("update_weight before init_process_group")
        model_dtype = getattr(self.vllm_config.model_config, "dtype", None)
        refusal = None
        if model_dtype is not None and _dtype_name(model_dtype) != _dtype_name(dtype):
            refusal = (f"mismatch dtype: src {_dtype_name(dtype)}, dst {_dtype_name(model_dtype)} "
                       "(OpenRLHF's check)")
        if not rx._active:
            rx.start_weight_update()  # refuses while the weights sleep; nothing received yet
        rx.rename = {TRANSFER_NAME: name}
        # checked on arrival, before the tensor goes into the model; a mismatch is not applied
        rx.announced = {TRANSFER_NAME: (name, tuple(shape), _dtype_name(dtype), refusal)}
        try:
            rx.update_weights({"final": bool(empty_cache), "partial": True})
        finally:
            rx.rename, rx.announced = {}, {}
        if name not in rx._seen:
            tail = rx._end_failed_session()
            e = InvalidArgumentError(f"update_weight({name!r}): the trainer sent no tensor "
                                     f"{TRANSFER_NAME!r}; {tail}")
            e.outcome = "torn" if rx.torn else "untouched"
            raise e
        if empty_cache:
            rx.finish_weight_update()
            self._unisleep_openrlhf["round"] = self._unisleep_openrlhf.get("round", 0) + 1

    def update_weight_cuda_ipc(self, name: str, dtype, shape, ipc_handles=None,
                               empty_cache: bool = False) -> None:
        """As :meth:`update_weight`; the bytes come over the unisleep group (IPC when the trainer
        shares this worker's device).  OpenRLHF's own ``ipc_handles`` are refused: rebuilding
        them calls a function named by the sender."""
        if ipc_handles:
            raise UnsupportedError(
                "unisleep's OpenRLHF worker extension does not rebuild device IPC handles received "
                "over RPC (that calls a function the sender names); the weights travel over the "
                "unisleep group, which uses IPC by itself when colocated: run OpenRLHF with a "
                "--vllm.sync_backend other than its default so the trainer broadcasts through "
                "trainer_group()")
        self.update_weight(name, dtype, shape, empty_cache)


class UnisleepModelUpdateGroup:
    """The trainer's side: what OpenRLHF calls on ``_model_update_group`` —
    ``broadcast(tensor, src=0, stream=None)`` — sending each tensor as one verified unisleep
    update to every vLLM worker in the group."""

    def __init__(self, group, *, path: str = "auto") -> None:
        from ..transfer import WeightSender

        self.group = group
        self._sender = WeightSender(group, path=path, allow_equal_versions=False)
        self._n = 0

    def broadcast(self, tensor, src: int = 0, stream: Any = None) -> None:
        if src != 0:
            raise InvalidArgumentError(f"the trainer is rank 0 of the group; src={src}")
        if stream is not None and hasattr(stream, "synchronize"):
            stream.synchronize()  # the tensor may still be written on that stream
        self._n += 1
        # the worker stages under the name OpenRLHF announced in update_weight; the group only
        # carries the bytes, under a name of its own
        self._sender.send([(TRANSFER_NAME, tensor.detach())], version=f"{self._n}:{GROUP_NAME}")

    def close(self) -> None:
        self._sender.close()
        self.group.close()


def trainer_group(master_address: str, master_port: int, world_size: int, *,
                  group_name: str = GROUP_NAME, timeout_s: float = 300.0, path: str = "auto",
                  secret_file: Optional[str] = None) -> UnisleepModelUpdateGroup:
    """Rank 0 of the weight-sync group (call it where OpenRLHF calls
    ``stateless_init_process_group``; the engines join concurrently through
    ``init_process_group``)."""
    from ..transfer import TransferGroup

    g = TransferGroup.create(f"tcp://{master_address}:{int(master_port)}", rank=0,
                             world_size=int(world_size), timeout_s=timeout_s, name=group_name,
                             secret_file=secret_file)
    return UnisleepModelUpdateGroup(g, path=path)


__all__ = ["UnisleepWorkerWrap", "UnisleepModelUpdateGroup", "trainer_group", "GROUP_NAME"]
