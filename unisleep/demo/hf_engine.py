"""The rollout engine of ``unisleep demo --model``: a Qwen2-shaped transformers model whose
parameters live in a :class:`~unisleep.lifecycle.MemoryLifecycle` (tag ``"weights"``) and whose
KV cache is lifecycle memory too (tag ``"kv_cache"``), decoded by its own loop over the model's
modules (embedding, rotary, attention projections, MLP, norms) with that cache — the engine shape
of vLLM (preallocated KV, weights updated in place), on any platform torch runs on.

It reuses :class:`~unisleep.engines.torch_generator.TorchGenerator`'s engine verbs (pause, sleep,
wake, in-place weight updates with checks, guards) and replaces the model and the decoding.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..engines.torch_generator import LOGPROBS_MODES, TorchGenerator, decode_loop
from ..errors import InvalidArgumentError
from .presets import ACTIONS, Preset, action_logprobs, build_model, torch_dtype


FLAT_NAME = "flat"  # the one tensor of a whole-model update
#: above this, the flat buffer travels as chunks of CHUNK_BYTES ("flat.0", "flat.1", ...): a bucket
#: is as large as the largest tensor, so one 14 GiB tensor (7b) would need a 14 GiB bucket on the
#: trainer's side (the 1.5b model's 3 GiB travel whole: one bucket costs less there than three)
CHUNK_ABOVE = 8 << 30
CHUNK_BYTES = 1 << 30


def flat_pieces(flat) -> list:
    """``[(name, view)]`` of a flat weight buffer as it is sent: itself up to CHUNK_ABOVE bytes,
    else consecutive chunks of CHUNK_BYTES."""
    nbytes = flat.numel() * flat.element_size()
    if nbytes <= CHUNK_ABOVE:
        return [(FLAT_NAME, flat)]
    step = CHUNK_BYTES // flat.element_size()
    return [(f"{FLAT_NAME}.{i}", flat[o:o + step]) for i, o in enumerate(range(0, flat.numel(), step))]


class HFGenerator(TorchGenerator):
    kind = "hf"

    def __init__(self, p: Preset, *, lifecycle, device: str, max_batch: int, kv_len: int,
                 logprobs_mode: str = "raw_logprobs", seed: int = 0):
        import torch

        if logprobs_mode not in LOGPROBS_MODES:
            raise InvalidArgumentError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.preset = p
        self.lifecycle = lifecycle
        self._own_lifecycle = False
        self.logprobs_mode = logprobs_mode
        self.max_batch = max_batch
        model = build_model(p, device, seed)
        dt = torch_dtype(p.dtype)
        with torch.no_grad():
            for prm in model.parameters():  # parameters in the serving dtype; the rotary buffer stays float32
                prm.data = prm.data.to(dt)
        model.requires_grad_(False)
        # the parameters (not the buffers: the rotary table is not a weight and never sent) become
        # views of ONE flat buffer of lifecycle memory, in named_parameters() order (tied embeddings
        # once): the trainer sends that buffer as one tensor (:data:`FLAT_NAME`)
        named = list(model.named_parameters())
        self.layout = [(n, t.numel()) for n, t in named]
        self.flat = lifecycle.empty((sum(n for _, n in self.layout),), dt, tag="weights")
        with torch.no_grad():
            off = 0
            for _, t in named:
                v = self.flat[off:off + t.numel()].view(t.shape)
                v.copy_(t)
                t.data = v
                off += t.numel()
        mod = getattr(torch, torch.device(device).type, None)
        if torch.device(device).type != "cpu" and hasattr(mod, "empty_cache"):
            mod.empty_cache()  # the float32 build and the pre-adoption copies: give them back to the device
        self.model = model
        self._params = dict(model.named_parameters())
        c = p.config
        self.n_layers, self.n_heads, self.n_kv = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.n_heads
        self.kv_cache = lifecycle.empty((self.n_layers, 2, max_batch, self.n_kv, kv_len, self.head_dim), dt,
                                        tag="kv_cache")
        self.device = self.kv_cache.device
        self.config = SimpleNamespace(vocab_size=c["vocab_size"], max_len=kv_len)  # what generate() checks
        self._start(seed)

    def update_weights(self, update_info) -> None:
        """``[(FLAT_NAME, flat)]``: the whole set in one tensor, copied into the flat buffer in place
        (every parameter counts as written); anything else: per tensor, as TorchGenerator does."""
        items = list(update_info.items()) if hasattr(update_info, "items") else list(update_info)
        if items and all(n == FLAT_NAME or n.startswith(FLAT_NAME + ".") for n, _ in items):
            from ..errors import InvalidTransitionError, TransferError

            if self._updating is None:
                raise InvalidTransitionError("call start_weight_update() before update_weights()")
            self._require_awake(("weights",), "write weights")
            mine = dict(flat_pieces(self.flat))
            got = dict(items)
            unknown = sorted(set(got) - set(mine))
            if unknown:
                raise TransferError(f"a flat update carries pieces this engine does not have: {unknown[:4]} "
                                    f"(the engine's are {sorted(mine)[:4]}...); nothing was written")
            for n, t in got.items():
                v = mine[n]
                if tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype:
                    raise TransferError(f"{n}: {tuple(t.shape)} {t.dtype} != the engine's {tuple(v.shape)} {v.dtype}; "
                                        "nothing was written")
            for n, t in got.items():  # the pieces may come in several calls (one per bucket)
                mine[n].copy_(t)
            if getattr(self, "_flat_update", None) is not self._updating:
                self._flat_update, self._flat_seen = self._updating, set()
            self._flat_seen.update(got)
            if self._flat_seen == set(mine):  # every piece arrived: every parameter is written
                self._updating.update(self._params)
            return
        super().update_weights(items)

    def full_logprobs(self, prompts, tokens) -> list[list[float]]:
        """Action logprobs of ``tokens`` after ``prompts`` from one full forward of the served
        model (no KV cache): the weights this engine computes with, in the numerics the trainer
        uses to score the probe from the bytes it sent."""
        import torch

        self._require_awake(("weights",), "score")
        ids = torch.cat([torch.tensor(prompts), torch.tensor(tokens)], dim=1).to(self.device)
        P, C = len(prompts[0]), len(tokens[0])
        with torch.no_grad():
            logits = self.model(input_ids=ids, use_cache=False).logits[:, P - 1:P + C - 1]
            return action_logprobs(logits, ids[:, P:]).cpu().tolist()

    def _forward(self, ids, pos0: int):
        """Logits of the last position of ``ids`` ([B, T]) at positions pos0.., writing K/V into the cache."""
        import torch
        import torch.nn.functional as F
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        m = self.model.model
        B, T = ids.shape
        S = pos0 + T
        x = m.embed_tokens(ids)
        pos = torch.arange(pos0, S, device=ids.device)[None].expand(B, T)
        cos, sin = m.rotary_emb(x, pos)
        groups = self.n_heads // self.n_kv
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kv = self.kv_cache[i]
            kv[0, :B, :, pos0:S] = k
            kv[1, :B, :, pos0:S] = v
            k = kv[0, :B, :, :S].repeat_interleave(groups, dim=1)
            v = kv[1, :B, :, :S].repeat_interleave(groups, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1 and pos0 == 0)
            x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x[:, -1:]))[:, -1, :ACTIONS].float()

    def _decode(self, ids, max_tokens, temperature, top_p, rng):
        B, P = ids.shape
        return decode_loop(self._forward(ids, 0), lambda tok, pos: self._forward(tok[:, None], pos),
                           P, max_tokens, temperature, top_p, rng, self.logprobs_mode)
