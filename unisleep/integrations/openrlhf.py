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
methods; ``stateless_init_process_group`` at rank 0 returns :func:`trainer_group`; the
trainer's ``use_cuda_ipc`` reads False, so OpenRLHF's colocated default also broadcasts over
the unisleep group (which takes IPC by itself when the trainer and an engine share a device)
instead of sending handles; and ``ActorPPOTrainer.broadcast_to_vllm``, run unchanged, sees the
engines through :class:`_AnnouncingEngine`, so that a sync announcing the parameters of the
previous one goes as one streamed update (:class:`_SyncStream`; the first sync, parameter by
parameter, teaches the list).  It also sets ``UNISLEEP_OPENRLHF=1`` in the environment, so the
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
import time
from typing import Any, Optional

from ..vllm_worker.extension import UnisleepWorkerExtension, _receiver
from ..platform import env_flag
from ..vllm_worker.plugin import patch_on_import

#: "1": give OpenRLHF's ``WorkerWrap`` unisleep's weight-sync methods in this process (:func:`install`
#: sets it for the processes it starts; :func:`vllm_plugin` reads it in vLLM's worker processes)
OPENRLHF_ENV = "UNISLEEP_OPENRLHF"
from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnsupportedError

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
        opt-in: ``UNISLEEP_OPENRLHF_STAGING=host|device``) and applied whole at the last.

        ``name`` :data:`SYNC_NAME` (sent by unisleep's trainer side, never a parameter's name):
        receive a whole sync as one update instead, every tensor under its own name and checked
        the same way, and return once it is applied (``shape``: its number of tensors)."""
        rx = _receiver(self, create=False)
        if rx is None or rx.group is None:
            raise RuntimeError("update_weight before init_process_group")
        model_dtype = getattr(self.vllm_config.model_config, "dtype", None)
        if name == SYNC_NAME:
            return _receive_sync(self, rx, model_dtype)
        refusal = None
        if model_dtype is not None and _dtype_name(model_dtype) != _dtype_name(dtype):
            refusal = (f"mismatch dtype: src {_dtype_name(dtype)}, dst {_dtype_name(model_dtype)} "
                       "(OpenRLHF's check)")
        if not rx._active:
            try:
                rx.start_weight_update()  # refuses while the weights sleep; nothing received yet
            except InvalidTransitionError:
                rx.refuse_next_update()  # the trainer hears it at once, not after its timeout
                raise
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


def _receive_sync(worker, rx, model_dtype) -> None:
    """One whole OpenRLHF sync as one unisleep update, in the vLLM worker (``update_weight`` with
    :data:`SYNC_NAME`).  A refusal before anything is received (the weights asleep) answers the
    trainer's header with a refusal, so the trainer hears it at once."""
    t0 = time.perf_counter()
    try:
        rx.start_weight_update()  # refuses while the weights sleep; nothing received yet
    except InvalidTransitionError:
        rx.refuse_next_update()
        raise
    rx.rename, rx.announced = {}, {}
    # OpenRLHF's own check (the trainer's dtype is the model's), for every tensor
    rx.required_dtype = None if model_dtype is None else _dtype_name(model_dtype)
    try:
        rx.update_weights({"final": True, "partial": True})
    finally:
        rx.required_dtype = None
    rx.finish_weight_update()
    state = worker._unisleep_openrlhf
    state["round"] = state.get("round", 0) + 1
    log.debug("unisleep (OpenRLHF): sync %d of %d tensor(s) received as one update in %.3f s",
              state["round"], len(rx._seen), time.perf_counter() - t0)


