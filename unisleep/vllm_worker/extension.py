"""unisleep's weight transfer as vLLM worker methods, called through ``collective_rpc``: the path
for every vLLM from 0.24 (the one that works on 0.24, whose weight-transfer engine API has no
update session), and the base of the RL frameworks' adapters (:mod:`unisleep.integrations`).

The workers get them from vLLM's worker extension:
``--worker-extension-cls unisleep.vllm_worker.extension.UnisleepWorkerExtension``
(``LLM(..., worker_extension_cls=...)``), or a framework's extension built on this class
(:class:`unisleep.integrations.openrlhf.UnisleepWorkerWrap`).  They are deliberately not added to
vLLM's worker class by the plugin: vLLM refuses an extension whose attributes the worker class
already has (``WorkerWrapperBase.init_worker``), so that would break every extension built on
this one.

The trainer drives them with ``VLLMWeightPusher(engine, route="extension")``
(:mod:`unisleep.engines.vllm_trainer`) — the same session as vLLM's engine protocol, under other
names, all plain-data arguments (no insecure serialization)::

    collective_rpc("unisleep_init_weight_transfer", args=(init_info,))   # join the group
    collective_rpc("unisleep_start_weight_update")                       # weights awake?
    collective_rpc("unisleep_update_weights", args=(update_info,))       # x N, while rank 0 sends
    collective_rpc("unisleep_finish_weight_update", args=(version,))     # verified, then applied
    collective_rpc("unisleep_abort_weight_update")                       # drop a broken session
    collective_rpc("unisleep_weight_version")                            # the version applied last
    collective_rpc("unisleep_shutdown_weight_transfer")

``init_info`` and ``update_info`` have the fields of the weight-transfer engine's
(:mod:`unisleep.vllm_worker.transfer_engine`); each worker keeps one
:class:`~unisleep.vllm_worker.receiver.WorkerReceiver`: each bucket checked against the manifest
and the checkpoint, then loaded at once inside one layerwise reload per update (``staging``
"host"/"device": held until complete, then applied).
"""

from __future__ import annotations

from typing import Any, Optional

METHODS = ("unisleep_init_weight_transfer", "unisleep_start_weight_update",
           "unisleep_update_weights", "unisleep_finish_weight_update",
           "unisleep_abort_weight_update", "unisleep_weight_version",
           "unisleep_shutdown_weight_transfer")


def _receiver(worker, create: bool = True):
    rx = getattr(worker, "_unisleep_receiver", None)
    if rx is None and create:
        from .receiver import WorkerReceiver

        rx = WorkerReceiver(worker)
        worker._unisleep_receiver = rx
    return rx


def _session(worker):
    rx = _receiver(worker, create=False)
    if rx is None or rx.group is None:
        raise RuntimeError("unisleep weight transfer not initialized in this worker: call "
                           "collective_rpc('unisleep_init_weight_transfer', args=(init_info,)) first")
    return rx


def unisleep_init_weight_transfer(self, init_info: dict) -> None:
    """Join the trainer's transfer group (``init_info``: rendezvous, rank_offset, world_size,
    timeout_s, group_name, secret_file, insecure, staging)."""
    rx = _receiver(self)
    rx.init_transfer_engine(rx.parse_init_info(init_info))


def unisleep_start_weight_update(self) -> None:
    """Open an update session: refuses (InvalidTransitionError) while the weights sleep."""
    _session(self).start_weight_update()


def unisleep_update_weights(self, update_info: Optional[dict] = None) -> None:
    """Receive one chunk (while rank 0 sends it) into the model (or the staging); verify
    coverage on the final one.  ``{"abort": true}`` drops the session (raises, naming the abort)."""
    _session(self).update_weights(dict(update_info or {}))


def unisleep_finish_weight_update(self, weight_version: Optional[str] = None) -> None:
    """Apply the verified update (vLLM's layerwise reload) and record ``weight_version``."""
    rx = _session(self)
    rx.finish_weight_update()
    if weight_version is not None:
        rx.last_version = str(weight_version)


def unisleep_abort_weight_update(self) -> bool:
    """Drop whatever the open session staged; the served weights stay.  True when a session was
    open."""
    rx = _receiver(self, create=False)
    return False if rx is None else rx.abort_session()


def unisleep_weight_version(self) -> Optional[str]:
    """The version of the update applied last through these methods (None: none yet)."""
    rx = _receiver(self, create=False)
    if rx is None or not rx.applied_versions:
        return None
    return rx.last_version


def unisleep_shutdown_weight_transfer(self) -> None:
    rx = _receiver(self, create=False)
    if rx is not None:
        rx.shutdown()


_FUNCTIONS = {name: globals()[name] for name in METHODS}

#: the value of vLLM's ``worker_extension_cls`` for these methods
EXTENSION = "unisleep.vllm_worker.extension.UnisleepWorkerExtension"


class UnisleepWorkerExtension:
    """vLLM ``worker_extension_cls``: the methods of this module on the worker (see the module
    docstring).  vLLM mixes it into its worker class, so ``self`` is the worker."""


for _name, _fn in _FUNCTIONS.items():
    setattr(UnisleepWorkerExtension, _name, _fn)
del _name, _fn


class ExtensionRoute:
    """The trainer's view of the worker methods: the verbs :class:`VLLMWeightPusher` calls on
    an engine, mapped to ``engine.collective_rpc`` (any unisleep vLLM adapter: in process, async
    or HTTP)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def _rpc(self, method: str, *args: Any) -> list:
        return self.engine.collective_rpc(method, args=tuple(args))

    def check_weights_awake(self) -> None:
        self.engine.check_weights_awake()

    def init_weight_transfer(self, init_info: dict) -> None:
        self._rpc("unisleep_init_weight_transfer", dict(init_info))

    def start_weight_update(self) -> None:
        self.engine.check_weights_awake()
        self._rpc("unisleep_start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._rpc("unisleep_update_weights", dict(update_info))

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        self._rpc("unisleep_finish_weight_update", version)

    def abort_weight_update(self) -> bool:
        return any(self._rpc("unisleep_abort_weight_update"))

    def weight_version(self) -> Optional[str]:
        versions = set(self._rpc("unisleep_weight_version"))
        if len(versions) > 1:
            from ..errors import EngineError

            raise EngineError(f"the workers hold different weight versions: {sorted(map(str, versions))}")
        return versions.pop() if versions else None

    def shutdown_weight_transfer(self) -> None:
        self._rpc("unisleep_shutdown_weight_transfer")


__all__ = ["UnisleepWorkerExtension", "ExtensionRoute", "METHODS", "EXTENSION"]
