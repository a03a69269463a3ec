"""ROCm environment settings, parsed without touching a device or a vendor library.

Used by the driver and by ``unisleep doctor`` (``unisleep.platform.environment_warnings``).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from unisleep.errors import InvalidArgumentError, PlatformError

CHUNK_ENV = "VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE"
DEFAULT_CHUNK_MB = 256
VISIBLE_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def chunk_bytes_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """Bytes per physical chunk: ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` in MB (MiB, as vLLM reads it),
    default 256.  Unlike vLLM, which silently falls back to 256 on a bad value, a value that is
    not a positive power of two raises, naming the variable."""
    env = os.environ if env is None else env
    raw = env.get(CHUNK_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_CHUNK_MB << 20
    try:
        mb = int(raw.strip(), 0)  # decimal or 0x.. like vLLM's strtoull(base 0)
    except ValueError:
        mb = -1
    if mb <= 0 or mb & (mb - 1):
        raise InvalidArgumentError(
            f"{CHUNK_ENV}={raw!r} must be a positive power of two in MB (e.g. 64, 128, 256, 1024); "
            f"unset it for the default {DEFAULT_CHUNK_MB}. Measure with `unisleep bench --chunk-sweep`."
        )
    return mb << 20


def _split(val: str) -> list[str]:
    return [p.strip() for p in val.split(",") if p.strip()]


def visible_device_problem(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A message when the visible-device variables disagree, else None.

    ROCr applies ``ROCR_VISIBLE_DEVICES`` first; HIP then applies ``HIP_VISIBLE_DEVICES`` (and
    ``CUDA_VISIBLE_DEVICES``, which HIP honours as an alias) as indices *into* that list.  So
    HIP and CUDA must be equal when both are set, and their indices must exist in the ROCR list.
    """
    env = os.environ if env is None else env
    hip, cuda, rocr = (env.get(v) for v in VISIBLE_VARS)
    if hip is not None and cuda is not None and _split(hip) != _split(cuda):
        return (
            f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; HIP reads both as the same "
            "list, so set only one of them (or make them equal)."
        )
    sel = hip if hip is not None else cuda
    if rocr is not None and sel is not None:
        n = len(_split(rocr))
        for tok in _split(sel):
            if tok.isdigit() and int(tok) >= n:
                name = "HIP_VISIBLE_DEVICES" if hip is not None else "CUDA_VISIBLE_DEVICES"
                return (
                    f"{name}={sel!r} selects device {tok}, but ROCR_VISIBLE_DEVICES={rocr!r} leaves only {n} device(s); "
                    f"{name} indexes into the ROCR list. Use indices 0..{n - 1}, or set only ROCR_VISIBLE_DEVICES."
                )
    return None


def check_visible_devices(env: Optional[Mapping[str, str]] = None) -> None:
    problem = visible_device_problem(env)
    if problem:
        raise PlatformError(problem)