class UnisleepModelUpdateGroup:
    """The trainer's side: what OpenRLHF calls on ``_model_update_group`` —
    ``broadcast(tensor, src=0, stream=None)``.

    Inside ``broadcast_to_vllm`` (which :func:`install` wraps, :func:`_one_update_per_sync`) a
    sync whose parameters are the ones OpenRLHF announced in its previous complete sync (names,
    shapes, dtypes, in order) goes as **one** unisleep update, streamed in buckets while
    OpenRLHF's loop hands the parameters over (:class:`_SyncStream`); the first sync, and a sync
    after one whose parameters differed, sends each tensor as one verified update, as OpenRLHF's
    own group does.  Outside ``broadcast_to_vllm`` every ``broadcast`` is one update."""

    def __init__(self, group, *, path: str = "auto") -> None:
        from ..transfer import WeightSender

        self.group = group
        self._sender = WeightSender(group, path=path, allow_equal_versions=False)
        self._n = 0
        #: the (name, shape, dtype name) OpenRLHF announced in its last complete sync, in order
        self.learned: Optional[list] = None
        self._sync: Optional["_SyncStream"] = None
        self._previous = None  # the sender thread of a failed sync, while it may still run
        self._resolved = None  # an already-finished Ray result (what update_weight.remote returns mid-sync)

    def _version(self) -> str:
        self._n += 1
        return f"{self._n}:{GROUP_NAME}"

    def _settle(self) -> None:
        """Wait (at most ``timeout_s``) for the sender thread of a sync that failed while it was
        still waiting for an engine's answer; TransferError if it is still running."""
        t, self._previous = self._previous, None
        if t is not None and t.is_alive():
            t.join(self.group.timeout_s)
            if t.is_alive():
                self._previous = t
                raise TransferError(f"the sender of the previous OpenRLHF sync is still waiting for an engine "
                                    f"after {self.group.timeout_s:.0f} s; nothing was sent")

    def broadcast(self, tensor, src: int = 0, stream: Any = None) -> None:
        if src != 0:
            raise InvalidArgumentError(f"the trainer is rank 0 of the group; src={src}")
        if self._sync is None or not self._sync.streaming:
            self._settle()
        if stream is not None and hasattr(stream, "synchronize"):
            stream.synchronize()  # the tensor may still be written on that stream
        if self._sync is not None and self._sync.streaming:
            self._sync.put(tensor.detach())
            return
        # the worker stages under the name OpenRLHF announced in update_weight; the group only
        # carries the bytes, under a name of its own
        self._sender.send([(TRANSFER_NAME, tensor.detach())], version=self._version())

    def close(self) -> None:
        if self._sync is not None:
            self._sync.fail(TransferError("the group was closed during a sync"))
        self._sender.close()
        self.group.close()


#: the parameter name unisleep's trainer side gives ``update_weight`` to have an engine receive a
#: whole sync as one update (no model has a parameter of that name)
SYNC_NAME = "unisleep:openrlhf-sync"


