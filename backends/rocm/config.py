"""ROCm environment settings, parsed without touching a device or a vendor library.

Used by the driver and by ``unisleep doctor`` (``unisleep.platform.environment_warnings``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping, Optional

from unisleep.errors import PlatformError

log = logging.getLogger("unisleep.rocm")

CHUNK_ENV = "VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE"
DEFAULT_CHUNK_MB = 256
MIB = 1 << 20
ULLONG_MAX = (1 << 64) - 1
VISIBLE_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _strtoull_base0(text: str) -> tuple[int, int, int]:
    """C's ``strtoull(text, &end, 0)`` from this process's libc: (value, characters consumed,
    errno).  Base 0 reads ``0x..`` as hex and a leading ``0`` as octal; parsing stops at the
    first character that does not fit (``"1_024"`` reads 1); a minus sign negates modulo 2**64."""
    raw = text.encode()
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.strtoull
    fn.restype = ctypes.c_ulonglong
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    buf = ctypes.create_string_buffer(raw)
    end = ctypes.c_char_p()
    ctypes.set_errno(0)
    value = fn(ctypes.cast(buf, ctypes.c_char_p), ctypes.byref(end), 0)
    err = ctypes.get_errno()
    consumed = ctypes.cast(end, ctypes.c_void_p).value - ctypes.addressof(buf)
    return int(value), consumed, err


def chunk_mib_as_vllm_reads_it(raw: Optional[str]) -> tuple[int, Optional[str]]:
    """``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` as vLLM's ROCm allocator reads it (csrc/
    cumem_allocator.cpp, ``get_memcreate_chunk_size``): ``strtoull(value, &end, 0)`` in MiB;
    nothing parsed, a range error, 0, or a size whose bytes overflow 64 bits fall back to 256.
    Returns (MiB, why vLLM fell back — None when it took the value)."""
    if raw is None:
        return DEFAULT_CHUNK_MB, None
    value, consumed, err = _strtoull_base0(raw)
    if consumed == 0:
        why = "it does not start with a number"
    elif err:
        why = f"it is out of range for a 64-bit number ({os.strerror(err)})"
    elif value == 0:
        why = "it reads as 0"
    elif value > ULLONG_MAX // MIB:
        why = "its size in bytes overflows 64 bits"
    else:
        return value, None
    return DEFAULT_CHUNK_MB, why


def chunk_bytes_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """Bytes per physical chunk: ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` read exactly as vLLM's ROCm
    allocator in the same process reads it (:func:`chunk_mib_as_vllm_reads_it`), so the same
    value gives the same chunks: any size is taken (chunks are rounded up to the granularity,
    the last one is the remainder), ``064`` is octal (52 MiB), ``0x400`` hex, ``64MB`` reads 64.
    Where vLLM silently falls back to 256 MiB, this logs a warning naming the variable."""
    env = os.environ if env is None else env
    raw = env.get(CHUNK_ENV)
    mib, why = chunk_mib_as_vllm_reads_it(raw)
    if why is not None:
        log.warning("%s=%r: %s, so vLLM and unisleep use the default %d MiB chunks. Set a size in MiB "
                    "(e.g. 64, 128, 256); measure with `unisleep bench --chunk-sweep`.", CHUNK_ENV, raw, why,
                    DEFAULT_CHUNK_MB)
    elif not is_power_of_two(mib):
        log.warning("%s=%r: %s", CHUNK_ENV, raw, not_power_of_two_note(mib))
    return mib * MIB


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def not_power_of_two_note(mib: int) -> str:
    lo = 1 << (mib.bit_length() - 1)
    return (f"{mib} MiB chunks are used as vLLM uses them, but vLLM's sleep-mode guide recommends a power of 2 "
            f"(e.g. {lo} or {lo * 2}); measure with `unisleep bench --chunk-sweep`.")


def chunk_env_problem(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A message when ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` is set but vLLM would ignore it (and use
    256 MiB) or read it differently than it looks (trailing characters, octal), else None."""
    env = os.environ if env is None else env
    raw = env.get(CHUNK_ENV)
    if raw is None:
        return None
    mib, why = chunk_mib_as_vllm_reads_it(raw)
    if why is not None:
        return f"{CHUNK_ENV}={raw!r} is ignored by vLLM ({why}): 256 MiB chunks are used. Set a size in MiB."
    value, consumed, _ = _strtoull_base0(raw)
    shown = raw.strip()
    if consumed < len(raw) or shown != str(mib):
        return (f"{CHUNK_ENV}={raw!r} reads as {mib} MiB (strtoull, base 0: a leading 0 is octal, 0x hex, "
                f"reading stops at the first other character); write {mib} if that is meant.")
    if not is_power_of_two(mib):
        return f"{CHUNK_ENV}={raw!r}: {not_power_of_two_note(mib)}"
    return None


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


def _select(devices: list, tokens: list[str], uuid_of) -> list:
    out = []
    for tok in tokens:
        if tok.isdigit():
            if int(tok) < len(devices):
                out.append(devices[int(tok)])
        else:
            out += [d for d in devices if uuid_of(d) and uuid_of(d).lower() == tok.lower()]
    return out


def visible_devices(devices: list[tuple[int, Optional[str]]], env: Optional[Mapping[str, str]] = None) -> list[int]:
    """Which of ``devices`` this process sees, in the order HIP numbers them: ``devices`` are
    ``(hip_id, uuid)`` as amdsmi's enumeration info gives them (``hip_id``: the HIP index with
    every GPU visible); the result lists positions into ``devices``, so ``result[i]`` is HIP
    device ``i`` here.  ``ROCR_VISIBLE_DEVICES`` applies first (indices or ``GPU-<uuid>``), then
    ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``) as indices into what it left."""
    env = os.environ if env is None else env
    order = sorted(range(len(devices)), key=lambda i: devices[i][0])
    uuid_of = lambda i: devices[i][1]  # noqa: E731
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None:
        order = _select(order, _split(rocr), uuid_of)
    sel = env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"))
    if sel is not None:
        order = _select(order, _split(sel), uuid_of)
    return order


def check_visible_devices(env: Optional[Mapping[str, str]] = None) -> None:
    problem = visible_device_problem(env)
    if problem:
        raise PlatformError(problem)


def environment_warnings(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """What ``unisleep doctor`` says about the ROCm settings: the chunk size vLLM reads, and
    visible-device variables that disagree."""
    env = os.environ if env is None else env
    warn = []
    if env.get(CHUNK_ENV) is None:
        warn.append(f"{CHUNK_ENV} is unset: {DEFAULT_CHUNK_MB} MiB chunks are used; tune with `unisleep bench --chunk-sweep`.")
    else:
        problem = chunk_env_problem(env)
        if problem:
            warn.append(problem)
    problem = visible_device_problem(env)
    if problem:
        warn.append(problem)
    return warn
