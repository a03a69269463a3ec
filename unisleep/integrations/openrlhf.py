"""OpenRLHF over :mod:`unisleep.transfer`: OpenRLHF's weight-sync calls, served by unisleep in its
own vLLM worker wrapper and its own trainer, without an edit of OpenRLHF's source.

OpenRLHF (0.11.0, which pins vLLM 0.27.1; 0.11.1/0.11.2 pin 0.29.0 with the same calls) syncs
weights per parameter: the trainer (DeepSpeed rank 0, ``ActorPPOTrainer.broadcast_to_vllm`` in
``openrlhf/trainer/ray/ppo_actor.py``) calls ``engine.update_weight.remote(name, dtype, shape,
empty_cache)`` on every vLLM engine actor — which runs ``collective_rpc("update_weight", ...)``
on the workers' ``worker_extension_cls``, OpenRLHF's ``WorkerWrap`` — and broadcasts the tensor
over ``_model_update_group`` (made by ``stateless_init_process_group`` in
``_init_vllm_sync_group``); ``empty_cache`` is True for the last parameter.  Its default when
colocated (``--vllm.sync_backend nccl`` with ``--train.colocate_all``, no
``--train.async_enable``: ``use_cuda_ipc``) sends CUDA IPC handles through
``update_weight_cuda_ipc`` instead.

:func:`install` switches all of it to unisleep in the process it runs in, by post-import hooks
(nothing of OpenRLHF is imported by it): ``WorkerWrap`` gets :class:`UnisleepWorkerWrap`'s three
methods; ``stateless_init_process_group`` at rank 0 returns :func:`trainer_group`; and the
trainer's ``use_cuda_ipc`` reads False, so OpenRLHF's colocated default also broadcasts over
the unisleep group (which takes IPC by itself when the trainer and an engine share a device)
instead of sending handles.  It also sets ``UNISLEEP_OPENRLHF=1`` in the environment, so the
vLLM workers that process starts run it too (unisleep's vLLM general plugin `unisleep-openrlhf`, :func:`vllm_plugin`, reads it).  One
line of Ray configuration runs it in every Ray worker (the trainer and the engine actors)::

    ray job submit --runtime-env-json \
        '{"worker_process_setup_hook": "unisleep.integrations.openrlhf.install"}' -- \
        python3 -m openrlhf.cli.train_ppo_ray ...

What changes for the run: every parameter is checked against the sender's manifest (shape,
dtype, keyed digest), the announced shape and dtype and the checkpoint before it is applied, then
loaded into the model as it arrives, inside one layerwise reload per sync (begun at the first
parameter, finished at the last, ``empty_cache=True``): nothing of the sync is held but the layer
vLLM is completing.  A refused parameter is not applied and ends the sync: the layers already
completed keep the new weights, the others are put back, and the error's ``outcome`` says which
(``"untouched"`` / ``"torn"``).  ``UNISLEEP_OPENRLHF_STAGING=host`` (pageable host memory) or
``device`` in the engines' environment stages the whole sync and applies it at the last
parameter instead (a broken sync then leaves the model untouched).  The group is authenticated;
sleeping weights are refused (vLLM #57853); the same code runs on CUDA, ROCm, Ascend and CPU
(gloo), over IPC when the trainer and the engine share a device.

``update_weight_cuda_ipc(name, dtype, shape, ipc_handles=None, empty_cache=False)`` receives the
same way; handles still sent to it (a trainer where :func:`install` did not run) are refused
rather than rebuilt: rebuilding calls a function received over the wire (``func(*args)`` of a
pickled handle).  ``--vllm.sync_with_ray`` is refused by name in the trainer's
``_init_vllm_sync_group``, before any engine is asked to join (unisleep does not use
``ray.util.collective``; OpenRLHF would otherwise wait in ``init_collective_group``), and by the
workers' ``init_process_group(use_ray=True)``.

The group's address is the trainer node's IP (OpenRLHF passes it, not a loopback address), so
every process needs the group secret, on one machine too: ``UNISLEEP_TRANSFER_SECRET_FILE`` (a
0600 file) in Ray's ``runtime_env.env_vars`` — docs/security.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ..vllm_worker.extension import UnisleepWorkerExtension, _receiver
from ..platform import env_flag
from ..vllm_worker.plugin import patch_on_import

#: "1": give OpenRLHF's ``WorkerWrap`` unisleep's weight-sync methods in this process (:func:`install`
#: sets it for the processes it starts; :func:`vllm_plugin` reads it in vLLM's worker processes)
OPENRLHF_ENV = "UNISLEEP_OPENRLHF"
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
            raise UnsupportedError(SYNC_WITH_RAY_REFUSAL)
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
                "unisleep group, which uses IPC by itself when colocated: run "
                "unisleep.integrations.openrlhf.install in the trainer's process too (Ray's "
                "runtime_env worker_process_setup_hook), so it broadcasts through trainer_group()")
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


#: OpenRLHF's modules :func:`install` patches when they are imported
WORKER_WRAP_MODULE = "openrlhf.trainer.ray.vllm_worker_wrap"
DIST_UTIL_MODULE = "openrlhf.utils.distributed_util"
PPO_ACTOR_MODULE = "openrlhf.trainer.ray.ppo_actor"
#: the ``WorkerWrap`` methods OpenRLHF's engine actor calls through ``collective_rpc``
WORKER_METHODS = tuple(f.__name__ for f in (UnisleepWorkerWrap.init_process_group,
                                             UnisleepWorkerWrap.update_weight,
                                             UnisleepWorkerWrap.update_weight_cuda_ipc))


def _patch_worker_wrap(module) -> None:
    for m in WORKER_METHODS:
        setattr(module.WorkerWrap, m, getattr(UnisleepWorkerWrap, m))
    log.info("unisleep (OpenRLHF): WorkerWrap's %s are unisleep's", ", ".join(WORKER_METHODS))


def _group_factory(original):
    """OpenRLHF's ``stateless_init_process_group(master_address, master_port, rank, world_size,
    device)``: rank 0 (the trainer) gets :func:`trainer_group`."""
    if getattr(original, "_unisleep", False):
        return original

    def stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
        if int(rank) != 0:
            raise UnsupportedError(
                f"OpenRLHF's stateless_init_process_group was called for rank {rank} in a process "
                "where unisleep serves OpenRLHF's weight sync: that is a vLLM worker running "
                "OpenRLHF's own WorkerWrap.init_process_group; set UNISLEEP_OPENRLHF=1 in the "
                "engines' environment (unisleep.integrations.openrlhf.install sets it for the "
                "processes it starts)")
        log.info("unisleep (OpenRLHF): the trainer's weight-sync group is unisleep's "
                 "(tcp://%s:%s, %d ranks; OpenRLHF's device argument %r not used)",
                 master_address, master_port, int(world_size), device)
        return trainer_group(master_address, master_port, world_size)

    stateless_init_process_group._unisleep = True
    stateless_init_process_group.__wrapped__ = original
    return stateless_init_process_group


def _patch_dist_util(module) -> None:
    module.stateless_init_process_group = _group_factory(module.stateless_init_process_group)


def _cuda_ipc_off(self) -> bool:
    return False


def _cuda_ipc_requested(self, value) -> None:
    self._unisleep_openrlhf_ipc_requested = bool(value)
    if value:
        log.info("unisleep (OpenRLHF): the colocated device-IPC sync goes over unisleep's group "
                 "instead (IPC by itself where the trainer and an engine share a device)")


#: what the trainer raises for ``--vllm.sync_with_ray`` (before any engine is asked to join)
SYNC_WITH_RAY_REFUSAL = (
    "unisleep serves OpenRLHF's weight sync over its own authenticated group, not over "
    "ray.util.collective: drop --vllm.sync_with_ray (OpenRLHF's default, a process group made by "
    "stateless_init_process_group, is what unisleep replaces; its colocated device-IPC default too). "
    "Nothing was started")


def _refuse_sync_with_ray(original):
    """OpenRLHF's ``ActorPPOTrainer._init_vllm_sync_group(backend)``: with
    ``--vllm.sync_with_ray`` OpenRLHF would ask every engine to join a ``ray.util.collective``
    group and wait in ``init_collective_group`` for ranks that unisleep's workers refuse to be —
    so it is refused here, in the trainer, before any engine is called."""
    if getattr(original, "_unisleep", False):
        return original

    def _init_vllm_sync_group(self, backend):
        if getattr(getattr(getattr(self, "strategy", None), "args", None), "vllm", None) is not None \
                and getattr(self.strategy.args.vllm, "sync_with_ray", False):
            raise UnsupportedError(SYNC_WITH_RAY_REFUSAL)
        return original(self, backend)

    _init_vllm_sync_group._unisleep = True
    _init_vllm_sync_group.__wrapped__ = original
    return _init_vllm_sync_group


def _patch_ppo_actor(module) -> None:
    module.stateless_init_process_group = _group_factory(module.stateless_init_process_group)
    module.ActorPPOTrainer._init_vllm_sync_group = _refuse_sync_with_ray(module.ActorPPOTrainer._init_vllm_sync_group)
    module.ActorPPOTrainer.use_cuda_ipc = property(
        _cuda_ipc_off, _cuda_ipc_requested,
        doc="False with unisleep: the colocated sync broadcasts over unisleep's group; what "
            "OpenRLHF asked for is kept in _unisleep_openrlhf_ipc_requested")


def _show_info_lines() -> None:
    """This module's INFO lines go to stderr (Ray forwards a worker's to the driver), unless
    the process configured logging itself."""
    if logging.getLogger().handlers or log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def install() -> str:
    """Serve OpenRLHF's weight sync with unisleep in this process and the processes it starts
    (see the module docstring).  Idempotent; imports nothing of OpenRLHF (each module is patched
    when it is imported, or now if it is already).  Meant for Ray's
    ``runtime_env={"worker_process_setup_hook": "unisleep.integrations.openrlhf.install"}``."""
    os.environ[OPENRLHF_ENV] = "1"
    _show_info_lines()
    patch_on_import(WORKER_WRAP_MODULE, _patch_worker_wrap)
    patch_on_import(DIST_UTIL_MODULE, _patch_dist_util)
    patch_on_import(PPO_ACTOR_MODULE, _patch_ppo_actor)
    return "hooked"


def vllm_plugin() -> str:
    """vLLM's general plugin ``unisleep-openrlhf`` (the ``vllm.general_plugins`` entry point),
    which vLLM runs in every process it starts before it resolves ``worker_extension_cls``: in a
    vLLM worker that Ray did not start, :func:`install` runs when ``UNISLEEP_OPENRLHF=1`` (which
    :func:`install` set in the process that started it).  Returns ``"hooked"`` or ``"off"``."""
    return install() if env_flag(OPENRLHF_ENV) else "off"


__all__ = ["UnisleepWorkerWrap", "UnisleepModelUpdateGroup", "trainer_group", "install", "vllm_plugin", "OPENRLHF_ENV", "GROUP_NAME",
           "WORKER_METHODS", "SYNC_WITH_RAY_REFUSAL"]