class _SyncStream:
    """One call of OpenRLHF's ``broadcast_to_vllm`` at the trainer (DeepSpeed rank 0).

    It records what OpenRLHF announces (``engine.update_weight.remote(name, dtype, shape,
    empty_cache)``, seen through :class:`_AnnouncingEngine`).  With ``learned`` (the previous
    complete sync's announcements) it *streams*: at the first announcement every engine is asked
    once to receive the whole sync (``update_weight(SYNC_NAME, ...)``, whose result OpenRLHF
    gets back at its last parameter), a sender thread runs one :meth:`WeightSender.send` over
    ``learned`` as the update's specs, and each ``broadcast`` hands its tensor to that thread.
    With ``persistent`` (the trainer's parameters outlive the call: ZeRO-1/2, no DeepSpeed
    tensor parallelism) ``broadcast`` returns at once, the thread packing the tensors it was
    handed in order; otherwise (ZeRO-3 gathers a parameter for one ``broadcast`` and frees it
    after) ``broadcast`` returns once its tensor is packed into a bucket.  The last one returns
    once every engine has verified and applied the update.  At most the sender's two buckets are
    held, whatever the model's size.  The other announcements get an
    already-resolved result at once: OpenRLHF's per-parameter ``ray.get`` costs no round trip.

    An announcement unlike the previous sync's (another name, shape, dtype or count) calls the
    update off (the engines hear why; a layer completed before keeps its new weights, the
    error's ``outcome`` says) and raises :class:`TransferError` at the next ``broadcast``; the
    next sync goes parameter by parameter again and learns the new list.  Every wait ends within
    the group's ``timeout_s``."""

    def __init__(self, owner: UnisleepModelUpdateGroup, persistent: bool = False) -> None:
        import collections
        import threading

        self.owner = owner
        self.learned = owner.learned
        self.streaming = self.learned is not None
        self.timeout_s = float(owner.group.timeout_s)
        self.announced: list = []      # engine 0's announcements: (name, shape, dtype name, last)
        self.calls: dict[int, Any] = {}  # engine index -> its one update_weight(SYNC_NAME) result
        self.error: Optional[BaseException] = None
        self._cond = threading.Condition()
        self.persistent = persistent
        self._pending = collections.deque()  # (index, tensor) handed over, not yet taken
        self._asked = -1      # the index the sender thread asked for last
        self._puts = 0        # broadcasts so far
        self._finished = False
        self._thread: Optional[threading.Thread] = None

    # ---- announcements (OpenRLHF's update_weight.remote, per engine) ----------------------
    def announce(self, i: int, engine, name, dtype, shape, empty_cache):
        if not self.streaming:
            if i == 0:
                self.announced.append((str(name), tuple(int(d) for d in shape), _dtype_name(dtype),
                                       bool(empty_cache)))
            return engine.update_weight.remote(name, dtype=dtype, shape=shape, empty_cache=empty_cache)
        import ray

        if i == 0:
            k = len(self.announced)
            got = (str(name), tuple(int(d) for d in shape), _dtype_name(dtype))
            self.announced.append(got + (bool(empty_cache),))
            want = tuple(self.learned[k]) if k < len(self.learned) else None
            last = k == len(self.learned) - 1
            if self.error is None and (want != got or bool(empty_cache) != last):
                was = (f"{want[0]!r} {want[1]} {want[2]}" if want is not None
                       else f"{len(self.learned)} parameters in all")
                self._fail(TransferError(
                    f"OpenRLHF announced parameter #{k} {got[0]!r} {got[1]} {got[2]}"
                    f"{' as its last' if empty_cache else ''} where its previous sync had {was}: this "
                    "sync was streamed as one update from the previous sync's parameters and is called "
                    "off; the next sync goes parameter by parameter and learns the new ones"))
            if k == 0 and self.error is None:
                self._start()
        if self._thread is not None and i not in self.calls:  # once the sender runs: it waits for them
            self.calls[i] = engine.update_weight.remote(SYNC_NAME, dtype=dtype, shape=(len(self.learned),),
                                                        empty_cache=True)
        if empty_cache and self.error is None:
            return self.calls[i]
        if self.owner._resolved is None:  # one finished result, for every sync of this group
            self.owner._resolved = ray.put(None)
        return self.owner._resolved

    # ---- the sender thread -------------------------------------------------------------
    def _start(self) -> None:
        import threading

        self.owner._settle()
        self._thread = threading.Thread(target=self._send, name="unisleep-openrlhf-sync", daemon=True)
        self._thread.start()

    def _send(self) -> None:
        try:
            self.owner._sender.send(self._items(), self.owner._version(), specs=[tuple(s) for s in self.learned])
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread (put/finish)
            with self._cond:
                if self.error is None:
                    self.error = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _items(self):
        for k, spec in enumerate(self.learned):
            with self._cond:
                self._asked = k
                self._cond.notify_all()
                self._wait(lambda: self.error is not None or bool(self._pending),
                           f"OpenRLHF's broadcast of parameter #{k} {spec[0]!r}")
                if self.error is not None:
                    raise self.error
                _, t = self._pending.popleft()
            yield spec[0], t

    def _wait(self, ready, what: str, watch: bool = False) -> None:
        """Wait (holding ``_cond``) until ``ready()``; TransferError after ``timeout_s``.
        ``watch``: every 0.2 s, an engine whose call ended (it can only fail before the sync's
        end) ends the wait with its words."""
        deadline = time.monotonic() + self.timeout_s
        polled = time.monotonic()
        while not ready():
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise TransferError(f"the OpenRLHF sync waited {self.timeout_s:.0f} s for {what} "
                                    "(the group's timeout_s)")
            self._cond.wait(min(left, 0.2 if watch else 1.0))
            if watch and self.error is None and not self._finished and time.monotonic() - polled >= 0.2:
                polled = time.monotonic()
                ended = self._engines_said(wait_s=0)
                if ended:
                    self.error = TransferError(f"an engine ended the sync before its last parameter: {ended}")

    def _engines_said(self, wait_s: float) -> str:
        """What the engines whose call has ended (within ``wait_s``) said, "" when none has."""
        if not self.calls:
            return ""
        import ray

        refs = list(self.calls.items())
        done, _ = ray.wait([r for _, r in refs], num_returns=len(refs), timeout=wait_s)
        said = []
        for i, ref in refs:
            if ref not in done:
                if wait_s:
                    said.append(f"engine {i}: no answer within {wait_s:.0f} s")
                continue
            try:
                ray.get(ref)
                said.append(f"engine {i}: applied the update")
            except Exception as err:  # noqa: BLE001 - its words are what is reported
                text = str(err).strip().splitlines()
                tail = next((ln for ln in reversed(text) if "served weights" in ln or "torn" in ln),
                            text[-1] if text else type(err).__name__)
                said.append(f"engine {i}: {tail.strip()[-400:]}")
        return "; ".join(said)

    # ---- the trainer's thread ----------------------------------------------------------
    def put(self, tensor) -> None:
        """OpenRLHF's ``broadcast`` of the next parameter (see the class docstring)."""
        k, self._puts = self._puts, self._puts + 1
        with self._cond:
            if self.error is None and k >= len(self.learned):
                self.error = TransferError(f"OpenRLHF broadcast {k + 1} tensors where it announced "
                                           f"{len(self.learned)}")
            if self.error is None:
                self._pending.append((k, tensor))
                self._cond.notify_all()
                last = k == len(self.learned) - 1
                if self.persistent and not last:
                    return  # the parameter outlives the sync: the thread packs it when it comes to it
                try:
                    # taken once the sender asks for the next one (or ends: the last one)
                    self._wait(lambda: self.error is not None or self._finished or
                               (not last and self._asked > k),
                               f"unisleep's sender to take parameter #{k} {self.learned[k][0]!r}", watch=True)
                except TransferError as e:
                    self.error = e
            if self.error is not None:
                self._cond.notify_all()
                raise self.error
        if tensor.device.type != "cpu":
            import torch

            torch.accelerator.synchronize()  # its copy into the bucket is done: DeepSpeed may free it

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = e
            self._cond.notify_all()

    def finish(self) -> None:
        """After OpenRLHF's loop returned: the sync learned, or its update complete."""
        if not self.streaming:
            if self.announced and self.announced[-1][3] and not any(a[3] for a in self.announced[:-1]):
                self.owner.learned = [a[:3] for a in self.announced]
            return
        self._join()
        if self.error is None and not self._finished:
            self.error = TransferError("OpenRLHF's sync ended before its last parameter")
        if self.error is not None:
            raise self.error

    def fail(self, e: BaseException) -> str:
        """OpenRLHF's loop raised (or the group closes): stop the sender (the engines hear why),
        wait for the engines' answers (within ``timeout_s``), learn again next time.  Returns
        what the engines said of their weights ("" when none was asked).  A sender still waiting
        for an engine that already failed is left to end within its own ``timeout_s``; the next
        sync waits for it first."""
        self.owner.learned = None
        if not self.streaming:
            return ""
        self._fail(e)
        said = self._engines_said(wait_s=0)
        if said and self._thread is not None and self._thread.is_alive():
            self.owner._previous = self._thread  # it waits for an engine that will not answer
            return said
        self._join()
        return self._engines_said(wait_s=self.timeout_s)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                self._fail(TransferError(f"unisleep's sender did not end within {self.timeout_s:.0f} s"))


