"""tools/install_torch.py, which ``make demo`` / ``make test`` install torch with: the CPU build
from PyTorch's CPU wheel index, or — where that index cannot be reached — the default index after
saying so, naming a CUDA build before its download.  Run with ``--dry-run`` (pip resolves, nothing
is installed).  The index answering is a local HTTP server here (this project's CI machines cannot
reach PyTorch's), so that branch is checked up to the choice it makes, not through pip."""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.slow  # pip runs in a child process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "install_torch.py")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    return subprocess.run([sys.executable, TOOL, "--python", sys.executable, "--dry-run", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def _notes(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("install_torch: ")]


@pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus"),
                    reason="an NVIDIA GPU is present: the tool takes the default index's CUDA build there")
def test_unreachable_index_falls_back_saying_so_and_names_the_build():
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    r = _run("--index", index, "--ignore-installed", "torch==2.13.0")
    assert r.returncode == 0, r.stderr[-3000:]
    notes = _notes(r)
    assert notes[0].startswith(f"install_torch: PyTorch's CPU wheel index is not reachable ({index}/torch/: "), notes
    assert notes[0].endswith("trying the default package index for torch==2.13.0"), notes
    # what the default index gives, said before any download: a local cache may hold the CPU build
    assert len(notes) == 2 and (
        re.match(r"install_torch: the default package index has the CPU build: torch 2\.13\.0\+cpu", notes[1])
        or "NOTE: the default package index has only the CUDA build of torch 2.13.0" in notes[1]), notes


def test_a_cuda_build_is_named_before_its_download():
    """PyPI's torch 2.11.0 for Linux x86_64 is a CUDA build (the vLLM 0.24 environment takes it on
    purpose): said, with the CUDA packages it pulls, and how to get the CPU build."""
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    r = _run("--index", index, "--ignore-installed", "torch==2.11.0")
    assert r.returncode == 0, r.stderr[-3000:]
    note = _notes(r)[-1]
    if "has the CPU build" in note:
        pytest.skip("this machine's default index holds torch 2.11.0's CPU build")
    assert re.search(r"NOTE: the default package index has only the CUDA build of torch 2\.11\.0: it pulls \d+ CUDA "
                     r"packages \((cuda|nvidia)-", note), note
    assert "several GB" in note and f"make {index} reachable, or set TORCH_INDEX" in note
    assert "(--dry-run: nothing is installed)" in note


def test_a_reachable_index_gives_the_cpu_build():
    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu"
        r = _run("--index", index, "torch==2.13.0")
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr
    if os.path.isdir("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus"):
        assert "an NVIDIA GPU is present" in r.stderr
    else:
        assert _notes(r) == [f"install_torch: torch==2.13.0: the CPU build, from PyTorch's CPU wheel index {index}"]


def test_the_makefile_installs_torch_through_it():
    make = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert "TORCH_INDEX ?= https://download.pytorch.org/whl/cpu" in make
    recipes = [ln.strip() for ln in make.splitlines() if ln.startswith("\t")]
    torch_installs = [ln for ln in recipes if re.search(r"pip install[^\n]*(TORCH\)|torch==)", ln)]
    # every environment on the CPU torch goes through the tool; the vLLM 0.24 one takes PyPI's 2.11.0 on purpose
    assert torch_installs == ['$(VLLM024)/bin/pip install -q "torch==2.11.0" packaging'], torch_installs
    assert sum("$(INSTALL_TORCH)" in ln for ln in recipes) == 2
