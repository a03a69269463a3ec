"""The vLLM contract tools (``tools/vllm_contract/``) on a CPU: what ``fetch.py`` takes from a
wheel of each vLLM version, and that each extracted tree imports with its stand-ins, tells what
that version offers (``harness.Contract``) and drives unisleep's allocator through that version's
own sleep-mode code.  The GPU run itself is tests/cuda/test_vllm_contract.py and the tools.

The tree tests run on the trees ``python tools/vllm_contract/fetch.py [--version X]`` extracted
(none in a fresh clone: they skip, naming the command).  vLLM's cuMem C extension needs libcuda,
absent here: each tree is copied without it, so ``cumem.py`` takes its own no-extension branch
(``cumem_available = False``) and the allocator is unisleep's on host memory.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools", "vllm_contract")
sys.path.insert(0, TOOLS)
import fetch  # noqa: E402

TREES = sorted(d for d in glob.glob(os.path.join(TOOLS, "vllm_pkg*")) if os.path.isdir(os.path.join(d, "vllm")))


def _wheel(path, version, files):
    with zipfile.ZipFile(path, "w") as z:
        for f in files:
            body = b"def get_mem_allocator_instance():\n    pass\n" if f.endswith("device_allocator/__init__.py") else b"x = 1\n"
            z.writestr(f, body)
        z.writestr(f"vllm-{version}.dist-info/METADATA", "Name: vllm\n")
    return str(path)


def test_fetch_takes_what_a_version_has(tmp_path):
    """0.24's wheel has no sleep_mode_backend.py, alloc_conf.py nor cudagraph_pool.py: fetch takes
    the rest, names what is absent, writes VERSION and a MANIFEST of what it took."""
    w = _wheel(tmp_path / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0.24.0", fetch.REQUIRED)
    dest = tmp_path / "vllm_pkg-0.24.0"
    taken = fetch.extract(w, str(dest))
    assert taken == fetch.REQUIRED
    assert (dest / "VERSION").read_text().strip() == "0.24.0"
    listed = [line.split()[1] for line in (dest / "MANIFEST").read_text().splitlines() if not line.startswith("#")]
    assert listed == fetch.REQUIRED
    for f in fetch.STANDINS:
        assert (dest / f).exists(), f
    assert not (dest / "vllm/device_allocator/sleep_mode_backend.py").exists()
    assert fetch.dest_for("0.24.0").endswith("vllm_pkg-0.24.0") and fetch.dest_for("") == fetch.DEST


def test_fetch_refuses_a_wheel_without_the_allocator(tmp_path):
    w = _wheel(tmp_path / "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0.23.0",
               ["vllm/device_allocator/__init__.py"])
    dest = tmp_path / "out"
    with pytest.raises(SystemExit, match="needs vLLM >= 0.24"):
        fetch.extract(w, str(dest))
    assert not dest.exists()  # nothing replaced


def test_harness_takes_a_version_for_its_tree(tmp_path, monkeypatch):
    import harness

    monkeypatch.delenv(harness.PKG_ENV, raising=False)
    assert harness.resolve_pkg() == harness.DEFAULT_PKG
    monkeypatch.setenv(harness.PKG_ENV, str(tmp_path))
    assert harness.resolve_pkg() == str(tmp_path)
    with pytest.raises(SystemExit, match=r"fetch.py --version 9.9.9"):
        harness.put_on_path(os.path.join(TOOLS, "vllm_pkg-9.9.9"))


#: what each vLLM's own files say (read from the wheels' source)
EXPECT = {
    "0.24.0": {"sleep_mode_backend_factory": False, "allocator_discard": False, "release_pools": False,
               "sleep_backend": "unavailable", "cumem": "WorkerCalls", "unisleep": "WorkerCalls"},
    "0.27.1": {"sleep_mode_backend_factory": True, "allocator_discard": False, "release_pools": True,
               "sleep_backend": "registered", "cumem": "CuMemBackend", "unisleep": "CuMemBackend"},
    "0.29.0": {"sleep_mode_backend_factory": True, "allocator_discard": True, "release_pools": True,
               "sleep_backend": "registered", "cumem": "CuMemBackend", "unisleep": "CuMemBackend"},
    "0.33.0": {"sleep_mode_backend_factory": True, "allocator_discard": True, "release_pools": True,
               "sleep_backend": "registered", "cumem": "CuMemBackend", "unisleep": "UnisleepSleepBackend"},
}

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import harness
harness.put_on_path(sys.argv[2])
import torch
from unisleep.vllm_worker import plugin
status = plugin.register()
c = harness.Contract()
out = {"contract": c.as_dict(), "sleep_backend": status["sleep_backend"]}
from vllm.device_allocator import cumem
out["cumem_available"] = cumem.cumem_available
import vllm.device_allocator as da
out["patched"] = bool(getattr(da.get_mem_allocator_instance, "_unisleep", False)) and \
    bool(getattr(cumem.CuMemAllocator.get_instance, "_unisleep", False))
for name in ("cumem", "unisleep"):
    plugin.select_allocator(name == "unisleep")
    backend, route = c.route(name)
    out[name] = type(backend).__name__
# the unisleep route, driven by this vLLM's own backend (or the worker's calls), on host memory
plugin.select_allocator(True)
backend, _ = c.route("unisleep")
a = da.get_mem_allocator_instance()
out["allocator"] = type(a).__name__
with a.use_memory_pool(tag="weights"):
    w = a.lifecycle.empty((1 << 20,), torch.uint8, tag=a.current_tag)
with a.use_memory_pool(tag="kv_cache"):
    kv = a.lifecycle.empty((1 << 20,), torch.uint8, tag=a.current_tag)
w.fill_(5)
backend.suspend(1)
out["asleep"] = sorted(k for k, v in a.lifecycle.state().items() if v != "awake")
backend.resume(["weights"])
backend.resume(["kv_cache"])
out["weights_back"] = int(w.sum()) == 5 * (1 << 20)
out["awake"] = sorted(k for k, v in a.lifecycle.state().items() if v == "awake")
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not TREES, reason="no extracted vLLM tree: run `python tools/vllm_contract/fetch.py "
                                      "--version 0.24.0,0.27.1,0.29.0` (and without --version for 0.33) first")
@pytest.mark.parametrize("tree", TREES, ids=os.path.basename)
def test_tree_imports_and_drives_the_allocator(tree, tmp_path):
    copy = tmp_path / os.path.basename(tree)
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("VLLM_CONTRACT_PKG", None)
    p = subprocess.run([sys.executable, "-c", CHILD, TOOLS, str(copy)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    c = out["contract"]
    want = EXPECT.get(c["version"])
    if want is None:
        pytest.skip(f"vLLM {c['version']}: no expectation recorded here (known: {', '.join(EXPECT)})")
    assert out["cumem_available"] is False  # the extension left out, cumem.py's own branch
    assert out["patched"], out
    assert out["sleep_backend"].startswith(want["sleep_backend"]), out["sleep_backend"]
    for k in ("sleep_mode_backend_factory", "allocator_discard", "release_pools"):
        assert c[k] == want[k], (k, c)
    assert out["cumem"] == want["cumem"] and out["unisleep"] == want["unisleep"], out
    # graph-pool routing and the runtime tag: 0.33 only, said in the notes where absent
    assert c["graph_pool_routing"] == c["runtime_tag"] == (c["version"] == "0.33.0"), c
    if c["version"] != "0.33.0":
        assert any("graph-capture pool" in n for n in c["notes"]), c["notes"]
    assert len(c["manifest"]) >= 4 and all(len(line.split()[0]) == 64 for line in c["manifest"])
    assert out["allocator"] == "UnisleepAllocator"
    assert out["asleep"] == ["kv_cache", "weights"] and out["weights_back"], out
    assert {"weights", "kv_cache"} <= set(out["awake"]), out
