"""Tests under tests/cuda need an NVIDIA GPU; CPU CI skips them with the reason."""

import pytest


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    if _gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the H200 through the device tool; see docs/cuda.md)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
