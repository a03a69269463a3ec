"""vLLM's ``AsyncLLM`` in process: the :class:`~unisleep.engines.base.Engine` verbs over
``vllm.v1.engine.async_llm.AsyncLLM`` (the engine client behind vLLM's API server).

    from unisleep.engines.vllm_async import VLLMAsyncEngine
    eng = VLLMAsyncEngine(model_dir, enforce_eager=True, max_model_len=512,
                          kv_cache_memory_bytes=256 << 20)
    eng.generate([[0, 5, 17]], max_tokens=8)          # synchronous, like every adapter
    await eng.agenerate([[0, 5, 17]], max_tokens=8)   # the same verb for asyncio callers

**Threads and loops.**  ``AsyncLLM`` lives on one asyncio event loop (its output handler task and
its ZMQ sockets belong to that loop).  By default this adapter starts a private loop in a daemon
thread (``unisleep-asyncllm``), builds the ``AsyncLLM`` on it, and every synchronous verb submits
a coroutine there (``asyncio.run_coroutine_threadsafe``) and waits at most ``timeout_s``.  Each
verb also exists as a coroutine named with an ``a`` prefix (``agenerate``, ``apause``, ``asleep``,
``awake_up``, ``astart_weight_update``, ...): await them from any event loop; they hop to the
engine's loop when called from another one.  A synchronous verb called *on* the engine's loop
would deadlock, so it raises :class:`~unisleep.errors.InvalidTransitionError` instead.

To wrap an ``AsyncLLM`` that already runs on your loop, pass ``llm=`` and ``loop=`` (a loop running
in another thread than the synchronous callers); an ``AsyncLLM`` built outside any loop and not
used yet can be passed without ``loop=`` and is then driven by the private loop.

**How it differs from** :class:`~unisleep.engines.vllm_inprocess.VLLMEngine` (``vllm.LLM``):

* real pause verbs: ``pause_generation(mode=, clear_cache=)`` / ``resume_generation()`` /
  ``is_paused()`` (``LLM`` has to use ``sleep(level=0)`` / ``wake_up(["scheduling"])``);
* ``init_weight_transfer_engine`` / ``update_weights`` take vLLM's request dataclasses
  (``WeightTransferInitRequest`` / ``WeightTransferUpdateRequest``), not dicts;
* the engine core always runs in a child process (``AsyncMPClient``; with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker shares that process instead of a third one), so
  the executor's exact sleeping tags are out of reach: :meth:`VLLMAsyncEngine.sleeping_tags` is
  this adapter's own record, overruled by the engine when it reports itself awake, and the
  weight-update guard refuses whenever the engine reports sleeping and the record cannot show
  that this adapter itself caused that state with the weights awake (as the HTTP adapter does);
* :meth:`VLLMAsyncEngine.resident_bytes` reads vLLM's sleep-mode allocator in the worker through
  ``collective_rpc`` of a worker method by name (``unisleep_resident_bytes``, added by unisleep's
  vLLM plugin; no callable crosses vLLM's link, so no insecure serialization is needed) — with
  sleep mode on; otherwise None (always on CPU, where vLLM refuses sleep mode).

Scripts need an ``if __name__ == "__main__":`` guard (vLLM spawns the engine core).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from typing import Any, Awaitable, Optional, Sequence

from ..errors import EngineError, InvalidArgumentError, InvalidTransitionError, UnisleepError
from .base import Engine, Generation
from .vllm_async_weights import _AsyncWeightVerbs
from .vllm_common import (
    check_level,
    check_mode,
    check_wake_tags,
    import_error,
    record_sleep,
    record_wake,
    sampling_params,
    to_generation,
    vllm_version,
)

from ..vllm_worker.methods import WORKER_RESIDENT_BYTES, WORKER_SLEEP_PARAMETER_NAMES
from ..vllm_worker.versions import (
    draft_preservation,
    installed_vllm_version,
    level2_refusal,
    preserve_draft_kwargs,
)

log = logging.getLogger(__name__)

#: name of the private event-loop thread (tests look for leftovers by it)
LOOP_THREAD_NAME = "unisleep-asyncllm"

class _LoopThread:
    """A private asyncio loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=LOOP_THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(
                        asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


class VLLMAsyncEngine(_AsyncWeightVerbs, Engine):
    """A ``vllm`` ``AsyncLLM`` in this process, driven from synchronous or asyncio code.

    Build it from a model directory plus ``AsyncEngineArgs`` fields (``**engine_kwargs``), from an
    ``engine_args=AsyncEngineArgs(...)``, or wrap an existing ``llm=AsyncLLM`` (with ``loop=`` when
    it already runs on a loop of yours).  ``timeout_s`` bounds every synchronous verb (generation
    included), ``start_timeout_s`` the engine start.  :meth:`close` shuts the ``AsyncLLM`` down
    (wrapped ones too, as :class:`VLLMEngine` does) and stops the private loop.
    """

    kind = "vllm-async"

    def __init__(self, model: Optional[str] = None, *, llm: Any = None, engine_args: Any = None,
                 loop: Optional[asyncio.AbstractEventLoop] = None, timeout_s: float = 300.0,
                 start_timeout_s: float = 600.0, vllm_version: Optional[str] = None,
                 speculative: Optional[bool] = None, allow_level2_with_draft: bool = False,
                 **engine_kwargs) -> None:
        """``vllm_version`` / ``speculative`` default to the installed vLLM and the engine's
        ``speculative_config``; with ``allow_level2_with_draft`` they decide the level-2 rule
        the other vLLM adapters apply (:func:`~unisleep.vllm_worker.versions.level2_refusal`).
        Built from keyword arguments with a ``speculative_config`` on vLLM >= 0.32, the engine
        gets ``sleep_preserve_parameter_names=["draft.*"]`` unless given, so level 2 keeps the
        draft; an ``engine_args=`` or ``llm=`` is used as it is."""
        self.timeout_s = float(timeout_s)
        self._vllm_version = vllm_version
        self._speculative = speculative
        self.allow_level2_with_draft = bool(allow_level2_with_draft)
        self.llm: Any = None
        self._thread: Optional[_LoopThread] = None
        self._asleep: Optional[set[str]] = set()   # own record; None = unknown
        self._mine = False      # the current paused/sleeping state was caused by this adapter
        if llm is not None and (model is not None or engine_args is not None or engine_kwargs):
            raise InvalidArgumentError("pass either llm= or a model/engine_args, not both")
        if llm is None and engine_args is None and model is None:
            raise InvalidArgumentError("VLLMAsyncEngine needs a model directory, engine_args= "
                                       "or llm=")
        if loop is not None and llm is None:
            raise InvalidArgumentError("loop= is for wrapping an AsyncLLM already running on it "
                                       "(llm=)")
        if loop is None:
            self._thread = _LoopThread()
            loop = self._thread.loop
        self.loop = loop
        try:
            if llm is None:
                engine_args = self._engine_args(model, engine_args, engine_kwargs)
                llm = self._run("AsyncLLM.from_engine_args", self._build(engine_args),
                                timeout=start_timeout_s)
            self.llm, llm = llm, None   # no strong reference left in this (sometimes kept) frame
            # a wrapped engine may already be paused or asleep by someone else: unknown then
            if self._run("is_sleeping", self._is_sleeping()):
                self._asleep = None
        except BaseException:
            self.close()
            raise

    # ---- construction ----------------------------------------------------------------
    @staticmethod
    def _engine_args(model, engine_args, kwargs):
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
        except Exception as e:  # ImportError, or a broken install
            raise import_error("vllm", e) from e
        if engine_args is not None:
            if model is not None or kwargs:
                raise InvalidArgumentError("pass engine_args= or model + keyword arguments")
            return engine_args
        kwargs.setdefault("seed", 0)
        kwargs = preserve_draft_kwargs(installed_vllm_version(), kwargs)
        try:
            return AsyncEngineArgs(model=model, **kwargs)
        except TypeError as e:
            raise InvalidArgumentError(f"AsyncEngineArgs: {e}") from e

    @staticmethod
    async def _build(engine_args):
        from vllm.v1.engine.async_llm import AsyncLLM

        # built on the engine loop: its output handler starts there, eagerly
        return AsyncLLM.from_engine_args(engine_args)

    # ---- the bridge ------------------------------------------------------------------
    def _on_engine_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _running_loop(self, what: str, coro: Awaitable):
        """The engine's event loop, or EngineError (``coro`` closed unawaited) when it is not running."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            _close(coro)
            raise EngineError(f"AsyncLLM.{what}: the engine's event loop is not running "
                              "(engine closed?)")
        return loop

    def _run(self, what: str, coro: Awaitable, *, timeout: Optional[float] = None):
        """Run ``coro`` on the engine loop and wait for it (synchronous verbs)."""
        if self._on_engine_loop():
            _close(coro)
            raise InvalidTransitionError(
                f"{what}: a synchronous verb was called on the engine's own event loop (it "
                "would deadlock); await the a-prefixed coroutine instead (e.g. `await "
                "engine.asleep(1)`, `await engine.agenerate(...)`)")
        fut = asyncio.run_coroutine_threadsafe(coro, self._running_loop(what, coro))
        limit = self.timeout_s if timeout is None else float(timeout)
        try:
            return fut.result(limit)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EngineError(f"AsyncLLM.{what} did not finish within {limit:.0f} s "
                              "(cancelled)") from None
        except concurrent.futures.CancelledError:
            raise EngineError(f"AsyncLLM.{what} was cancelled (engine closing?)") from None
        except UnisleepError:
            raise
        except Exception as e:
            raise EngineError(f"AsyncLLM.{what} failed: {type(e).__name__}: {e}") from e

    async def _await(self, what: str, coro: Awaitable, *, timeout: Optional[float] = None):
        """Await ``coro`` on the engine loop from any loop (asynchronous verbs)."""
        limit = self.timeout_s if timeout is None else float(timeout)
        try:
            if self._on_engine_loop():
                return await asyncio.wait_for(coro, limit)
            fut = asyncio.run_coroutine_threadsafe(coro, self._running_loop(what, coro))
            try:
                return await asyncio.wait_for(asyncio.wrap_future(fut), limit)
            except asyncio.CancelledError:
                fut.cancel()
                raise
        except asyncio.TimeoutError:
            raise EngineError(f"AsyncLLM.{what} did not finish within {limit:.0f} s "
                              "(cancelled)") from None
        except UnisleepError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise EngineError(f"AsyncLLM.{what} failed: {type(e).__name__}: {e}") from e

    def _engine(self):
        if self.llm is None:
            raise EngineError("the AsyncLLM engine is closed")
        return self.llm

    def version(self) -> str:
        return vllm_version()

    # ---- generation ----------------------------------------------------------------
    async def _generate(self, prompts, sp, logprobs: bool) -> list[Generation]:
        llm = self._engine()

        async def one(p):
            final = None
            rid = f"unisleep-{uuid.uuid4().hex}"
            async for out in llm.generate({"prompt_token_ids": list(map(int, p))}, sp, rid):
                final = out
            if final is None or not final.finished:
                raise EngineError(f"request {rid} ended without a final output")
            return to_generation(p, final, logprobs)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def _gen_args(self, max_tokens, temperature, top_p, seed, logprobs, ignore_eos):
        return sampling_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, logprobs=logprobs, ignore_eos=ignore_eos,
                               final_only=True)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                 logprobs: bool = True, ignore_eos: bool = False,
                 timeout: Optional[float] = None) -> list[Generation]:
        """All prompts at once (concurrent requests); final outputs, in prompt order.  On
        timeout the requests are cancelled (vLLM aborts them).  Refused while a guard given to
        :meth:`guard_serving` reports the weights torn (:class:`~unisleep.errors.TornWeightsError`)."""
        self.check_serving()
        sp = self._gen_args(max_tokens, temperature, top_p, seed, logprobs, ignore_eos)
        return self._run("generate", self._generate(list(prompts), sp, logprobs), timeout=timeout)

    async def agenerate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16,
                        temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                        logprobs: bool = True, ignore_eos: bool = False,
                        timeout: Optional[float] = None) -> list[Generation]:
        self.check_serving()
        sp = self._gen_args(max_tokens, temperature, top_p, seed, logprobs, ignore_eos)
        return await self._await("generate", self._generate(list(prompts), sp, logprobs),
                                 timeout=timeout)

    # ---- pause / resume (AsyncLLM's own verbs) ---------------------------------------
    async def _pause(self, mode: str, clear_cache: bool) -> None:
        await self._engine().pause_generation(mode=mode, clear_cache=bool(clear_cache))
        self._mine = True

    async def _resume(self) -> None:
        await self._engine().resume_generation()
        if not self._asleep:          # nothing of ours left asleep: the engine is ours no more
            self._mine = False

    def pause(self, mode: str = "abort", *, clear_cache: bool = True) -> None:
        """``pause_generation(mode=..., clear_cache=...)``; new requests wait (abort/wait modes
        make vLLM refuse new requests until resumed, keep freezes the running ones)."""
        self._run("pause", self._pause(check_mode(mode), clear_cache))

    async def apause(self, mode: str = "abort", *, clear_cache: bool = True) -> None:
        await self._await("pause", self._pause(check_mode(mode), clear_cache))

    def resume(self) -> None:
        """``resume_generation()``.  vLLM resumes the scheduler even while memory sleeps: wake
        first (a full ``wake_up`` resumes by itself)."""
        self._run("resume", self._resume())

    async def aresume(self) -> None:
        await self._await("resume", self._resume())

    def is_paused(self) -> bool:
        return bool(self._run("is_paused", self._engine().is_paused()))

    async def ais_paused(self) -> bool:
        return bool(await self._await("is_paused", self._engine().is_paused()))

    # ---- what the engine runs (decides the workarounds) ------------------------------
    def engine_version(self) -> Optional[str]:
        if self._vllm_version is None:
            try:
                self._vllm_version = self.version()
            except Exception:  # the version only picks workarounds: unknown (None) is an answer
                return None
        return self._vllm_version

    def _vllm_config(self):
        return getattr(self.llm, "vllm_config", None)

    def has_draft_model(self) -> bool:
        if self._speculative is None:
            cfg = self._vllm_config()
            if cfg is None:
                return False
            self._speculative = getattr(cfg, "speculative_config", None) is not None
        return bool(self._speculative)

    def kv_cache_dtype(self) -> Optional[str]:
        dt = getattr(getattr(self._vllm_config(), "cache_config", None), "cache_dtype", None)
        return None if dt is None else str(dt)

    async def _draft_kept(self) -> tuple[bool, str]:
        model_config = getattr(self._vllm_config(), "model_config", None)
        patterns = list(getattr(model_config, "sleep_preserve_parameter_names", None) or [])
        names = None
        if patterns:
            try:
                per_worker = await self._engine().collective_rpc(WORKER_SLEEP_PARAMETER_NAMES)
                if per_worker and all(isinstance(n, list) for n in per_worker):
                    names = sorted({x for n in per_worker for x in n})
            except Exception as e:  # the method is missing where unisleep's vLLM plugin did not run
                log.debug("sleep parameter names not readable: %s", e)
        return draft_preservation(self.engine_version(), patterns, names)

    def draft_kept(self) -> tuple[bool, str]:
        """Whether a level-2 sleep keeps the draft's parameters, and why not: the engine's
        ``sleep_preserve_parameter_names`` checked against its workers' parameter names."""
        return self._run("draft_kept", self._draft_kept())

    async def _level2_refusal(self) -> Optional[str]:
        draft = self.has_draft_model()
        kept = await self._draft_kept() if draft and not self.allow_level2_with_draft else None
        return level2_refusal(self.engine_version(), has_draft=draft, kv_cache_dtype=self.kv_cache_dtype(),
                              allow_with_draft=self.allow_level2_with_draft, draft_kept=kept)

    # ---- memory ----------------------------------------------------------------------
    async def _sleep(self, level: int, mode: str) -> None:
        if level == 2:  # known-bug versions (vllm_versions): refuse before anything changes
            why = await self._level2_refusal()
            if why:
                raise InvalidTransitionError(why)
        await self._engine().sleep(level, mode)
        if self._asleep is not None:
            record_sleep(self._asleep, level)
        self._mine = True

    async def _wake_up(self, tags: Optional[list[str]]) -> bool:
        awake = bool(await self._engine().wake_up(tags))
        if tags is None or awake:
            self._asleep = set()
            self._mine = False
        elif self._asleep is not None:
            record_wake(self._asleep, tags, awake)
        return awake

    async def _is_sleeping(self) -> bool:
        return bool(await self._engine().is_sleeping())

    async def _sleeping_tags(self) -> Optional[set[str]]:
        known = None if self._asleep is None else set(self._asleep)
        if known and not await self._is_sleeping():
            return set()              # the engine reports itself awake: its report wins
        return known

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """``AsyncLLM.sleep(level, mode)``: level 0 pauses the scheduler (new requests queue),
        1 offloads the weights and drops the KV cache, 2 drops both."""
        self._run(f"sleep(level={level})",
                  self._sleep(check_level(level), check_mode(mode, "sleep")))

    async def asleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._await(f"sleep(level={level})",
                          self._sleep(check_level(level), check_mode(mode, "sleep")))

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        """Wake the named tags (all when None); True when the engine is fully awake (it then
        resumes scheduling by itself)."""
        return self._run("wake_up", self._wake_up(check_wake_tags(tags)))

    async def awake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        return await self._await("wake_up", self._wake_up(check_wake_tags(tags)))

    def is_sleeping(self) -> bool:
        """The engine's report (also True while merely paused: vLLM counts a paused scheduler)."""
        return self._run("is_sleeping", self._is_sleeping())

    async def ais_sleeping(self) -> bool:
        return await self._await("is_sleeping", self._is_sleeping())

    def sleeping_tags(self) -> Optional[set[str]]:
        """Memory tags asleep by this adapter's record (None = unknown), overruled by the engine
        when it reports itself awake.  ``AsyncLLM`` does not say which tags sleep."""
        return self._run("sleeping_tags", self._sleeping_tags())

    async def asleeping_tags(self) -> Optional[set[str]]:
        return await self._await("sleeping_tags", self._sleeping_tags())

    def forget_state(self) -> None:
        """Mark the sleeping tags unknown (another user of the AsyncLLM may have changed them)."""
        self._asleep = None
        self._mine = False

    def resident_bytes(self) -> Optional[int]:
        """Bytes vLLM's sleep-mode allocator holds awake, summed over the workers (read there
        through ``collective_rpc`` of the worker method the unisleep plugin adds).  None when it
        cannot tell: sleep mode off (always on CPU), or the plugin did not run in the workers."""
        llm = self.llm
        cfg = getattr(llm, "model_config", None)
        if llm is None or not getattr(cfg, "enable_sleep_mode", False):
            return None
        try:
            per_worker = self._run("collective_rpc(resident_bytes)",
                                   llm.collective_rpc(WORKER_RESIDENT_BYTES))
        except (EngineError, NotImplementedError):
            return None
        if not per_worker or any(n is None for n in per_worker):
            return None
        return sum(int(n) for n in per_worker)

    def release_kv_cache_memory(self) -> None:
        """``AsyncLLM.release_kv_cache_memory()`` (after a completed pause; fails on CPU)."""
        self._run("release_kv_cache_memory", self._engine().release_kv_cache_memory())
        if self._asleep is not None:
            self._asleep.add("kv_cache")

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        return bool(self._run("reset_prefix_cache", self._engine().reset_prefix_cache(
            bool(reset_running_requests), bool(reset_connector))))

    async def areset_prefix_cache(self, reset_running_requests: bool = False,
                                  reset_connector: bool = False) -> bool:
        return bool(await self._await("reset_prefix_cache", self._engine().reset_prefix_cache(
            bool(reset_running_requests), bool(reset_connector))))

    def collective_rpc(self, method, *, args: Sequence[Any] = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None) -> list:
        """Run a worker method by name on every worker; the per-worker results."""
        return list(self._run(f"collective_rpc({method!r})", self._engine().collective_rpc(
            method, timeout=timeout, args=tuple(args), kwargs=kwargs)))

    async def acollective_rpc(self, method, *, args: Sequence[Any] = (),
                              kwargs: Optional[dict] = None,
                              timeout: Optional[float] = None) -> list:
        return list(await self._await(f"collective_rpc({method!r})", self._engine().collective_rpc(
            method, timeout=timeout, args=tuple(args), kwargs=kwargs)))

    # ---- shutdown --------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Shut the ``AsyncLLM`` down (its engine-core process included) and stop the private
        loop.  Idempotent.  Call it from outside the engine's loop when that loop is yours."""
        llm, self.llm = self.llm, None
        thread, self._thread = self._thread, None
        if llm is not None:
            try:
                if thread is not None and thread.loop.is_running() and not self._on_engine_loop():
                    async def _shutdown():
                        llm.shutdown()

                    asyncio.run_coroutine_threadsafe(_shutdown(), thread.loop).result(timeout)
                else:
                    llm.shutdown()
            except Exception:  # pragma: no cover - best effort
                log.warning("AsyncLLM.shutdown failed", exc_info=True)
        if thread is not None:
            thread.stop(timeout)
            if thread.thread.is_alive():  # pragma: no cover
                log.warning("the %s event-loop thread did not stop within %.0f s",
                            LOOP_THREAD_NAME, timeout)
        self.loop = None

    def __del__(self):  # pragma: no cover - best effort, like AsyncLLM.__del__
        try:
            if getattr(self, "llm", None) is not None or getattr(self, "_thread", None):
                self.close()
        except Exception:  # __del__ at interpreter exit: nothing left to report to
            pass


def _close(coro) -> None:
    """Close a coroutine object that will not run (no 'never awaited' warning)."""
    close = getattr(coro, "close", None)
    if callable(close):
        close()


__all__ = ["VLLMAsyncEngine", "LOOP_THREAD_NAME"]
