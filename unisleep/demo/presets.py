"""``unisleep demo --model NAME``: Qwen2-shaped transformers models built locally from a config
with random weights (no download), and what each preset runs with.

The shapes are those of Qwen2.5-0.5B / 1.5B / 7B (hidden size, layers, heads, KV heads, MLP width,
vocabulary, tied embeddings); ``tiny-hf`` is the same architecture at a few MiB, for CPU CI.

The policy acts over the first :data:`ACTIONS` token ids (constrained decoding, as a tool-call or
classification policy does): the full model runs, its logits are cut to those ids, and the reward
is the fraction of the target token — so a random-weight model can learn the task in a few steps.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError

ACTIONS = 32  # token ids 0..ACTIONS-1 are the policy's actions


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict  # transformers.Qwen2Config keyword arguments
    dtype: str  # the engine's weights (and what the trainer sends): "bfloat16" or "float32"
    lr: float  # AdamW
    batch: int  # what the preset was sized for (docs/scale.md); --batch sets the run's
    prompt_len: int
    max_tokens: int  # likewise; --max-tokens sets the run's
    kv_len: int  # the engine's KV cache holds --batch sequences of this many tokens
    probe_tol: float  # |engine − trainer| logprob on the greedy probe
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def mixed(self) -> bool:
        """The trainer keeps fp32 master weights and runs its forward under bf16 autocast."""
        return self.dtype != "float32"

    def params(self) -> int:
        """Parameter count from the shape (tied embeddings counted once)."""
        c = self.config
        h, L, inter, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
        hd = h // c["num_attention_heads"]
        kvd = c["num_key_value_heads"] * hd
        attn = h * h + h + 2 * (h * kvd + kvd) + h * h  # q (+bias), k, v (+bias), o
        mlp = 3 * h * inter
        per_layer = attn + mlp + 2 * h
        emb = V * h * (1 if c.get("tie_word_embeddings", True) else 2)
        return L * per_layer + emb + h


def _qwen2(hidden, layers, heads, kv_heads, inter, vocab, tie) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                tie_word_embeddings=tie, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_theta=1000000.0, hidden_act="silu", use_sliding_window=False, attention_dropout=0.0)


# probe_tol bounds |engine − trainer| on the greedy probe, where both run the same function — one
# full forward in the serving dtype, no autocast — on what should be the same bytes: the engine on
# the weights it computes with, the trainer on the bytes it sent.  Same device, same kernels, same
# inputs: measured 0.0 on an H200 (1.5b, 7b, every step) and on CPU; 1e-3 leaves room for a kernel
# that differs between two processes and nothing for weights of another version.  The noise of
# decoding with a KV cache (up to ~0.1 at 7b in bf16) is reported beside it, not hidden in it.
PRESETS = {
    "tiny-hf": Preset("tiny-hf", _qwen2(128, 2, 4, 2, 256, 2048, True), "float32", 3e-3, 64, 4, 8, 64, 1e-3,
                      "a few MiB, float32 end to end: the CPU CI size"),
    "0.5b": Preset("0.5b", _qwen2(896, 24, 14, 2, 4864, 151936, True), "bfloat16", 1e-4, 64, 16, 16, 2048, 1e-3,
                   "Qwen2.5-0.5B shape"),
    "1.5b": Preset("1.5b", _qwen2(1536, 28, 12, 2, 8960, 151936, True), "bfloat16", 1e-4, 64, 16, 16, 2048, 1e-3,
                   "Qwen2.5-1.5B shape"),
    # lr 1e-4 as 1.5b: at 5e-5 the reward rose only 0.03 -> 0.07 in 8 steps on the H200
    "7b": Preset("7b", _qwen2(3584, 28, 28, 4, 18944, 152064, False), "bfloat16", 1e-4, 32, 16, 16, 1024, 1e-3,
                 "Qwen2.5-7B shape"),
}
MODEL_NAMES = tuple(PRESETS)


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgumentError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}") from None


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise InvalidArgumentError("--model needs the transformers package, which is not installed: "
                                   "pip install transformers (leave --model out for the embedded tiny model)")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def build_model(p: Preset, device: str, seed: int):
    """The preset's model with random weights (float32, in train mode off), built on ``device``
    with ``seed``: the trainer and the engine build the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**p.config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    return model


def fingerprint(named) -> list[int]:
    """One integer per tensor: the sum of its bytes read as integers of its element size.  Equal
    lists mean the same bytes arrived (up to a vanishingly unlikely collision)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = []
    for _, t in named:
        w = t.detach().contiguous().view(ints[t.element_size()]).view(-1)
        # summed in slices: the int64 sum of a whole tensor makes an int64 copy of it (4 GiB for
        # a 7B model's embedding), which would show in the memory the demo reports
        total = torch.zeros((), dtype=torch.int64, device=w.device)
        for piece in w.split(FINGERPRINT_SLICE):
            total += piece.sum(dtype=torch.int64)
        out.append(int(total.item()))
    return out


#: elements summed at once by :func:`fingerprint` (an int64 temporary of 128 MiB at most)
FINGERPRINT_SLICE = 16 << 20


def action_logprobs(logits, tokens):
    """Logprobs of ``tokens`` under the logits cut to the action ids (float32)."""
    lp = logits[..., :ACTIONS].float().log_softmax(dim=-1)
    return lp.gather(-1, tokens[..., None]).squeeze(-1)
