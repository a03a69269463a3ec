"""The fast lane's vLLM tests skip, saying why, in an environment without vLLM.

Without vLLM, pytest's ``sys.path`` makes the ``tests/vllm`` folder a namespace package named
``vllm``; a check based on ``importlib.util.find_spec`` or ``pytest.importorskip`` alone then finds
it and the tests fail instead of skipping.  This runs pytest in a child whose ``sys.path`` is this
environment's site-packages minus vLLM (a folder of links to every other entry, ``python -S``), so
the environment is real apart from the one package taken out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vllm_tests_skip_when_vllm_is_absent(tmp_path):
    site = sysconfig.get_paths()["purelib"]
    hidden = tmp_path / "site-without-vllm"
    hidden.mkdir()
    for name in os.listdir(site):
        if name == "vllm" or name.startswith(("vllm-", "vllm_", "vllm.")):
            continue
        os.symlink(os.path.join(site, name), hidden / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(hidden)]))
    check = subprocess.run([sys.executable, "-S", "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm') is None)"],
                           cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "True", check.stdout + check.stderr
    r = subprocess.run([sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", "tests/vllm/test_vllm_allocator.py",
                        "tests/vllm/test_vllm_accelerator.py", "tests/test_vllm_ascend_source.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " failed" not in r.stdout, tail
