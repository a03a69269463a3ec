"""The weight verbs of :class:`~unisleep.engines.vllm_async.VLLMAsyncEngine`: the guard that
refuses a weight update while the weights may sleep, reloading from a checkpoint, the weight
version, and vLLM's weight-transfer session (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``, abort) — each synchronous
and as an ``a``-prefixed coroutine, run on the engine's loop through the adapter's bridge
(``_run`` / ``_await``).  The weight half of ``VLLMAsyncEngine``, as a base class."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from ..errors import InvalidTransitionError
from .vllm_common import finish_call, vllm_version


class _AsyncWeightVerbs:
    """``VLLMAsyncEngine``'s weight-update guard and weight verbs (see the module)."""

    # ---- the weight-update guard -----------------------------------------------------
    async def _check_weights_awake(self) -> None:
        """Raise :class:`InvalidTransitionError` unless the weights are known to be awake.

        Asks the engine first (``is_sleeping``).  When it reports sleeping, the weights count as
        awake only if this adapter explains that state itself: it paused the engine or put it to
        sleep, and its record shows the weights woken since.  Anything else is refused: the safe
        answer when unsure (vLLM #57853: weights sent into sleeping memory kill the engine)."""
        from .vllm_http import WAKE_WEIGHTS_FIRST

        if not await self._is_sleeping():
            return
        known = self._asleep
        if known is None or "weights" in known or not self._mine:
            raise InvalidTransitionError(WAKE_WEIGHTS_FIRST)

    def check_weights_awake(self) -> None:
        self._run("check_weights_awake", self._check_weights_awake())

    async def acheck_weights_awake(self) -> None:
        await self._await("check_weights_awake", self._check_weights_awake())

    async def _reload_weights(self, weights_path: str) -> None:
        await self._check_weights_awake()
        await self._engine().collective_rpc("reload_weights",
                                            kwargs={"weights_path": str(weights_path)})

    def reload_weights(self, weights_path: str) -> None:
        """Reload every weight from a checkpoint directory (refused while the weights sleep)."""
        self._run("reload_weights", self._reload_weights(weights_path))

    async def areload_weights(self, weights_path: str) -> None:
        await self._await("reload_weights", self._reload_weights(weights_path))

    # ---- weights -------------------------------------------------------------------
    def _versioned(self):
        """The engine, when it keeps a weight version (vLLM >= 0.27)."""
        eng = self._engine()
        if not hasattr(eng, "get_weight_version"):
            from .vllm_common import no_weight_version

            raise no_weight_version(vllm_version())
        return eng

    def weight_version(self) -> str:
        return str(self._run("get_weight_version", self._versioned().get_weight_version()))

    async def aweight_version(self) -> str:
        return str(await self._await("get_weight_version", self._versioned().get_weight_version()))

    def set_weight_version(self, version: str) -> None:
        self._run("update_weight_version", self._versioned().update_weight_version(str(version)))

    async def aset_weight_version(self, version: str) -> None:
        await self._await("update_weight_version",
                          self._versioned().update_weight_version(str(version)))

    async def _init_weight_transfer(self, init_info: dict) -> Any:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        return await self._engine().init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=dict(init_info)))

    def init_weight_transfer(self, init_info: dict) -> Any:
        return self._run("init_weight_transfer_engine", self._init_weight_transfer(init_info))

    async def ainit_weight_transfer(self, init_info: dict) -> Any:
        return await self._await("init_weight_transfer_engine",
                                 self._init_weight_transfer(init_info))

    def shutdown_weight_transfer(self) -> None:
        self._run("shutdown_weight_transfer_engine",
                  self._engine().shutdown_weight_transfer_engine())

    async def _start_weight_update(self) -> None:
        await self._check_weights_awake()
        await self._engine().start_weight_update()

    def start_weight_update(self) -> None:
        self._run("start_weight_update", self._start_weight_update())

    async def astart_weight_update(self) -> None:
        await self._await("start_weight_update", self._start_weight_update())

    async def _update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._engine().update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def update_weights(self, update_info: Any, *, timeout: Optional[float] = None) -> None:
        self._run("update_weights", self._update_weights(update_info), timeout=timeout)

    async def aupdate_weights(self, update_info: Any, *, timeout: Optional[float] = None) -> None:
        await self._await("update_weights", self._update_weights(update_info), timeout=timeout)

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        self._run("finish_weight_update", finish_call(self._engine().finish_weight_update, version))

    async def afinish_weight_update(self, version: Optional[str] = None) -> None:
        await self._await("finish_weight_update",
                          finish_call(self._engine().finish_weight_update, version))

    async def _abort_weight_update(self) -> bool:
        from .vllm_http import abort_answer_closed_session

        try:
            await self._update_weights({"abort": True})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever vLLM raised is read: did it close the session
            return abort_answer_closed_session(str(e))
        return False

    def abort_weight_update(self) -> bool:
        """Close an update session left open by a failed send: ``update_weights({"abort":
        true})`` (see :meth:`VLLMHTTPEngine.abort_weight_update`)."""
        return bool(self._run("abort_weight_update", self._abort_weight_update()))

    async def aabort_weight_update(self) -> bool:
        return bool(await self._await("abort_weight_update", self._abort_weight_update()))
