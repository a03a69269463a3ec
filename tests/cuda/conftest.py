"""Tests under tests/cuda need an NVIDIA GPU; CPU CI skips them with the reason.

The skip goes by the ``cuda`` *marker* (every test in this folder carries it) — never by
keywords, which also match parametrised ids like ``test_platform.py::...[cuda]`` elsewhere.
"""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


@pytest.fixture
def lc():
    """A lifecycle on the first GPU, closed after the test."""
    from unisleep import MemoryLifecycle

    m = MemoryLifecycle("cuda")
    yield m
    m.close()


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if str(it.path).startswith(HERE + os.sep)]
    for item in mine:  # every test here needs the GPU: select them all with -m cuda
        if item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
    if _gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a CUDA build of torch (pytest -m cuda tests/cuda on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
