"""vLLM over HTTP: the :class:`~unisleep.engines.base.Engine` verbs mapped onto vLLM's dev-mode
routes (the launcher for a local server is :mod:`~unisleep.engines.vllm_server`).

The routes (``/sleep``, ``/wake_up``, ``/collective_rpc``, ``/update_weights`` ...) exist only
when the server runs with ``VLLM_SERVER_DEV_MODE=1``; they are unauthenticated and can free
memory, replace weights and run methods on every worker.  So the adapter talks only to a
loopback address unless told otherwise (``allow_remote=True``), and the launcher always binds
``127.0.0.1``.

    from unisleep.engines.vllm_http import VLLMHTTPEngine
    from unisleep.engines.vllm_server import launch_vllm_server
    with launch_vllm_server(model_dir) as server:
        eng = VLLMHTTPEngine(server.base_url)
        eng.pause(); eng.sleep(1); ...; eng.wake_up(["weights"]); ...; eng.resume()

Every failure becomes :class:`~unisleep.errors.EngineError` naming the route, the HTTP status
and the response body.  Moves that would break the engine (weights sent while they sleep,
vLLM #57853) raise :class:`~unisleep.errors.InvalidTransitionError` before anything is sent.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from ..addresses import is_loopback
from ..errors import EngineError, InvalidArgumentError, InvalidTransitionError, UnsupportedError
from .base import Engine, Generation
from ..vllm_worker.receiver import ABORTED as UPDATE_ABORTED
from ..vllm_worker.methods import WORKER_SLEEP_PARAMETER_NAMES
from ..vllm_worker.versions import AcceptanceMeter, draft_preservation, level2_refusal, spec_counters_from_metrics

log = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")
WAKE_WEIGHTS_FIRST = (
    "wake the weights first: the engine reports it is sleeping and its weights are not known "
    "to be awake; sending weights into sleeping memory kills the engine (vLLM #57853). "
    "Call wake_up(['weights']) (POST /wake_up?tags=weights) before the weight update."
)

#: vLLM's worker answer when no update session is open
NO_UPDATE_SESSION = "start_weight_update must be called before update_weights"


def abort_answer_closed_session(message: str) -> bool:
    """True when an error answer to ``update_weights({"abort": true})`` shows that no update
    session is left open: the unisleep engine aborted it, or none was open."""
    return UPDATE_ABORTED in message or NO_UPDATE_SESSION in message


class RemoteEngineRefusedError(InvalidArgumentError):
    """The engine URL is not a loopback address and ``allow_remote`` was not set."""


# ----------------------------------------------------------------------------- URL policy
is_loopback_host = is_loopback  # the one loopback rule (unisleep/addresses.py), by its older name here


def check_engine_url(base_url: str, *, allow_remote: bool = False) -> str:
    """Validate ``base_url`` and return it without a trailing slash.

    Raises :class:`RemoteEngineRefusedError` (a ``ValueError``) for a non-loopback host unless
    ``allow_remote`` is true, in which case a warning is logged.
    """
    if not isinstance(base_url, str) or not base_url:
        raise InvalidArgumentError(f"base_url must be a non-empty string, got {base_url!r}")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgumentError(
            f"base_url must look like http://127.0.0.1:8000, got {base_url!r}")
    if parts.username or parts.password:
        raise InvalidArgumentError("base_url must not carry credentials; pass api_key= instead")
    host = parts.hostname
    if not is_loopback_host(host):
        if not allow_remote:
            raise RemoteEngineRefusedError(
                f"refusing to drive the vLLM dev-mode routes on non-loopback host {host!r}: "
                "they are unauthenticated and can replace weights and run code on every "
                "worker. Bind the server to 127.0.0.1, or pass allow_remote=True to "
                "VLLMHTTPEngine if the host is on the trainer's private network.")
        log.warning("unisleep: driving vLLM dev-mode routes on non-loopback host %s "
                    "(allow_remote=True); keep that server off public networks", host)
    return base_url.rstrip("/")


# ----------------------------------------------------------------------------- adapter
class VLLMHTTPEngine(Engine):
    """A running vLLM server (``VLLM_SERVER_DEV_MODE=1``) driven through its HTTP routes."""

    kind = "vllm-http"

    def __init__(self, base_url: str, *, allow_remote: bool = False, timeout: float = 120.0,
                 api_key: Optional[str] = None, model: Optional[str] = None,
                 session: Any = None,
                 memory_probe: Optional[Callable[[], Optional[int]]] = None,
                 vllm_version: Optional[str] = None, speculative: Optional[bool] = None,
                 kv_cache_dtype: Optional[str] = None,
                 allow_level2_with_draft: bool = False) -> None:
        """``vllm_version``, ``speculative`` (a draft model is configured) and
        ``kv_cache_dtype`` default to what the server reports (``/version``, ``/server_info``);
        they decide which known-bug workarounds apply (:mod:`unisleep.vllm_worker.versions`)."""
        self.base_url = check_engine_url(base_url, allow_remote=allow_remote)
        self._vllm_version = vllm_version
        self._speculative = speculative
        self._kv_cache_dtype = kv_cache_dtype
        self._engine_config: Optional[dict] = None
        self.allow_level2_with_draft = bool(allow_level2_with_draft)
        self._acceptance = AcceptanceMeter()
        # vLLM's HTTP API reports no memory figures; a caller that can read the server's device
        # memory (e.g. from the accelerator's management library) passes it here
        self.memory_probe = memory_probe
        self.timeout = float(timeout)
        self._api_key = api_key
        self._model = model
        if session is None:
            import requests

            session = requests.Session()
        self._session = session
        # What this adapter itself did.  vLLM's HTTP API reports only "sleeping or not", not
        # which tags sleep, so the weight-update guard combines the report with this record.
        self._asleep: Optional[set[str]] = set()  # None = unknown (someone else may have slept)
        self._paused_by_me = False                 # this adapter paused or slept the engine
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never shows the api key
        return f"VLLMHTTPEngine({self.base_url!r}, auth={'yes' if self._api_key else 'no'})"

    # ---- transport -----------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        # one connection per request: a kept-alive connection that the server closed while idle
        # (uvicorn's keep-alive timeout) would turn the next control call into a reset whose
        # effect on the engine is unknown; on loopback a new connection costs well under 1 ms
        h = {"Accept": "application/json", "Connection": "close"}
        if self._api_key:
            h["Authorization"] = f"Bearer {self._api_key}"
        return h

    def request(self, method: str, route: str, *, params: Any = None, json: Any = None,
                timeout: Optional[float] = None, expect_json: bool = True,
                text: bool = False) -> Any:
        """Send one request; returns the decoded JSON body (None when empty).

        Any transport error or non-2xx answer raises :class:`EngineError` naming the route,
        the status and the body.
        """
        import requests

        url = self.base_url + route
        try:
            r = self._session.request(method, url, params=params, json=json,
                                      headers=self._headers(),
                                      timeout=self.timeout if timeout is None else timeout)
        except requests.RequestException as e:
            raise EngineError(f"{method} {route}: no HTTP response from {self.base_url} "
                              f"({type(e).__name__}: {_redact(str(e), self._api_key)})") from None
        body = r.text
        if not (200 <= r.status_code < 300):
            raise EngineError(f"{method} {route} -> HTTP {r.status_code}: "
                              f"{_redact(_clip(body), self._api_key)}")
        if text:
            return body
        if not expect_json or not body.strip():
            return None
        try:
            return r.json()
        except ValueError:
            raise EngineError(f"{method} {route} -> HTTP {r.status_code}: body is not JSON: "
                              f"{_clip(body)}") from None

    def _get(self, route: str, **kw) -> Any:
        return self.request("GET", route, **kw)

    def _post(self, route: str, **kw) -> Any:
        return self.request("POST", route, **kw)

    # ---- server facts ----------------------------------------------------------------
    def health(self) -> bool:
        try:
            self.request("GET", "/health", expect_json=False, timeout=min(self.timeout, 10.0))
            return True
        except EngineError:
            return False

    def version(self) -> str:
        return str(self._get("/version")["version"])

    def model_name(self) -> str:
        if self._model is None:
            data = self._get("/v1/models").get("data") or []
            if not data:
                raise EngineError("GET /v1/models -> HTTP 200: no model listed")
            self._model = data[0]["id"]
        return self._model

    # ---- generation ----------------------------------------------------------------
    def complete(self, prompt: Any, **fields) -> dict:
        """Raw ``POST /v1/completions``; returns the response body.  Refused while a guard given
        to :meth:`guard_serving` reports the weights torn (:class:`~unisleep.errors.TornWeightsError`)."""
        self.check_serving()
        body = {"model": self.model_name(), "prompt": prompt, **fields}
        return self._post("/v1/completions", json=body)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                 logprobs: bool = True, ignore_eos: bool = False) -> list[Generation]:
        self.check_serving()
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            return []
        fields: dict[str, Any] = dict(max_tokens=int(max_tokens), temperature=float(temperature),
                                      top_p=float(top_p), return_token_ids=True,
                                      ignore_eos=bool(ignore_eos))
        if seed is not None:
            fields["seed"] = int(seed)
        if logprobs:
            fields["logprobs"] = 0  # the sampled token's logprob only
        out = self.complete(prompts, **fields)
        choices = sorted(out.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise EngineError(f"POST /v1/completions -> HTTP 200: {len(choices)} choices for "
                              f"{len(prompts)} prompts")
        gens = []
        for p, c in zip(prompts, choices):
            ids = c.get("token_ids")
            if ids is None:
                raise EngineError("POST /v1/completions -> HTTP 200: no token_ids in the answer "
                                  "(server too old for return_token_ids?)")
            lps: list[float] = []
            if logprobs and c.get("logprobs"):
                lps = [float("-inf") if v is None else float(v)
                       for v in c["logprobs"].get("token_logprobs") or []]
            gens.append(Generation(prompt_ids=list(c.get("prompt_token_ids") or p),
                                   token_ids=list(ids), logprobs=lps, text=c.get("text")))
        return gens

    # ---- pause / resume --------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post("/pause", params={"mode": mode})
        self._paused_by_me = True

    def resume(self) -> None:
        self._post("/resume")
        self._paused_by_me = False

    def is_paused(self) -> bool:
        return bool(self._get("/is_paused")["is_paused"])

    # ---- what the server runs (decides the workarounds) ----------------------------------
    def engine_version(self) -> Optional[str]:
        """The server's vLLM version (``/version``, once), or the one given; None if unknown."""
        if self._vllm_version is None:
            try:
                self._vllm_version = self.version()
            except (EngineError, KeyError, TypeError):
                return None
        return self._vllm_version

    def engine_config(self) -> Optional[dict]:
        """The server's ``vllm_config`` from ``GET /server_info?config_format=json`` (a dev
        route), once; None when the server does not answer it."""
        if self._engine_config is None:
            try:
                info = self._get("/server_info", params={"config_format": "json"}) or {}
            except EngineError:
                return None
            cfg = info.get("vllm_config")
            self._engine_config = cfg if isinstance(cfg, dict) else {}
        return self._engine_config

    def has_draft_model(self) -> bool:
        """Whether the server runs speculative decoding with a draft (``speculative_config``)."""
        if self._speculative is None:
            cfg = self.engine_config()
            if cfg is None:
                return False  # cannot tell (not cached: asked again next time)
            spec = cfg.get("speculative_config")
            self._speculative = bool(spec) and spec not in ("None", "null")
        return bool(self._speculative)

    def draft_kept(self) -> tuple[bool, str]:
        """Whether a level-2 sleep keeps the draft's parameters, and why not: the server's
        ``sleep_preserve_parameter_names`` (``/server_info``) checked against its workers'
        parameter names (``/collective_rpc unisleep_sleep_parameter_names``; without that route
        only ``"draft.*"`` counts)."""
        model_config = (self.engine_config() or {}).get("model_config")
        patterns = model_config.get("sleep_preserve_parameter_names") if isinstance(model_config, dict) else None
        patterns = [str(p) for p in patterns] if isinstance(patterns, list) else []
        names = None
        if patterns:
            try:
                per_worker = self.collective_rpc(WORKER_SLEEP_PARAMETER_NAMES)
                if per_worker and all(isinstance(n, list) for n in per_worker):
                    names = sorted({str(x) for n in per_worker for x in n})
            except (EngineError, TypeError, ValueError) as e:  # route or method missing
                log.debug("sleep parameter names not readable: %s", e)
        return draft_preservation(self.engine_version(), patterns, names)

    def kv_cache_dtype(self) -> Optional[str]:
        if self._kv_cache_dtype is None:
            cache = (self.engine_config() or {}).get("cache_config")
            if isinstance(cache, dict) and cache.get("cache_dtype") is not None:
                self._kv_cache_dtype = str(cache["cache_dtype"])
        return self._kv_cache_dtype

    def spec_acceptance(self) -> Optional[float]:
        """Fraction of draft tokens accepted since the previous call, from vLLM's counters
        ``vllm:spec_decode_num_accepted_tokens`` / ``..._num_draft_tokens`` (``/metrics``);
        None without speculative decoding, metrics, or drafts since the last call."""
        try:
            text = self.request("GET", "/metrics", text=True, timeout=min(self.timeout, 10.0))
        except EngineError:
            return None
        return self._acceptance.read(spec_counters_from_metrics(text))

    def reload_draft(self) -> None:
        raise UnsupportedError(
            "vLLM has no route that reloads the speculative draft from its checkpoint (vLLM #52479 is "
            "open); this adapter refuses a level-2 sleep while a draft is configured unless vLLM keeps it "
            "(>= 0.32 with --sleep-preserve-parameter-names 'draft.*'). Sleep at level 1, or re-send the "
            "draft's weights with start_draft_weight_update.")

    # ---- memory ----------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise InvalidArgumentError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")
        if level == 2:  # known-bug versions (vllm_versions): refuse before anything is sent
            draft = self.has_draft_model()
            why = level2_refusal(self.engine_version(), has_draft=draft,
                                 kv_cache_dtype=self.kv_cache_dtype(),
                                 allow_with_draft=self.allow_level2_with_draft,
                                 draft_kept=self.draft_kept() if draft and not self.allow_level2_with_draft else None)
            if why:
                raise InvalidTransitionError(why)
        self._post("/sleep", params={"level": level, "mode": mode})
        with self._lock:
            self._paused_by_me = True
            if level >= 1 and self._asleep is not None and "weights" not in self._asleep:
                # vLLM ignores a sleep while the weights already sleep (executor no-op)
                self._asleep |= set(SLEEP_TAGS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        """Wake the named tags (all when None); returns True when the engine is fully awake."""
        if tags is not None:
            tags = list(tags)
            bad = [t for t in tags if t not in WAKE_TAGS]
            if bad or not tags:
                raise InvalidArgumentError(
                    f"wake_up tags must be a non-empty subset of {WAKE_TAGS}, got {tags!r}")
        out = self._post("/wake_up", params={"tags": tags} if tags else None) or {}
        with self._lock:
            if tags is None:
                self._asleep = set()
            elif self._asleep is not None:
                asleep_before = set(self._asleep)
                # vLLM wakes nothing when a requested memory tag is not asleep (executor check)
                mem = [t for t in tags if t in SLEEP_TAGS]
                if all(t in asleep_before for t in mem):
                    self._asleep -= set(mem)
        awake = out.get("status") == "awake"
        if awake:
            with self._lock:
                self._asleep = set()
                self._paused_by_me = False
        return awake

    def is_sleeping(self) -> bool:
        """The engine's own report.  Note: vLLM also reports True while merely paused."""
        return bool(self._get("/is_sleeping")["is_sleeping"])

    def sleeping_tags(self) -> Optional[set[str]]:
        """Memory tags asleep (None = unknown).

        vLLM's HTTP API does not say which tags sleep, so the tags come from this adapter's own
        calls — checked against vLLM's own sleep gauge (``/metrics``, :meth:`sleep_state`): when
        the record says something sleeps but the engine reports itself fully awake (a sleep that
        did not happen, or someone else woke it), the engine's report wins and this returns an
        empty set.  Without the gauge (metrics off) the record alone answers."""
        with self._lock:
            known = None if self._asleep is None else set(self._asleep)
        if known:
            gauge = self.sleep_state()
            if gauge is not None and gauge.get("awake") == 1:
                return set()
        return known

    def sleep_state(self) -> Optional[dict[str, int]]:
        """vLLM's own sleep gauge from ``GET /metrics`` (``vllm:engine_sleep_state``):
        ``{"awake": 0|1, "weights_offloaded": 0|1, "discard_all": 0|1}`` — level 1 sets
        ``weights_offloaded``, level 2 ``discard_all``.  Unlike ``/is_sleeping`` it is not set by a
        mere pause.  vLLM updates it after a sleep and after a *full* wake only.  None when the
        server exposes no such gauge (metrics off, other version)."""
        try:
            text = self.request("GET", "/metrics", text=True, timeout=min(self.timeout, 10.0))
        except EngineError:
            return None
        return parse_sleep_state(text)

    def resident_bytes(self) -> Optional[int]:
        """The engine's releasable memory from ``memory_probe`` (None without one: vLLM's HTTP API
        reports no memory figures)."""
        if self.memory_probe is None:
            return None
        n = self.memory_probe()
        return None if n is None else int(n)

    def forget_state(self) -> None:
        """Mark the sleeping tags unknown (another client may have changed them)."""
        with self._lock:
            self._asleep = None
            self._paused_by_me = False

    def release_kv_cache_memory(self) -> None:
        """``POST /release_kv_cache_memory`` (after ``sleep(level=0)``).  Not on CPU vLLM."""
        self._post("/release_kv_cache_memory")
        with self._lock:
            if self._asleep is not None:
                self._asleep.add("kv_cache")

    def reset_prefix_cache(self) -> bool:
        out = self._post("/reset_prefix_cache") or {}
        return bool(out.get("success", True))

    def collective_rpc(self, method: str, *, args: Sequence[Any] = (),
                       kwargs: Optional[Mapping[str, Any]] = None,
                       timeout: Optional[float] = None) -> list:
        """``POST /collective_rpc``: run a worker method by name; returns the per-worker results."""
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        if timeout is not None:
            body["timeout"] = float(timeout)
        out = self._post("/collective_rpc", json=body)
        return [] if out is None else list(out.get("results", []))

    def reload_weights(self, weights_path: str) -> None:
        """Reload every weight from a checkpoint directory (``collective_rpc reload_weights``)."""
        self.check_weights_awake()
        self.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})

    # ---- weights -------------------------------------------------------------------
    def weight_version(self) -> str:
        return str(self._get("/weight_info")["weight_version"])

    def set_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", json={"new_version": str(version)})

    def check_weights_awake(self) -> None:
        """Raise :class:`InvalidTransitionError` unless the weights are known to be awake.

        Asks the engine (``/is_sleeping``) first.  When it reports sleeping, the weights count
        as awake only if this adapter itself explains that state: it paused the engine, or put
        it to sleep and woke the weights (vLLM's HTTP API does not say which tags sleep, and
        ``/is_sleeping`` is also true while paused).  A state some other client caused is
        refused: the safe answer when unsure.
        """
        if not self.is_sleeping():
            return
        with self._lock:
            known = None if self._asleep is None else set(self._asleep)
            mine = self._paused_by_me
        if known is None or "weights" in known or not mine:
            raise InvalidTransitionError(WAKE_WEIGHTS_FIRST)

    def init_weight_transfer(self, init_info: dict) -> Any:
        return self._post("/init_weight_transfer_engine", json={"init_info": dict(init_info)})

    def shutdown_weight_transfer(self) -> None:
        self._post("/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.check_weights_awake()
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any, *, timeout: Optional[float] = None) -> None:
        self._post("/update_weights", json={"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        body = {} if version is None else {"weight_version": str(version)}
        self._post("/finish_weight_update", json=body)

    def abort_weight_update(self) -> bool:
        """Close an update session left open by a failed send (vLLM has no abort route).

        Sends ``/update_weights {"abort": true}``: the unisleep transfer engine drops its staging
        and answers with an error, upon which vLLM's worker closes the session.  Returns True when
        the answer shows no session is left open (aborted, or none was open), False otherwise
        (e.g. another transfer engine, which rejects the field — vLLM closes the session then
        too, but its model may be half-loaded)."""
        try:
            self._post("/update_weights", json={"update_info": {"abort": True}})
        except EngineError as e:
            return abort_answer_closed_session(str(e))
        return False

    def close(self) -> None:
        try:
            self._session.close()
        except Exception:  # pragma: no cover
            pass


def parse_sleep_state(metrics_text: Optional[str]) -> Optional[dict[str, int]]:
    """``{"awake": .., "weights_offloaded": .., "discard_all": ..}`` from Prometheus text (the
    first engine's values), or None when the gauge is absent."""
    out: dict[str, int] = {}
    for line in (metrics_text or "").splitlines():
        if not line.startswith("vllm:engine_sleep_state{"):
            continue
        labels, _, value = line.rpartition("}")
        for key in ("awake", "weights_offloaded", "discard_all"):
            if f'sleep_state="{key}"' in labels and key not in out:
                try:
                    out[key] = int(float(value.strip()))
                except ValueError:
                    pass
    return out or None


def _clip(text: str, n: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more chars]"


def _redact(text: str, secret: Optional[str]) -> str:
    return text.replace(secret, "***") if secret else text


__all__ = ["VLLMHTTPEngine", "check_engine_url", "is_loopback_host", "RemoteEngineRefusedError",
           "WAKE_WEIGHTS_FIRST", "UPDATE_ABORTED", "NO_UPDATE_SESSION", "parse_sleep_state"]
