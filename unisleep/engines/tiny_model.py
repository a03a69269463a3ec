"""A tiny random-weight Llama with a byte-level BPE tokenizer, built locally and deterministically.

vLLM needs a model directory (``config.json``, safetensors weights, a tokenizer).  Tests and CI
have no hub access, so this module builds one on the spot from a seed: the same seed gives the
same bytes, and a different seed gives "model B" (other weights, same tokenizer and shapes) for
weight-change tests.  About 1.7 M parameters, 3.4 MB on disk, a few seconds to build.

    from unisleep.engines.tiny_model import build_tiny_llama, tiny_state_dict
    a = build_tiny_llama(seed=0)                       # in this user's private run directory
    b = build_tiny_llama(seed=1)                       # same tokenizer, other weights
    sd_b = tiny_state_dict(seed=1)                     # B's weights in memory (checkpoint names)

By default the models are built under ``tiny-models`` in unisleep's private run directory
(:func:`~unisleep.private_dir.private_dir`, mode 0700).  A directory given instead must be one no
other user can change: a cache under ``/tmp`` that another user made first (its marker, config and
weights planted for this process to load) is refused with
:class:`~unisleep.errors.ModelDirError`, as is one whose directories on the way, files, or links
another user owns or may write (:mod:`unisleep.trusted_dirs`).

Needs ``transformers``, ``tokenizers`` and ``safetensors`` (all come with vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from typing import Optional

from ..errors import ModelDirError
from ..private_dir import private_dir
from ..trusted_dirs import DIR_FLAGS, UnsafeDir, open_trusted_dir, owner_name, untrusted

#: bump when the recipe changes, so cached directories are rebuilt
RECIPE_VERSION = 1
MARKER = ".unisleep_tiny_model.json"

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
INIT_STD = 0.08
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

_WORDS = (
    "the a one two three four five six seven eight nine ten red green blue memory sleep wake "
    "weights cache engine trainer rollout token model step loss reward policy update version "
    "fast slow small large copy send receive pause resume level tag host device layer head "
    "value key query norm embed answer question why how what when where is are was be to of "
    "and or not with from into over under after before again then now yes no"
).split()


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if i % 7 == 0:
            words.append(str(rng.randint(0, 10**6)))
        if i % 11 == 0:
            words.append("".join(rng.choice("+-*/=()[]{}<>.,;:!?'\"") for _ in range(3)))
        lines.append(" ".join(words))
    return lines


def build_tokenizer(out_dir: str) -> None:
    """Train a 1024-token byte-level BPE tokenizer on a fixed synthetic corpus and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(1234), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _make_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG, torch_dtype="bfloat16")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(cfg)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
    return model.to(torch.bfloat16), cfg


def tiny_state_dict(seed: int = 0) -> dict:
    """The model's weights for ``seed`` in checkpoint (Hugging Face) names, bf16, in memory.

    What a trainer would send; identical to what :func:`build_tiny_llama` writes for the seed.
    """
    model, _ = _make_model(seed)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def default_models_dir() -> str:
    """Where the tiny models are built by default: ``tiny-models`` in this user's private run
    directory (mode 0700; :func:`~unisleep.private_dir.private_dir`)."""
    return os.path.join(private_dir(), "tiny-models")


def _refuse(e: UnsafeDir, out_dir: str) -> ModelDirError:
    if e.is_link or e.uid != os.geteuid() and e.uid != 0:
        fix = f"If you did not make it, remove it (as root: {'rm' if e.is_link else 'rm -r'} {e.dir})"
    else:
        fix = f"Fix it ({e.fix}), then remove {out_dir} (rm -r {out_dir}) so it is built again"
    try:
        where = f" ({default_models_dir()})"
    except Exception:  # noqa: BLE001 - only for the message
        where = ""
    return ModelDirError(
        f"the model directory {out_dir!r} is not safe: {e.why} — another user could have planted its config "
        f"and weights there, or change them, and this process would load them. Nothing was loaded from it or "
        f"built there. {fix}; or build the models where only you can change them: "
        f"build_tiny_llama() and build_tiny_pair() with no directory use unisleep's private run directory{where}, "
        "or pass a directory of mode 0700 that you own (mkdir -m 700 ~/tiny-models; UNISLEEP_TINY_MODELS=DIR "
        "for the test suite's cache)."
    )