class _AnnouncingEngine:
    """An OpenRLHF engine actor's handle as ``broadcast_to_vllm`` sees it during one sync: its
    ``update_weight.remote(...)`` goes through :meth:`_SyncStream.announce`; everything else is
    the handle's own."""

    def __init__(self, engine, sync: _SyncStream, index: int) -> None:
        self._engine, self._sync, self._index = engine, sync, index
        self.update_weight = self  # engine.update_weight.remote(...)

    def remote(self, name, dtype=None, shape=None, empty_cache=False):
        return self._sync.announce(self._index, self._engine, name, dtype, shape, empty_cache)

    def __getattr__(self, attr):
        return getattr(self._engine, attr)


def _one_update_per_sync(original):
    """OpenRLHF's ``ActorPPOTrainer.broadcast_to_vllm``, run unchanged (its gathering, its order,
    its calls), with the engines' ``update_weight`` seen through :class:`_AnnouncingEngine` at
    the rank that holds unisleep's group: see :class:`UnisleepModelUpdateGroup`."""
    if getattr(original, "_unisleep", False):
        return original

    def broadcast_to_vllm(self):
        group = getattr(self, "_model_update_group", None)
        if not isinstance(group, UnisleepModelUpdateGroup):  # another rank, or OpenRLHF's own group
            return original(self)
        engines = self.vllm_engines
        ds = getattr(getattr(getattr(self, "strategy", None), "args", None), "ds", None)
        # ZeRO-3 (and DeepSpeed's tensor parallelism) gathers each parameter for its broadcast only
        persistent = ds is not None and getattr(ds, "zero_stage", 3) != 3 and \
            int(getattr(ds, "tensor_parallel_size", 1) or 1) <= 1
        sync = group._sync = _SyncStream(group, persistent=persistent)
        self.vllm_engines = [_AnnouncingEngine(e, sync, i) for i, e in enumerate(engines)]
        try:
            original(self)
            sync.finish()
        except BaseException as e:
            said = sync.fail(e)
            if said and isinstance(e, TransferError):
                raise TransferError(f"{e}. The engines: {said}") from e
            raise
        finally:
            self.vllm_engines = engines
            group._sync = None

    broadcast_to_vllm._unisleep = True
    broadcast_to_vllm.__wrapped__ = original
    return broadcast_to_vllm


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
    module.ActorPPOTrainer.broadcast_to_vllm = _one_update_per_sync(module.ActorPPOTrainer.broadcast_to_vllm)
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
           "WORKER_METHODS", "SYNC_WITH_RAY_REFUSAL", "SYNC_NAME"]
