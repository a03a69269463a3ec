"""Shared fixtures for the CPU test suite: a host-backend MemoryLifecycle on real memfd memory,
with its spill directory on disk (never tmpfs) under pytest's tmp_path."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MiB = 1 << 20


def pytest_configure(config):
    config.addinivalue_line("markers", "bigmem: allocates about 3 GiB of host memory")


@pytest.fixture
def spill_dir(tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    return str(d)


@pytest.fixture
def lifecycle(spill_dir):
    """A host MemoryLifecycle, closed after the test even when it fails."""
    from unisleep import MemoryLifecycle

    lc = MemoryLifecycle("host", spill_dir=spill_dir)
    yield lc
    lc.close()


@pytest.fixture
def python_exe():
    return sys.executable
