"""``unisleep demo``: a colocated RL loop, end to end, with the guarded release -> train ->
reacquire order; a table per step, ``demo.json`` (and ``demo.png``) in ``--out``, and checks.
Exit 0 only when every check passed.

* :mod:`.cli` — the options, and which platform ``--device`` names;
* :mod:`.embedded` — the loop on the embedded :class:`~unisleep.engines.torch_generator.TorchGenerator`,
  with its trainer in another process (:mod:`.trainer_process`);
* :mod:`.vllm` — ``--engine vllm``: the loop against a real vLLM server, its trainer a Hugging Face
  Llama in this process (:mod:`.hf_policy`);
* :mod:`.scaled` — ``--model``: a Qwen2-shaped transformers model (:mod:`.presets`), the engine
  (:mod:`.hf_engine`) and an AdamW trainer with its own lifecycle (:mod:`.hf_trainer`), both sides
  sleeping (docs/scale.md); its memory table, peak and figure in :mod:`.scaled_report`;
* :mod:`.ray_demo` — ``--ray``: the embedded loop with trainer and engine as Ray actors
  (:mod:`unisleep.ray`);
* :mod:`.steps` — what each step records; :mod:`.checks` — the verdicts; :mod:`.report` — the
  progress line, tables, ``demo.json``, ``demo.png``; :mod:`.constants` — the fixed numbers.
"""

from __future__ import annotations

import os
import sys

from .checks import Check
from ..errors import UnisleepError
from .cli import build_parser, validate
from .constants import (BUCKET_BYTES, DEFAULT_LR, DEFAULT_STEPS, PROBE_PROMPTS, PROBE_TOL, RELEASED_MIN, SABOTAGES,
                        VLLM_KV_BYTES, VLLM_PROBE_PROMPTS, VLLM_PROBE_TOL, VLLM_REWARD_MOD, MiB)
MODEL_STEPS = 10  # default --steps with --model
from .embedded import run_torch
from .presets import PRESETS
from .report import format_table, format_table_vllm
from .steps import DemoStep, VLLMDemoStep
from .vllm import run_vllm


def main(argv=None) -> int:
    if "torch" not in sys.modules:
        # the demo reports a failed or dead trainer itself; c10d's C++ warnings with stack dumps
        # (a store whose host process is gone) would only bury that message
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from ..cli import parse_args

    args = parse_args(build_parser(), list(sys.argv[1:] if argv is None else argv))
    if args.steps is None:
        args.steps = MODEL_STEPS if args.model is not None else DEFAULT_STEPS[args.engine]
    if args.lr is None:
        args.lr = PRESETS[args.model].lr if args.model in PRESETS else DEFAULT_LR[args.engine]
    try:
        validate(args)  # every option, before a process, a server or a folder is made
    except UnisleepError as e:
        print(f"unisleep demo: {e}", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        return run_vllm(args)
    if args.ray:
        from .ray_demo import run_ray

        return run_ray(args)
    if args.model is not None:
        from .scaled import run_model

        return run_model(args)
    return run_torch(args)


__all__ = ["main", "build_parser", "validate", "run_torch", "run_vllm", "Check", "DemoStep", "VLLMDemoStep", "format_table",
           "format_table_vllm", "BUCKET_BYTES", "DEFAULT_LR", "DEFAULT_STEPS", "PROBE_PROMPTS", "PROBE_TOL",
           "RELEASED_MIN", "SABOTAGES", "VLLM_KV_BYTES", "VLLM_PROBE_PROMPTS", "VLLM_PROBE_TOL", "VLLM_REWARD_MOD",
           "MiB"]
