"""vLLM in process: the :class:`~unisleep.engines.base.Engine` verbs over ``vllm.LLM``.

vLLM is imported only when an engine is built.  ``LLM`` has no pause/resume, so, as vLLM's own
docs say, pause = ``sleep(level=0)`` and resume = ``wake_up(["scheduling"])``.

    from unisleep.engines.vllm_inprocess import VLLMEngine
    eng = VLLMEngine(model_dir, enforce_eager=True, max_model_len=512,
                     kv_cache_memory_bytes=256 << 20)

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core runs in this process (a faster start)
and :meth:`VLLMEngine.sleeping_tags` reads the executor's exact tags; otherwise it
falls back to this adapter's own record.  Scripts need an ``if __name__ == "__main__":`` guard
(vLLM spawns its workers).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ..errors import EngineError, InvalidArgumentError, InvalidTransitionError, UnsupportedError
from .base import Engine, Generation
from ..vllm_worker.methods import WORKER_SLEEP_PARAMETER_NAMES, allocator_resident_bytes
from ..vllm_worker.versions import (
    AcceptanceMeter,
    draft_preservation,
    installed_vllm_version,
    level2_refusal,
    preserve_draft_kwargs,
    spec_counters_from_reader,
)
from .vllm_common import (
    check_level,
    check_mode,
    check_wake_tags,
    finish_call,
    import_error,
    no_weight_version,
    record_sleep,
    record_wake,
    sampling_params,
    to_generation,
    vllm_version,
)

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    """A ``vllm.LLM`` built in this process (or wrapped, with ``llm=``)."""

    kind = "vllm"

    def __init__(self, model: Optional[str] = None, *, llm: Any = None,
                 vllm_version: Optional[str] = None, speculative: Optional[bool] = None,
                 allow_level2_with_draft: bool = False, **llm_kwargs) -> None:
        """``vllm_version`` / ``speculative`` default to the installed vLLM and the engine's
        ``speculative_config``; they decide which known-bug workarounds apply.  An ``LLM`` built
        here with a ``speculative_config`` on vLLM >= 0.32 gets
        ``sleep_preserve_parameter_names=["draft.*"]`` unless given, so a level-2 sleep keeps the
        draft (vLLM saves and restores those parameters itself)."""
        self._vllm_version = vllm_version
        self._speculative = speculative
        self.allow_level2_with_draft = bool(allow_level2_with_draft)
        self._acceptance = AcceptanceMeter()
        if llm is None:
            if model is None:
                raise InvalidArgumentError("VLLMEngine needs a model directory or llm=")
            try:
                from vllm import LLM
            except Exception as e:  # ImportError, or a broken install
                raise import_error("vllm", e) from e
            llm_kwargs.setdefault("seed", 0)
            llm_kwargs = preserve_draft_kwargs(vllm_version or installed_vllm_version(), llm_kwargs)
            try:
                llm = LLM(model=model, **llm_kwargs)
            except Exception as e:
                raise EngineError(f"vllm.LLM({model!r}) failed: {type(e).__name__}: {e}") from e
        self.llm = llm
        self._asleep: set[str] = set()   # own record, used when the executor is out of reach
        self._paused = False

    # ---- helpers --------------------------------------------------------------------
    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (InvalidTransitionError, InvalidArgumentError):
            raise
        except Exception as e:
            raise EngineError(f"vllm.LLM.{what} failed: {type(e).__name__}: {e}") from e

    def _executor(self):
        """The model executor when the engine core runs in this process, else None."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        inner = getattr(core, "engine_core", None)   # InprocClient.engine_core -> EngineCore
        return getattr(inner, "model_executor", None)

    def version(self) -> str:
        return vllm_version()

    # ---- what the engine runs (decides the workarounds) ------------------------------
    def engine_version(self) -> Optional[str]:
        if self._vllm_version is None:
            try:
                self._vllm_version = self.version()
            except Exception:  # the version is best effort here: None means unknown
                return None
        return self._vllm_version

    def _vllm_config(self):
        return getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)

    def has_draft_model(self) -> bool:
        if self._speculative is None:
            cfg = self._vllm_config()
            if cfg is None:
                return False
            self._speculative = getattr(cfg, "speculative_config", None) is not None
        return bool(self._speculative)

    def draft_kept(self) -> tuple[bool, str]:
        """Whether a level-2 sleep keeps the draft's parameters, and why not
        (:func:`~unisleep.vllm_worker.versions.draft_preservation`): the engine's
        ``sleep_preserve_parameter_names`` checked against its workers' parameter names."""
        model_config = getattr(self._vllm_config(), "model_config", None)
        patterns = list(getattr(model_config, "sleep_preserve_parameter_names", None) or [])
        names = None
        if patterns:
            try:
                per_worker = self.llm.collective_rpc(WORKER_SLEEP_PARAMETER_NAMES)
                if per_worker and all(isinstance(n, list) for n in per_worker):
                    names = sorted({x for n in per_worker for x in n})
            except Exception as e:  # the method is missing where unisleep's vLLM plugin did not run
                log.debug("sleep parameter names not readable: %s", e)
        return draft_preservation(self.engine_version(), patterns, names)

    def kv_cache_dtype(self) -> Optional[str]:
        cache = getattr(self._vllm_config(), "cache_config", None)
        dt = getattr(cache, "cache_dtype", None)
        return None if dt is None else str(dt)

    def spec_acceptance(self) -> Optional[float]:
        """Fraction of draft tokens accepted since the previous call, from vLLM's counters
        (``LLM.get_metrics()``; needs ``disable_log_stats=False``); None when unknown."""
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # metrics off or unreadable in this vLLM: unknown (the contract)
            return None
        return self._acceptance.read(spec_counters_from_reader(metrics))

    def reload_draft(self) -> None:
        raise UnsupportedError(
            "vLLM has no call that reloads the speculative draft from its checkpoint (vLLM #52479 is "
            "open); this adapter refuses a level-2 sleep while a draft is configured unless vLLM keeps it "
            "(>= 0.32 with sleep_preserve_parameter_names=['draft.*']). Sleep at level 1, or re-send the "
            "draft's weights with start_draft_weight_update.")

    # ---- generation ----------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                 logprobs: bool = True, ignore_eos: bool = False) -> list[Generation]:
        """Refused while a guard given to :meth:`guard_serving` reports the weights torn
        (:class:`~unisleep.errors.TornWeightsError`)."""
        self.check_serving()
        sp = sampling_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, logprobs=logprobs, ignore_eos=ignore_eos)
        reqs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outs = self._call("generate", self.llm.generate, reqs, sp, use_tqdm=False)
        return [to_generation(p, o, logprobs) for p, o in zip(prompts, outs)]

    # ---- pause / resume (offline: sleep level 0 / wake scheduling) -------------------
    def pause(self, mode: str = "abort") -> None:
        check_mode(mode)
        self._call("sleep(level=0)", self.llm.sleep, level=0, mode=mode)
        self._paused = True

    def resume(self) -> None:
        self._call("wake_up(['scheduling'])", self.llm.wake_up, ["scheduling"])
        self._paused = False

    def is_paused(self) -> bool:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        inner = getattr(core, "engine_core", None)
        fn = getattr(inner, "is_scheduler_paused", None)
        return bool(fn()) if callable(fn) else self._paused

    # ---- memory ----------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        check_level(level)
        if level == 2:  # known-bug versions (vllm_versions): refuse before anything changes
            draft = self.has_draft_model()
            why = level2_refusal(self.engine_version(), has_draft=draft,
                                 kv_cache_dtype=self.kv_cache_dtype(),
                                 allow_with_draft=self.allow_level2_with_draft,
                                 draft_kept=self.draft_kept() if draft and not self.allow_level2_with_draft else None)
            if why:
                raise InvalidTransitionError(why)
        self._call(f"sleep(level={level})", self.llm.sleep, level=level, mode=mode)
        record_sleep(self._asleep, level)
        self._paused = True

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        tags = check_wake_tags(tags)
        awake = bool(self._call("wake_up", self.llm.wake_up, tags))
        record_wake(self._asleep, tags, awake)
        if tags is None or awake:
            self._paused = False
        return awake

    def is_sleeping(self) -> bool:
        return bool(self._call("llm_engine.is_sleeping", self.llm.llm_engine.is_sleeping))

    def sleeping_tags(self) -> Optional[set[str]]:
        ex = self._executor()
        tags = getattr(ex, "sleeping_tags", None)
        if tags is not None:
            return set(tags)
        return set(self._asleep)

    def resident_bytes(self) -> Optional[int]:
        """Bytes vLLM's sleep-mode allocator holds awake (its pools, all tags), read from the
        allocator in this process.  None when it cannot tell: the engine core runs in another
        process, or sleep mode is off (always on CPU, where vLLM refuses it — and its CPU worker
        frees nothing on sleep)."""
        llm = self.llm
        if llm is None or self._executor() is None:
            return None
        cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        if not getattr(cfg, "enable_sleep_mode", False):
            return None
        return allocator_resident_bytes()

    def release_kv_cache_memory(self) -> None:
        self._call("release_kv_cache_memory", self.llm.release_kv_cache_memory)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache", self.llm.reset_prefix_cache))

    def collective_rpc(self, method, *, args: Sequence[Any] = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None) -> list:
        return list(self._call(f"collective_rpc({method!r})", self.llm.collective_rpc, method,
                               timeout=timeout, args=tuple(args), kwargs=kwargs))

    def check_weights_awake(self) -> None:
        """Raise :class:`InvalidTransitionError` unless the weights are awake (vLLM #57853)."""
        tags = self.sleeping_tags()
        if tags and "weights" in tags:
            from .vllm_http import WAKE_WEIGHTS_FIRST

            raise InvalidTransitionError(WAKE_WEIGHTS_FIRST)

    def reload_weights(self, weights_path: str) -> None:
        self.check_weights_awake()
        self.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})

    # ---- weights -------------------------------------------------------------------
    def weight_version(self) -> str:
        if not hasattr(self.llm, "get_weight_version"):
            raise no_weight_version(self.engine_version())
        return str(self._call("get_weight_version", self.llm.get_weight_version))

    def set_weight_version(self, version: str) -> None:
        if not hasattr(self.llm, "update_weight_version"):
            raise no_weight_version(self.engine_version())
        self._call("update_weight_version", self.llm.update_weight_version, str(version))

    def init_weight_transfer(self, init_info: dict) -> Any:
        return self._call("init_weight_transfer_engine", self.llm.init_weight_transfer_engine,
                          {"init_info": dict(init_info)})

    def shutdown_weight_transfer(self) -> None:
        self._call("shutdown_weight_transfer_engine", self.llm.shutdown_weight_transfer_engine)

    def start_weight_update(self) -> None:
        self.check_weights_awake()
        self._call("start_weight_update", self.llm.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        self._call("finish_weight_update", finish_call, self.llm.finish_weight_update, version)

    def abort_weight_update(self) -> bool:
        """Close an update session left open by a failed send: ``update_weights({"abort":
        true})`` (see :meth:`VLLMHTTPEngine.abort_weight_update`)."""
        from .vllm_http import abort_answer_closed_session

        try:
            self.llm.update_weights({"update_info": {"abort": True}})
        except Exception as e:  # whatever vLLM raised is read: did it close the session
            return abort_answer_closed_session(str(e))
        return False

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort
            pass


__all__ = ["VLLMEngine"]
