"""The options of ``unisleep demo`` (:func:`build_parser`), their checks before anything starts
(:func:`validate`) and what ``--device`` names (:func:`platform_for`)."""

from __future__ import annotations

import math
import os

from ..cli import CommandParser, check_out_dir
from ..errors import InvalidArgumentError, PlatformError
from ..platform import detect_platform
from ..registry import backends
from .presets import MODEL_NAMES
from .constants import DEFAULT_LR, DEFAULT_STEPS, PROMPT_LEN, SABOTAGES, VLLM_REWARD_MOD

#: where ``unisleep demo`` writes demo.json and demo.png unless --out says (out/ is in .gitignore)
DEFAULT_OUT = os.path.join("out", "demo")
#: the least --timeout that means anything: it bounds each wait for the trainer process, and a
#: new Python process importing torch takes about a second before it can answer at all
MIN_TIMEOUT_S = 5.0
#: host memory a --model run needs per parameter: the trainer's float32 weights, gradients and
#: AdamW state (two moments) are all awake at its optimizer step
MODEL_BYTES_PER_PARAM = 16
#: spill-directory space per parameter on the host: the trainer's offload (a level-1 sleep)
#: writes its float32 weights and AdamW state there
MODEL_SPILL_BYTES_PER_PARAM = 12


def _device_choices() -> list[str]:
    """Platform names and the torch device types they use (e.g. the host's "cpu")."""
    out = ["auto", *(b.name for b in backends())]
    for b in backends():
        if b.torch_device not in out:
            out.append(b.torch_device)
    return out


def platform_for(device: str):
    if device == "auto":
        return detect_platform()
    found = backends()
    if device in [b.name for b in found]:
        return detect_platform(device)
    for b in found:  # a torch device type: the first platform (in detection order) that uses it
        if b.torch_device == device:
            return detect_platform(b.name)
    raise InvalidArgumentError(f"--device {device!r} is not a platform or torch device type; choose one of "
                               f"{', '.join(_device_choices())}")