def _check_entries(fd: int, shown: str, depth: int = 0) -> Optional[UnsafeDir]:
    """Why a file, directory or link in the model directory ``fd`` is another user's to change
    (None: none is)."""
    me = os.geteuid()
    for name in os.listdir(fd):
        p = os.path.join(shown, name)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, me):
                return UnsafeDir(p, f"{p} is a link of {owner_name(st.st_uid)}", st.st_uid, f"rm {p}", is_link=True)
        elif stat.S_ISDIR(st.st_mode) and depth < 8:
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            try:
                bad = untrusted(os.fstat(sub), p, me) or _check_entries(sub, p, depth + 1)
            finally:
                os.close(sub)
            if bad:
                return bad
        elif st.st_uid not in (0, me):
            return UnsafeDir(p, f"{p} belongs to {owner_name(st.st_uid)}", st.st_uid, f"rm {p}")
        elif st.st_mode & 0o022:
            return UnsafeDir(p, f"{p} may be written by others (mode {oct(st.st_mode & 0o777)})", st.st_uid,
                             f"chmod go-w {p}")
    return None


def check_model_dir(out_dir: str, *, create_parent: bool = False) -> bool:
    """Whether the model directory ``out_dir`` exists; raises :class:`~unisleep.errors.ModelDirError`
    unless no other user can change it, its files or anything on the way to it (links followed
    only when root's or this user's).  ``create_parent``: make the directories on the way (mode
    0700) that are missing, one name at a time at its parent's descriptor."""
    out_dir = os.path.abspath(out_dir)
    try:
        pfd, _ = open_trusted_dir(os.path.dirname(out_dir), create=create_parent)
        os.close(pfd)
        try:
            fd, _ = open_trusted_dir(out_dir)
        except FileNotFoundError:
            return False
        try:
            bad = _check_entries(fd, out_dir)
        finally:
            os.close(fd)
    except UnsafeDir as e:
        raise _refuse(e, out_dir) from None
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ModelDirError(f"cannot use the model directory {out_dir!r}: {e.filename}: {e.strerror}; pass a "
                            "directory of mode 0700 that you own, or none (unisleep's private run directory)") from e
    if bad:
        raise _refuse(bad, out_dir)
    return True


def _is_built(out_dir: str, seed: int) -> bool:
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    return info.get("seed") == seed and info.get("recipe") == RECIPE_VERSION


def build_tiny_llama(out_dir: Optional[str] = None, seed: int = 0, *, force: bool = False) -> str:
    """Build (or reuse) the tiny Llama for ``seed`` in ``out_dir``; returns the directory.

    ``out_dir`` defaults to ``tiny-llama-s<seed>`` under :func:`default_models_dir` (this user's
    private run directory).  It, its files and every directory on the way must be ones no other
    user can change (:func:`check_model_dir`): otherwise :class:`~unisleep.errors.ModelDirError`,
    before anything is read from or written there.  Cached: when ``out_dir`` already holds this
    seed's model (same recipe), nothing is done.  The build writes into a temporary sibling and
    renames it, so a crashed build never leaves a half-written directory that looks finished.
    """
    out_dir = os.path.abspath(out_dir or os.path.join(default_models_dir(), f"tiny-llama-s{seed}"))
    exists = check_model_dir(out_dir, create_parent=True)
    if not force and exists and _is_built(out_dir, seed):
        return out_dir
    import torch

    parent = os.path.dirname(out_dir)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        torch.manual_seed(seed)
        model, cfg = _make_model(seed)
        model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer(tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
                       "do_sample": False}, f)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"seed": seed, "recipe": RECIPE_VERSION, "params": sum(
                p.numel() for p in model.parameters())}, f)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def build_tiny_pair(root: Optional[str] = None, seed_a: int = 0, seed_b: int = 1) -> tuple[str, str]:
    """Model A and model B (same tokenizer and shapes, other weights) under ``root`` (default:
    :func:`default_models_dir`)."""
    root = root or default_models_dir()
    return (build_tiny_llama(os.path.join(root, f"tiny-llama-s{seed_a}"), seed_a),
            build_tiny_llama(os.path.join(root, f"tiny-llama-s{seed_b}"), seed_b))


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_llama(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
