#!/usr/bin/env python3
"""Fetch the vLLM pieces the sleep-mode contract harness drives, on a CPU machine with a registry.

    python tools/vllm_contract/fetch.py            # vllm==0.33.* (else the newest on the registry)
    python tools/vllm_contract/fetch.py --version 0.33.0 --wheel /path/to/vllm-0.33.0-*.whl

Downloads vLLM's wheel (``pip download --no-deps``) and extracts, unmodified, into
``tools/vllm_contract/vllm_pkg/`` (git-ignored, ~100 KB, carried to the GPU machine):

* ``vllm/device_allocator/`` (``__init__``, ``alloc_conf``, ``cumem``, ``sleep_mode_backend``),
* ``vllm/cumem_allocator.abi3.so`` (vLLM's cuMem C extension; it needs only libcuda, and
  torch's libraries, which ``import torch`` has loaded, plus ``libnvrtc`` — the harness preloads
  it from the ``nvidia`` wheels),
* ``vllm/distributed/device_communicators/cuda_wrapper.py`` (the ctypes cudart wrapper),
* ``vllm/compilation/cudagraph_pool.py`` (the graph-capture pool routing),

and writes small stand-ins (written here, not vLLM's code) for the modules those import and the
harness does not exercise: ``vllm.logger``, ``vllm.envs``, ``vllm.platforms`` (a CUDA platform
with ``is_rocm() False``), ``vllm.utils.system_utils.find_loaded_library`` (reads
/proc/self/maps), ``vllm.utils.torch_utils.PIN_MEMORY``, ``vllm.config.VllmConfig`` (a name only)
and ``pynccl_allocator.set_graph_pool_id`` (records the id).  ``VERSION`` in the folder names the
wheel used.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, "vllm_pkg")

FILES = [
    "vllm/device_allocator/__init__.py",
    "vllm/device_allocator/alloc_conf.py",
    "vllm/device_allocator/cumem.py",
    "vllm/device_allocator/sleep_mode_backend.py",
    "vllm/cumem_allocator.abi3.so",
    "vllm/distributed/device_communicators/cuda_wrapper.py",
    "vllm/compilation/cudagraph_pool.py",
]

STANDINS = {
    "vllm/__init__.py": '"""Stand-in package: only the extracted sleep-mode modules live here."""\n',
    "vllm/logger.py": (
        "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n"),
    "vllm/envs.py": "VLLM_CUDART_SO_PATH = None\n",
    "vllm/platforms/__init__.py": (
        "import torch\n\n\nclass _Platform:\n    device_type = 'cuda'\n\n"
        "    def is_rocm(self):\n        return False\n\n"
        "    def is_cuda_alike(self):\n        return True\n\n"
        "    def is_cuda(self):\n        return True\n\n"
        "    def is_xpu(self):\n        return False\n\n"
        "    def is_sleep_mode_available(self):\n        return True\n\n"
        "    def graph_pool_handle(self):\n        return torch.cuda.graph_pool_handle()\n\n\n"
        "current_platform = _Platform()\n"),
    "vllm/utils/__init__.py": "",
    "vllm/utils/torch_utils.py": "PIN_MEMORY = True\n",
    "vllm/utils/system_utils.py": (
        "def find_loaded_library(lib_name):\n"
        "    \"\"\"Path of a loaded shared library whose file name starts with lib_name.\"\"\"\n"
        "    with open('/proc/self/maps') as f:\n"
        "        for line in f:\n"
        "            path = line.split()[-1]\n"
        "            if '/' in path and path.rsplit('/', 1)[1].startswith(lib_name):\n"
        "                return path\n"
        "    return None\n"),
    "vllm/config/__init__.py": "class VllmConfig:  # a name for annotations only\n    pass\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/pynccl_allocator.py": (
        "GRAPH_POOL_IDS = []\n\n\ndef set_graph_pool_id(pool_id):\n    GRAPH_POOL_IDS.append(pool_id)\n"),
    "vllm/compilation/__init__.py": "",
}


def download(version: str, where: str) -> str:
    for spec in ([f"vllm=={version}"] if version else ["vllm==0.33.*", "vllm"]):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "-d", where, spec], capture_output=True, text=True)
        wheels = sorted(glob.glob(os.path.join(where, "vllm-*.whl")))
        if r.returncode == 0 and wheels:
            if spec == "vllm":
                print(f"vllm 0.33 is not on this registry; took the newest: {os.path.basename(wheels[-1])}")
            return wheels[-1]
        print(f"pip download {spec} failed:\n{r.stdout[-800:]}{r.stderr[-800:]}", file=sys.stderr)
    raise SystemExit("could not download a vLLM wheel; pass --wheel PATH to one you have")


def extract(wheel: str, dest: str = DEST) -> None:
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in FILES:
            if f not in names:
                raise SystemExit(f"{os.path.basename(wheel)} has no {f}: this harness needs vLLM >= 0.32 "
                                 "(pluggable sleep-mode backends)")
            out = os.path.join(dest, f)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(f) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    for f, text in STANDINS.items():
        out = os.path.join(dest, f)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text)
    with open(os.path.join(dest, "VERSION"), "w") as fh:
        fh.write(os.path.basename(wheel).split("-")[1] + "\n")
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(dest) for f in fs)
    print(f"extracted {len(FILES)} vLLM files + {len(STANDINS)} stand-ins into {dest} ({total / 1024:.0f} KiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="", help="exact vLLM version (default: 0.33.*, else the newest)")
    ap.add_argument("--wheel", help="use this wheel instead of downloading")
    args = ap.parse_args()
    if args.wheel:
        extract(args.wheel)
        return
    with tempfile.TemporaryDirectory() as tmp:
        extract(download(args.version, tmp))


if __name__ == "__main__":
    main()
