#!/usr/bin/env python3
"""Fetch the vLLM pieces the sleep-mode contract harness drives, on a CPU machine with a registry.

    python tools/vllm_contract/fetch.py                          # vllm==0.33.* (else the newest) into vllm_pkg/
    python tools/vllm_contract/fetch.py --version 0.24.0,0.27.1,0.29.0   # each into vllm_pkg-<version>/
    python tools/vllm_contract/fetch.py --version 0.33.0 --wheel /path/to/vllm-0.33.0-*.whl --dest DIR

Downloads vLLM's wheel (``pip download --no-deps``, the manylinux x86_64 CUDA wheel), extracts,
unmodified, into ``tools/vllm_contract/vllm_pkg/`` (no ``--version``), ``vllm_pkg-<version>/``
(``--version``; both git-ignored, ~100 KB, carried to the GPU machine) or ``--dest``, and deletes
the wheel.  ``harness.py`` and ``capture_loop.py`` pick a tree with ``--vllm-pkg DIR|VERSION``
(or ``VLLM_CONTRACT_PKG``).  The files, those a version has:

* ``vllm/device_allocator/__init__.py`` and ``cumem.py`` (every version from 0.24),
  ``sleep_mode_backend.py`` (from 0.25: ``SleepModeBackendFactory``), ``alloc_conf.py`` (0.33),
* ``vllm/cumem_allocator.abi3.so`` (vLLM's cuMem C extension; it needs only libcuda, and
  torch's libraries, which ``import torch`` has loaded, plus ``libnvrtc`` — the harness preloads
  it from the ``nvidia`` wheels),
* ``vllm/distributed/device_communicators/cuda_wrapper.py`` (the ctypes cudart wrapper),
* ``vllm/compilation/cudagraph_pool.py`` (the graph-capture pool routing, 0.33),

and writes small stand-ins (written here, not vLLM's code) for the modules those import and the
harness does not exercise: ``vllm.logger``, ``vllm.envs``, ``vllm.platforms`` (a CUDA platform
with ``is_rocm() False``), ``vllm.utils.system_utils.find_loaded_library`` (reads
/proc/self/maps), ``vllm.utils.torch_utils.PIN_MEMORY``, ``vllm.config.VllmConfig`` (a name only)
and ``pynccl_allocator.set_graph_pool_id`` (records the id).  ``VERSION`` in the folder names the
wheel used; ``MANIFEST`` lists each extracted file with its sha256 (the harness's JSON repeats it).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, "vllm_pkg")

#: every version from 0.24 has these (the cuMem allocator, its C extension, the cudart wrapper)
REQUIRED = [
    "vllm/device_allocator/__init__.py",
    "vllm/device_allocator/cumem.py",
    "vllm/cumem_allocator.abi3.so",
    "vllm/distributed/device_communicators/cuda_wrapper.py",
]
#: taken where the version has them: the pluggable backends (0.25), the allocator-settings
#: helper cumem.py imports (0.33), the graph-capture pool routing (0.33)
OPTIONAL = [
    "vllm/device_allocator/sleep_mode_backend.py",
    "vllm/device_allocator/alloc_conf.py",
    "vllm/compilation/cudagraph_pool.py",
]
FILES = REQUIRED + OPTIONAL

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


def dest_for(version: str) -> str:
    """Where ``--version`` extracts by default: ``vllm_pkg/`` for none, else ``vllm_pkg-<version>/``."""
    return DEST if not version else os.path.join(HERE, f"vllm_pkg-{version}")


def extract(wheel: str, dest: str = DEST) -> list[str]:
    """Extract the files this wheel has of :data:`FILES` (all of :data:`REQUIRED`) and the
    stand-ins into ``dest`` (replaced); returns the vLLM files taken."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [f for f in REQUIRED if f not in names]
        if not missing and b"def get_mem_allocator_instance" not in z.read("vllm/device_allocator/__init__.py"):
            missing = ["vllm/device_allocator/__init__.py: get_mem_allocator_instance"]
        if missing:
            raise SystemExit(f"{os.path.basename(wheel)} has no {', '.join(missing)}: this harness needs "
                             "vLLM >= 0.24 (get_mem_allocator_instance and the cuMem allocator)")
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        taken = [f for f in FILES if f in names]
        for f in taken:
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
    with open(os.path.join(dest, "MANIFEST"), "w") as fh:
        fh.write(f"# extracted unmodified from {os.path.basename(wheel)}\n")
        for f in taken:
            with open(os.path.join(dest, f), "rb") as src:
                fh.write(f"{hashlib.sha256(src.read()).hexdigest()}  {f}\n")
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(dest) for f in fs)
    absent = [os.path.basename(f) for f in OPTIONAL if f not in taken]
    print(f"extracted {len(taken)} vLLM files + {len(STANDINS)} stand-ins into {dest} ({total / 1024:.0f} KiB)"
          + (f"; not in this version: {', '.join(absent)}" if absent else ""))
    return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="",
                    help="exact vLLM version(s), comma-separated, each into vllm_pkg-<version>/ "
                         "(default: 0.33.*, else the newest, into vllm_pkg/)")
    ap.add_argument("--wheel", help="use this wheel instead of downloading (one version)")
    ap.add_argument("--dest", help="extract here instead (one version)")
    args = ap.parse_args()
    versions = [v.strip() for v in args.version.split(",") if v.strip()] or [""]
    if len(versions) > 1 and (args.wheel or args.dest):
        ap.error("--wheel and --dest take one version")
    for v in versions:
        dest = os.path.abspath(args.dest) if args.dest else dest_for(v)
        if args.wheel:
            extract(args.wheel, dest)
            continue
        with tempfile.TemporaryDirectory() as tmp:  # the wheel (~300 MB) goes with it
            extract(download(v, tmp), dest)


if __name__ == "__main__":
    main()
