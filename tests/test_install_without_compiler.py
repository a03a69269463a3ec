"""``pip install`` of a copy of this source tree into a fresh target folder, once with no C
compiler on PATH and once with the machine's: without one the install succeeds, says what it
left out, and the core imports and sleeps/wakes a tensor while the preload features raise
NativeLibraryMissingError naming the fix; with one the preload library is built.  Real pip, real
setuptools (this environment's, ``--no-build-isolation``: no index needed), nothing mocked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # two pip installs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = "torch_memory_saver_hook_mode_preload.abi3.so"

CHECK = textwrap.dedent("""
    import os, subprocess, sys, torch
    import unisleep
    assert unisleep.__file__.startswith(sys.argv[1]), unisleep.__file__  # the installed copy
    from unisleep import MemoryLifecycle
    lc = MemoryLifecycle("host")
    t = lc.empty((1 << 20,), torch.float32, tag="weights")
    t.copy_(torch.arange(1 << 20, dtype=torch.float32))
    lc.sleep(level=1)
    lc.wake_up()
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
    del t
    lc.close()
    from unisleep.compat.torch_memory_saver import require_native_library
    from unisleep.errors import NativeLibraryMissingError
    try:
        print("native:", require_native_library())
    except NativeLibraryMissingError as e:
        print("missing:", e)
    from unisleep.integrations import slime
    try:
        slime.driver_env()
        print("slime: ready")
    except NativeLibraryMissingError:
        print("slime: refused")
    r = subprocess.run([sys.executable, "-m", "unisleep.compat", "--preload-path"], capture_output=True, text=True)
    print("preload-path rc", r.returncode, r.stderr.strip()[:400])
""")


def _copy_tree(dst: str) -> str:
    src = os.path.join(dst, "src")
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "out", "*.so", ".pytest_cache"))
    return src


@pytest.mark.parametrize("compiler", [False, True], ids=["no-compiler", "compiler"])
def test_pip_install_with_and_without_a_c_compiler(tmp_path, compiler):
    if compiler and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler for the with-compiler case: apt-get install gcc")
    src, target = _copy_tree(str(tmp_path)), str(tmp_path / "target")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"] if compiler else str(empty), "LANG": "C.UTF-8",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "UNISLEEP_PLATFORM": "host"}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-cache-dir", "--no-deps",
                        "--no-build-isolation", "--no-index", "--target", target, src],
                       env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    built = os.path.exists(os.path.join(target, "unisleep", NATIVE))
    assert built == compiler, out[-3000:]
    assert ("no C compiler" in out) == (not compiler), out[-3000:]
    c = subprocess.run([sys.executable, "-c", CHECK, target], env=dict(env, PYTHONPATH=target), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, (c.stdout + c.stderr)[-3000:]
    if compiler:
        assert "native: " + os.path.join(target, "unisleep", NATIVE) in c.stdout, c.stdout
        assert "preload-path rc 0" in c.stdout and "slime: ready" in c.stdout, c.stdout
    else:
        assert "missing:" in c.stdout and "apt-get install gcc" in c.stdout and "slime: refused" in c.stdout, c.stdout
        assert "preload-path rc 1" in c.stdout and "NativeLibraryMissing" not in c.stdout, c.stdout
        assert "not installed" in c.stdout.split("preload-path rc 1", 1)[1], c.stdout
