"""The embedded default rollout engine: a small causal language model in plain PyTorch.

It runs anywhere torch runs (host memory by default, any accelerator through the platform's
driver) and behaves like a real engine towards the RL loop:

* its weights are adopted into a :class:`~unisleep.lifecycle.MemoryLifecycle` under the tag
  ``"weights"`` and its KV cache is allocated there under ``"kv_cache"`` — a sleep frees that
  memory for real, and :meth:`TorchGenerator.is_sleeping` reports the lifecycle's state;
* it generates greedily or by sampling (temperature, top-p) and returns raw full-vocabulary
  logprobs (``logprobs_mode="raw_logprobs"``, vLLM's default) or the logprobs of the processed
  distribution it sampled from (``"processed_logprobs"``);
* weight updates are written in place into the adopted parameters (addresses never move), and
  an update that did not cover every tensor raises :class:`~unisleep.errors.TransferError`;
* it refuses to generate or take weights while the memory it would touch is asleep, raising
  :class:`~unisleep.errors.InvalidTransitionError` *before* touching it — touching sleeping host
  memory would kill the process with SIGSEGV;
* it refuses to generate or score while its weights are torn — an update that failed part-way
  with no retained backup to roll back to marked its lifecycle (or its receiver) torn — raising
  :class:`~unisleep.errors.TornWeightsError`, which names the incomplete version, until a
  complete update arrives.

:func:`sequence_logprobs` is the trainer-side scorer of the same model (full forward, no cache).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError
from ..lifecycle import AWAKE, MemoryLifecycle
from .base import Engine, Generation
from .tiny_lm_config import TinyLMConfig

log = logging.getLogger("unisleep.engines.torch")

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
PAUSE_MODES = ("abort", "wait", "keep")


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class TinyLM(nn.Module):
    """A small pre-norm transformer.  ``forward(ids)`` scores a whole sequence (the trainer);
    ``forward(ids, kv=cache, pos0=p)`` writes keys/values into ``cache`` (the engine)."""

    def __init__(self, config: TinyLMConfig = TinyLMConfig()):
        super().__init__()
        if config.d_model % config.n_heads:
            raise InvalidArgumentError("d_model must be a multiple of n_heads")
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            d = config.d_model
            self.tok = nn.Embedding(config.vocab_size, d)
            self.pos = nn.Embedding(config.max_len, d)
            self.blocks = nn.ModuleList(_Block(d) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, config.vocab_size, bias=False)

    def kv_shape(self, max_batch: int) -> tuple[int, ...]:
        c = self.config
        return (c.n_layers, 2, max_batch, c.n_heads, c.max_len, c.d_model // c.n_heads)

    def forward(self, ids: torch.Tensor, *, kv: Optional[torch.Tensor] = None, pos0: int = 0) -> torch.Tensor:
        c = self.config
        B, T = ids.shape
        if pos0 + T > c.max_len:
            raise InvalidArgumentError(f"sequence of {pos0 + T} tokens exceeds max_len={c.max_len}")
        H, hd = c.n_heads, c.d_model // c.n_heads
        positions = torch.arange(pos0, pos0 + T, device=ids.device)
        x = self.tok(ids) + self.pos(positions)[None]
        S = pos0 + T
        # query at absolute position pos0+i sees keys 0..pos0+i
        mask = torch.arange(S, device=ids.device)[None, :] > positions[:, None]
        for layer, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(blk.ln1(x)).split(c.d_model, dim=-1)
            q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v))
            if kv is not None:
                kv[layer, 0, :B, :, pos0:S] = k
                kv[layer, 1, :B, :, pos0:S] = v
                k, v = kv[layer, 0, :B, :, :S], kv[layer, 1, :B, :, :S]
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, c.d_model)
            x = x + blk.proj(y)
            x = x + blk.fc2(torch.nn.functional.gelu(blk.fc1(blk.ln2(x))))
        return self.head(self.ln_f(x))


def decode_loop(logits, next_logits, prompt_len: int, max_tokens: int, temperature: float, top_p: float, rng,
                logprobs_mode: str):
    """Sample ``max_tokens`` tokens from the last-position ``logits`` of a batch: greedy at
    temperature 0, else temperature + top-p; ``next_logits(tokens, position)`` runs one decode
    step.  Returns (tokens, logprobs) on the CPU, the logprobs raw or of the processed
    distribution as ``logprobs_mode`` says (vLLM's ``raw_logprobs`` / ``processed_logprobs``)."""
    import torch

    toks, lps = [], []
    for t in range(max_tokens):
        raw = logits.log_softmax(dim=-1)
        if temperature == 0.0:
            tok = raw.argmax(dim=-1)
            proc = raw
        else:
            masked, _ = top_p_filter(logits / temperature, top_p)
            proc = masked.log_softmax(dim=-1)
            tok = torch.multinomial(proc.exp(), 1, generator=rng).squeeze(-1)
        chosen = raw if logprobs_mode == "raw_logprobs" else proc
        toks.append(tok)
        lps.append(chosen.gather(-1, tok[:, None]).squeeze(-1))
        if t + 1 < max_tokens:
            logits = next_logits(tok, prompt_len + t)
    return torch.stack(toks, 1).cpu(), torch.stack(lps, 1).cpu()


def top_p_filter(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask logits outside the smallest set of tokens whose probability reaches ``top_p``.
    Returns ``(masked_logits, kept_mass)``; kept_mass is that set's probability."""
    if top_p >= 1.0:
        return logits, torch.ones(logits.shape[:-1], dtype=logits.dtype, device=logits.device)
    probs = logits.softmax(dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
    keep_sorted = before < top_p  # always keeps the top token
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept_mass = (probs * keep).sum(dim=-1)
    return logits.masked_fill(~keep, float("-inf")), kept_mass


def sequence_logprobs(
    model: TinyLM, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *, top_p: float = 1.0,
    with_kept_mass: bool = False,
):
    """The trainer's view: full-vocabulary logprobs of ``completion_ids`` after ``prompt_ids``
    (both ``[B, T]``), from one full forward pass.  With ``with_kept_mass`` it also returns the
    mass a top-``top_p`` filter keeps at each position (for the gap monitor)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    logits = model(ids)[:, P - 1 : P + C - 1].float()
    lps = logits.log_softmax(dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    if not with_kept_mass:
        return lps
    _, kept = top_p_filter(logits, top_p)
    return lps, kept


class TorchGenerator(Engine):
    """A :class:`TinyLM` rollout engine on lifecycle memory.  See the module docstring."""

    kind = "torch"

    def __init__(
        self,
        config: Optional[TinyLMConfig] = None,
        *,
        lifecycle: Optional[MemoryLifecycle] = None,
        platform: Any = None,
        max_batch: int = 64,
        logprobs_mode: str = "raw_logprobs",
        seed: int = 0,
    ):
        if logprobs_mode not in LOGPROBS_MODES:
            raise InvalidArgumentError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if max_batch < 1:
            raise InvalidArgumentError("max_batch must be >= 1")
        self.config = config or TinyLMConfig()
        self._own_lifecycle = lifecycle is None
        self.lifecycle = lifecycle if lifecycle is not None else MemoryLifecycle(platform)
        self.logprobs_mode = logprobs_mode
        self.max_batch = max_batch
        model = TinyLM(self.config)
        model.requires_grad_(False)
        model.eval()
        self.lifecycle.adopt(model, tag="weights")
        self.model = model
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.kv_cache = self.lifecycle.empty(model.kv_shape(max_batch), torch.float32, tag="kv_cache")
        self.device = self.kv_cache.device
        self._start(seed)

    def _start(self, seed: int) -> None:
        """The serving state every engine of this kind starts with (after its KV cache exists)."""
        import torch

        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(seed)
        self._version = "0"
        self._paused = False
        self._pause_mode: Optional[str] = None
        self._updating: Optional[set[str]] = None
        self._closed = False
        self._receiver = None

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, str]:
        """The lifecycle's state per tag (``"awake"``, ``"offloaded"``, ``"discarded"``)."""
        return self.lifecycle.state()

    def is_sleeping(self) -> bool:
        return self.lifecycle.is_sleeping

    def sleeping_tags(self) -> Optional[set[str]]:
        return {t for t, s in self.lifecycle.state().items() if s != AWAKE}

    def resident_bytes(self, tag: Optional[str] = None) -> int:
        """Physical bytes held now, read from the backend."""
        return self.lifecycle.resident_bytes(tag)

    def allocated_bytes(self, tag: Optional[str] = None) -> int:
        return self.lifecycle.allocated_bytes(tag)

    def parameter_names(self) -> list[str]:
        return list(self._params)

    def _require_awake(self, tags: Iterable[str], doing: str) -> None:
        if self._closed:
            raise InvalidTransitionError(f"cannot {doing}: the engine is closed")
        self.lifecycle._check_open()  # a lifecycle closed under the engine: LifecycleClosedError
        st = self.lifecycle.state()
        asleep = {t: st[t] for t in tags if st.get(t, AWAKE) != AWAKE}
        if asleep:
            detail = ", ".join(f"{t}={s}" for t, s in sorted(asleep.items()))
            raise InvalidTransitionError(
                f"cannot {doing}: engine memory is asleep ({detail}); touching it would crash the process "
                f"(SIGSEGV on host, illegal address on an accelerator). Call wake_up({sorted(asleep)!r}) first — "
                "nothing was touched."
            )

    def check_serving(self) -> None:
        """Raise :class:`~unisleep.errors.TornWeightsError` while the weights are torn: marked so
        on the engine's lifecycle (by a :class:`~unisleep.transfer.WeightReceiver` guarded by it),
        on the receiver of :meth:`init_weight_transfer`, or on a guard given to
        :meth:`guard_serving`.  Flag checks only."""
        self.lifecycle.check_serving()
        rx = self._receiver
        if rx is not None:
            rx.check_serving()
        super().check_serving()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16, temperature: float = 0.0,
        top_p: float = 1.0, seed: Optional[int] = None, logprobs: bool = True,
    ) -> list[Generation]:
        if self._paused:
            raise InvalidTransitionError("the engine is paused; call resume() before generating")
        if self._updating is not None:
            raise InvalidTransitionError("a weight update is in progress; finish_weight_update() first")
        self._require_awake(("weights", "kv_cache"), "generate")
        self.check_serving()
        if max_tokens < 1:
            raise InvalidArgumentError("max_tokens must be >= 1")
        if temperature < 0 or not (0.0 < top_p <= 1.0):
            raise InvalidArgumentError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
        V = self.config.vocab_size
        for p in prompts:
            if not p or any(not (0 <= int(t) < V) for t in p):
                raise InvalidArgumentError(f"prompt {list(p)!r} is empty or has ids outside [0, {V})")
            if len(p) + max_tokens > self.config.max_len:
                raise InvalidArgumentError(
                    f"prompt of {len(p)} + {max_tokens} new tokens exceeds max_len={self.config.max_len}")
        rng = self._rng
        if seed is not None:
            rng = torch.Generator(device=self.device)
            rng.manual_seed(seed)
        out: list[Optional[Generation]] = [None] * len(prompts)
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        with torch.no_grad():
            for _, idxs in sorted(by_len.items()):
                for s in range(0, len(idxs), self.max_batch):
                    chunk = idxs[s : s + self.max_batch]
                    ids = torch.tensor([list(map(int, prompts[i])) for i in chunk], device=self.device)
                    toks, lps = self._decode(ids, max_tokens, temperature, top_p, rng)
                    for row, i in enumerate(chunk):
                        out[i] = Generation(
                            prompt_ids=[int(t) for t in prompts[i]],
                            token_ids=toks[row].tolist(),
                            logprobs=lps[row].tolist() if logprobs else [],
                        )
        return out  # type: ignore[return-value]

    def _decode(self, ids, max_tokens, temperature, top_p, rng):
        B, P = ids.shape
        return decode_loop(
            self.model(ids, kv=self.kv_cache, pos0=0)[:, -1].float(),
            lambda tok, pos: self.model(tok[:, None], kv=self.kv_cache, pos0=pos)[:, -1].float(),
            P, max_tokens, temperature, top_p, rng, self.logprobs_mode,
        )

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Full-vocabulary logprobs of ``completion_ids`` under the engine's current weights."""
        self._require_awake(("weights",), "score")
        self.check_serving()
        with torch.no_grad():
            return sequence_logprobs(
                self.model, torch.tensor(prompt_ids, device=self.device), torch.tensor(completion_ids, device=self.device)
            ).cpu()

    def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        # generation is synchronous here: when pause() runs, no request is in flight
        self._paused, self._pause_mode = True, mode

    def resume(self) -> None:
        self._paused, self._pause_mode = False, None

    def is_paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ memory
    def release_cache(self) -> None:
        """Give the framework allocator's cached blocks on the engine's device back to the device:
        what generation and a staged weight update left there (the received buckets are freed
        after the update but stay cached until now), and what its device libraries kept (the
        platform's ``release_library_caches``: on CUDA torch's cuBLAS workspaces).  A no-op on host."""
        if self.device.type == "cpu":
            return
        from ..registry import backend_of

        described = backend_of(self.lifecycle.driver)
        if described is not None:
            described.release_library_caches()
        mod = getattr(torch, self.device.type, None)
        if mod is not None and hasattr(mod, "empty_cache"):
            mod.empty_cache()

    def sleep(self, level: int = 1) -> None:
        if self._updating is not None:
            raise InvalidTransitionError("a weight update is in progress; finish it before sleeping")
        if self._closed:
            raise InvalidTransitionError("the engine is closed")
        self.release_cache()  # a sleeping engine keeps no cached framework memory either
        self.lifecycle.sleep(level)

    def sleep_to_free(self, level: int, nbytes: int) -> Optional[dict]:
        """A budgeted sleep of the engine's lifecycle: the KV cache first, then (what a level
        puts to sleep of) the weights, region by region, until ``nbytes`` are free."""
        if self._updating is not None:
            raise InvalidTransitionError("a weight update is in progress; finish it before sleeping")
        if self._closed:
            raise InvalidTransitionError("the engine is closed")
        self.release_cache()
        order = ["kv_cache"] if self.lifecycle.state().get("kv_cache") == AWAKE else []
        return self.lifecycle.sleep(level, free_at_least=nbytes, free_order=order).budget

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        self.lifecycle.wake_up(tags)

    # ------------------------------------------------------------------ weights
    def weight_version(self) -> str:
        return self._version

    def set_weight_version(self, version: str) -> None:
        self._version = str(version)

    def start_weight_update(self) -> None:
        self._require_awake(("weights",), "start a weight update")
        if self._updating is not None:
            raise InvalidTransitionError("a weight update is already in progress")
        self._updating = set()

    def update_weights(self, update_info: Any) -> None:
        """Copy ``[(name, tensor), ...]`` (or a mapping) into the adopted parameters, in place.
        Every name and shape is checked before the first byte is written."""
        if self._updating is None:
            raise InvalidTransitionError("call start_weight_update() before update_weights()")
        self._require_awake(("weights",), "write weights")
        items = list(update_info.items()) if hasattr(update_info, "items") else list(update_info)
        for name, t in items:
            p = self._params.get(name)
            if p is None:
                raise TransferError(f"unknown parameter {name!r}; the engine has: {', '.join(list(self._params)[:6])} ...")
            if tuple(t.shape) != tuple(p.shape):
                raise TransferError(f"parameter {name!r}: shape {tuple(t.shape)} != engine's {tuple(p.shape)}")
        with torch.no_grad():
            for name, t in items:
                self._params[name].copy_(t.to(device=self.device, dtype=self._params[name].dtype))
                self._updating.add(name)

    def finish_weight_update(self, version: Optional[str] = None) -> None:
        if self._updating is None:
            raise InvalidTransitionError("no weight update in progress")
        got, self._updating = self._updating, None
        missing = [n for n in self._params if n not in got]
        if missing:
            raise TransferError(
                f"incomplete weight update: {len(missing)} of {len(self._params)} tensors never arrived "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); the engine now holds a mix of "
                f"versions and stays labelled {self._version!r}. Re-send the full set before generating."
            )
        self._whole()
        if version is not None:
            self._version = str(version)

    def _whole(self) -> None:
        """Every tensor was just written by one update: a torn mark left by an earlier update that
        failed part-way goes (on the lifecycle, and on this engine's receiver)."""
        if self.lifecycle.torn is not None:
            self.lifecycle.clear_torn()
        rx = self._receiver
        if rx is not None and rx.torn is not None:
            rx.torn = None

    def abort_weight_update(self) -> None:
        """Drop an unfinished update (its tensors may already be written: re-send the full set)."""
        self._updating = None

    def load_weights(self, named_tensors: Any, version: Optional[str] = None) -> None:
        """start + update + finish in one call (single-process use)."""
        self.start_weight_update()
        try:
            self.update_weights(named_tensors)
        except BaseException:
            self.abort_weight_update()
            raise
        self.finish_weight_update(version)

    def init_weight_transfer(self, init_info: dict) -> Any:
        """Join the trainer's private transfer group and return a receiver that writes into this
        engine.  ``init_info``: ``rendezvous``, ``rank``, ``world_size`` and optional ``timeout_s``
        and ``secret_file`` (the path of the group secret, mode 0600 — never the secret itself).

        The receiver writes through :meth:`update_weights` (between :meth:`start_weight_update`
        and :meth:`finish_weight_update`) and is guarded by the engine's lifecycle: an update
        that fails part-way is rolled back from a retained level-1 backup where one exists
        (``MemoryLifecycle("host", retain_backups=True)``, CUDA after a level-1 wake), else the
        engine is torn and :meth:`generate` refuses until a complete update arrives.  Called
        again (a new group: the previous sender died), the new receiver starts from the engine's
        version and knows of a torn update, so that its first complete update clears it."""
        from ..transfer import TransferGroup, WeightReceiver

        group = TransferGroup.create(
            rendezvous=init_info["rendezvous"], rank=init_info.get("rank", 1),
            world_size=init_info.get("world_size", 2), timeout_s=init_info.get("timeout_s", 60.0),
            secret_file=init_info.get("secret_file"),
        )
        old = self._receiver
        rx = WeightReceiver(group, apply=self.update_weights, guard=self.lifecycle, guard_tags=["weights"],
                            initial_version=old.version if old is not None else None)
        rx.torn = self.lifecycle.torn or (old.torn if old is not None else None)
        if old is not None:
            old.close()
            old.group.close()
        self._receiver = rx
        return rx

    def can_receive_weights(self) -> bool:
        """True when the weights may be written now (awake, not closed): a transfer guard."""
        return not self._closed and self.lifecycle.state().get("weights") == AWAKE

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rx, self._receiver = self._receiver, None
        if rx is not None:  # the group this engine joined in init_weight_transfer
            rx.close()
            rx.group.close()
        if self._own_lifecycle:  # the engine's own model dies with it
            self.lifecycle.close()


__all__ = ["TinyLM", "TinyLMConfig", "TorchGenerator", "sequence_logprobs", "top_p_filter", "decode_loop", "LOGPROBS_MODES"]