def validate(args) -> None:
    """Check the options before anything starts (the defaults already filled in); raise
    :class:`InvalidArgumentError` saying which option is wrong and what to pass instead."""
    from ..engines.tiny_lm_config import TinyLMConfig

    def bad(msg: str) -> None:
        raise InvalidArgumentError(msg)

    if args.steps < 1:
        bad(f"--steps must be >= 1, got {args.steps}")
    if args.batch < 1:
        bad(f"--batch must be >= 1 (rollouts per step), got {args.batch}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        bad(f"--lr must be a positive number, got {args.lr:g} (default {DEFAULT_LR[args.engine]:g})")
    if not (0 < args.top_p <= 1):
        bad(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        bad(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.timeout < MIN_TIMEOUT_S:
        bad(f"--timeout must be at least {MIN_TIMEOUT_S:g} s, got {args.timeout:g}: it bounds each wait for the "
            "trainer process, which needs about a second just to start (a new Python importing torch); the "
            "default is 60")
    fal = getattr(args, "free_at_least", None)
    if fal is not None:
        if not (math.isfinite(fal) and fal >= 0):
            bad(f"--free-at-least must be a number of MiB >= 0, got {fal:g}")
        if args.engine != "torch" or args.model is not None or getattr(args, "ray", False):
            bad("--free-at-least runs on the embedded engine's loop (its TorchGenerator sleeps to a budget; vLLM's "
                "sleep frees all of a level): leave out --engine vllm, --model and --ray")
    if getattr(args, "ray", False):
        import importlib.util

        if args.engine != "torch" or args.model is not None:
            bad("--ray runs the embedded tiny model's loop as Ray actors; leave out --engine vllm and --model")
        if importlib.util.find_spec("ray") is None:
            bad("--ray needs Ray, which is not installed: pip install 'unisleep[ray]'")
    if getattr(args, "model", None) is not None:
        from .presets import ACTIONS, preset, require_transformers

        if args.engine != "torch":
            bad("--model runs the embedded engine on a transformers model; leave out --engine vllm")
        pr = preset(args.model)
        require_transformers()
        room = max(pr.kv_len, pr.prompt_len + args.max_tokens) - pr.prompt_len
        if not 1 <= args.max_tokens <= room:
            bad(f"--max-tokens must be in 1..{room} for --model {args.model}, got {args.max_tokens}")
        if not 0 <= args.target < ACTIONS:
            bad(f"--target must be one of the policy's actions, token ids 0..{ACTIONS - 1}, got {args.target}")
    elif args.engine == "torch":
        cfg = TinyLMConfig()
        room = cfg.max_len - PROMPT_LEN
        if not 1 <= args.max_tokens <= room:
            bad(f"--max-tokens must be in 1..{room} (the embedded model's context is {cfg.max_len} tokens and "
                f"prompts take {PROMPT_LEN}), got {args.max_tokens}")
        if not 0 <= args.target < cfg.vocab_size:
            bad(f"--target must be a token of the embedded model's vocabulary, 0..{cfg.vocab_size - 1}, got "
                f"{args.target}: any other token can never be sampled, so the reward would stay 0")
    else:
        if args.max_tokens < 1:
            bad(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.target < 0:
            bad(f"--target must be >= 0 (the reward counts tokens t with t % {VLLM_REWARD_MOD} == "
                f"target % {VLLM_REWARD_MOD}), got {args.target}")
        check_out_dir(args.out)
        return
    try:
        plat = platform_for(args.device)
    except PlatformError as e:
        raise InvalidArgumentError(f"--device {args.device}: {e}") from e
    if plat.is_accelerator and not plat.devices:
        bad(f"--device {args.device}: no {plat.name} device was found on this machine, so the engine's memory "
            "cannot live there. Leave --device out (host memory, the default) or run on a machine with one "
            "(unisleep doctor shows what is found).")
    if getattr(args, "model", None) is not None and not plat.is_accelerator:
        check_model_fits_host(args.model)
    check_out_dir(args.out)


def check_model_fits_host(name: str) -> None:
    """Refuse a ``--model`` whose trainer cannot fit in host memory (MemAvailable) or whose
    offload cannot fit in the spill directory, saying what it needs and what there is."""
    from ..backends.host.spill_dir import default_spill_parent
    from ..backup import host_available_bytes
    from ..units import human_bytes
    from .presets import PRESETS, preset

    pr = preset(name)
    n = pr.params()
    need_mem, need_disk = MODEL_BYTES_PER_PARAM * n, MODEL_SPILL_BYTES_PER_PARAM * n
    avail = host_available_bytes()
    spill = default_spill_parent()
    where = spill
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    fits = [m for m, p in PRESETS.items()
            if MODEL_BYTES_PER_PARAM * p.params() <= (avail or need_mem) and MODEL_SPILL_BYTES_PER_PARAM * p.params() <= free]
    accelerators = ", ".join(b.name for b in backends() if b.is_accelerator)
    alt = (f"--model {fits[-1]} fits here" if fits else "no --model preset fits here (leave --model out: the embedded "
           "tiny model)") + f"; or run it on an accelerator with that much memory (--device {accelerators})"
    what = (f"--model {name} ({n / 1e9:.2f} B parameters) on host memory needs about {human_bytes(need_mem)} of "
            f"memory (the trainer's float32 weights, gradients and AdamW state: {MODEL_BYTES_PER_PARAM} bytes per "
            f"parameter) and {human_bytes(need_disk)} free in the spill directory (its offloaded weights and AdamW "
            "state)")
    if avail and need_mem > avail:
        raise InvalidArgumentError(f"{what}; this machine has {human_bytes(avail)} available (MemAvailable in "
                                   f"/proc/meminfo). {alt[0].upper()}{alt[1:]}.")
    if need_disk > free:
        raise InvalidArgumentError(f"{what}; the spill directory {spill} has {human_bytes(free)} free ({where}). "
                                   f"Point UNISLEEP_SPILL_DIR at a disk with more room, or: {alt}.")


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="unisleep demo",
        description="A colocated RL loop (engine here, trainer in another process) with the guarded "
                    "release -> train -> reacquire order; prints a table per step and checks the result.",
    )
    p.add_argument("--steps", type=int, default=None,
                   help=f"RL steps (default {DEFAULT_STEPS['torch']}; {DEFAULT_STEPS['vllm']} with --engine vllm)")
    p.add_argument("--level", type=int, choices=(1, 2), default=2, help="sleep level (default 2: RL drops weights)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for demo.json and demo.png (default {DEFAULT_OUT}, under the current folder); "
                        "checked before anything starts")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="torch: the embedded TorchGenerator (default); vllm: a real vLLM server on 127.0.0.1 "
                        "serving a tiny Llama, the trainer (HF LlamaForCausalLM) in this process")
    p.add_argument("--device", choices=_device_choices(), default="cpu",
                   help="where the engine's memory lives: a platform name, a torch device type, or auto "
                        "(default: cpu = host memory)")
    p.add_argument("--model", choices=MODEL_NAMES, default=None,
                   help="run the loop on a Qwen2-shaped transformers model built locally with random weights "
                        "(tiny-hf: a few MiB for CPU; 0.5b, 1.5b, 7b: those shapes, bf16 engine, fp32 AdamW trainer) "
                        "with BOTH sides sleeping: the trainer offloaded while the engine generates. Default: the "
                        "embedded tiny model")
    p.add_argument("--ray", action="store_true",
                   help="run the trainer and the engine as Ray actors (pip install 'unisleep[ray]'); a local Ray "
                        "cluster is started unless RAY_ADDRESS names one")
    p.add_argument("--batch", type=int, default=64, help="rollouts per step")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per rollout")
    p.add_argument("--target", type=int, default=7, help="the token the reward asks for")
    p.add_argument("--lr", type=float, default=None,
                   help=f"trainer learning rate (Adam; default {DEFAULT_LR['torch']}, {DEFAULT_LR['vllm']} with "
                        "--engine vllm)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p of the engine")
    p.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default="raw_logprobs",
                   help="what the engine returns; processed + --top-p < 1 shows the gap monitor's offset finding")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's initial weights and of sampling: the same seed, the same run "
                        "(default 0)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help=f"seconds to wait for the trainer process at each step (default 60; at least "
                        f"{MIN_TIMEOUT_S:g})")
    p.add_argument("--sabotage", choices=SABOTAGES, default="none",
                   help="break the loop on purpose to see the checks fail: drop-weights (the engine ignores "
                        "the tensors it receives), skip-sleep (the engine's sleep frees nothing)")
    p.add_argument("--free-at-least", type=float, default=None, metavar="MIB",
                   help="a budgeted release: the engine frees at least MIB MiB (KV cache first, then weights "
                        "region by region) and keeps the rest resident; embedded engine only (default: all of "
                        "the level)")
    p.add_argument("--no-plot", action="store_true", help="skip demo.png")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return p
