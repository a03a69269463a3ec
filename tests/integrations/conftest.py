"""Fixtures for the RL-framework adapter tests (each file skips where its framework is not
installed; ``make test`` runs them in the environment of the vLLM version the framework pins)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``(dir_a, dir_b)``: two tiny Llamas (seeds 0 and 1), built here (as tests/vllm's)."""
    from unisleep.engines.tiny_model import build_tiny_pair

    root = os.environ.get("UNISLEEP_TINY_MODELS") or str(tmp_path_factory.mktemp("tiny-models"))
    return build_tiny_pair(root)
