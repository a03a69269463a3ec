"""Install one torch release into an environment as its CPU build, saying where it came from.

    python3 tools/install_torch.py --python .venv/bin/python torch==2.13.0

PyPI's Linux x86_64 ``torch`` wheels are CUDA builds: ``pip install torch==2.13.0`` pulls
``cuda-toolkit``, cuDNN, NCCL and the other ``nvidia-*`` wheels, several GB.  The CPU build
lives on PyTorch's CPU wheel index (``--index``, default https://download.pytorch.org/whl/cpu):

1. an NVIDIA GPU on this machine (``/proc/driver/nvidia/gpus``) or ``--index ''``: the default
   package index, as pip is set up (on an NVIDIA machine that is the CUDA build, said so);
2. the CPU index answers: torch from there, the CPU build;
3. it does not answer (no route, no DNS, a proxy refusing): said so, then the default package
   index, after asking pip (``--dry-run --report``) which build it would install there — a local
   cache or mirror may hold the CPU build; if it is the CUDA build, that is said before the
   download starts, with its size class and how to get the CPU build instead.

After installing, the build is read back from the environment (``torch.version.cuda``) and
printed.  ``--dry-run`` stops after step 3's question (nothing is installed).  Standard library
only: it runs with the interpreter that creates the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10.0


def say(msg: str) -> None:
    print(f"install_torch: {msg}", file=sys.stderr, flush=True)


def nvidia_gpu() -> bool:
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def probe(index: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``index``'s page for torch answers; otherwise why not (one line)."""
    url = index.rstrip("/") + "/torch/"
    cafile = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE") or None
    try:
        import ssl

        ctx = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout, context=ctx) as r:
            if r.status != 200:
                return f"HTTP {r.status} from {url}"
            return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} from {url}"
    except urllib.error.URLError as e:
        return f"{url}: {e.reason}"
    except (OSError, ValueError) as e:
        return f"{url}: {e}"


def pip(python: str, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args], text=True,
                          stdout=subprocess.PIPE if capture else None, check=False)


def would_install(python: str, spec: str, extra: list[str]) -> list[dict]:
    """What ``pip install spec`` would install from the default index: the report's entries
    (name, version, requires_dist, url)."""
    r = pip(python, "install", "--dry-run", "--quiet", "--report", "-", *extra, spec, capture=True)
    if r.returncode != 0:
        raise SystemExit(f"install_torch: pip cannot resolve {spec} from the default index (exit {r.returncode}); "
                         "see pip's message above")
    report = json.loads(r.stdout or "{}")
    out = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        out.append({"name": meta.get("name", ""), "version": meta.get("version", ""),
                    "requires_dist": meta.get("requires_dist") or [],
                    "url": (item.get("download_info") or {}).get("url", "")})
    return out


CUDA_DIST = re.compile(r"^(nvidia-|cuda-)", re.IGNORECASE)


def classify(items: list[dict]) -> tuple[str, list[str]]:
    """("cpu" | "cuda" | "installed", the CUDA distributions pulled) from a pip report's entries."""
    torch = next((i for i in items if i["name"].lower() == "torch"), None)
    if torch is None:
        return "installed", []
    cuda = sorted(i["name"] for i in items if CUDA_DIST.match(i["name"]))
    needs = [r for r in torch["requires_dist"] if CUDA_DIST.match(r) and "extra ==" not in r]
    if "+cpu" in torch["version"] or not (cuda or needs):
        return "cpu", []
    return "cuda", cuda or [re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in needs]


def installed_build(python: str) -> str:
    r = subprocess.run([python, "-W", "ignore", "-c", "import torch; print(torch.__version__, torch.version.cuda or '-', "
                        "torch.version.hip or '-')"], text=True, stdout=subprocess.PIPE, check=False)
    if r.returncode != 0:
        return "torch does not import"
    ver, cuda, hip = r.stdout.split()
    build = "CPU build" if cuda == "-" and hip == "-" else (f"CUDA {cuda} build" if cuda != "-" else f"ROCm {hip} build")
    return f"torch {ver} ({build})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="e.g. torch==2.13.0")
    ap.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    ap.add_argument("--index", default=os.environ.get("TORCH_INDEX", CPU_INDEX),
                    help=f"PyTorch's CPU wheel index, or a mirror of it ('' = the default index; default {CPU_INDEX})")
    ap.add_argument("--dry-run", action="store_true", help="say what would be installed; install nothing")
    ap.add_argument("--ignore-installed", action="store_true", help=argparse.SUPPRESS)  # for --dry-run in a test
    a = ap.parse_args(argv)
    extra = ["--ignore-installed"] if a.ignore_installed else []

    if not a.index:
        say(f"TORCH_INDEX is empty: {a.spec} from the default package index, whatever build it has")
    elif nvidia_gpu():
        say(f"an NVIDIA GPU is present (/proc/driver/nvidia/gpus): {a.spec} from the default package index "
            "(on Linux x86_64 that is the CUDA build, several GB with its nvidia-* libraries)")
    else:
        why = probe(a.index)
        if why is None:
            # the branch a machine that reaches PyTorch's index takes; this project's CI
            # machines cannot reach it, so CI runs the branch below
            say(f"{a.spec}: the CPU build, from PyTorch's CPU wheel index {a.index}")
            if a.dry_run:
                return 0
            r = pip(a.python, "install", "-q", "--index-url", a.index, a.spec)
            if r.returncode != 0:
                return r.returncode
            say(f"installed {installed_build(a.python)}")
            return 0
        say(f"PyTorch's CPU wheel index is not reachable ({why}); trying the default package index for {a.spec}")
    items = would_install(a.python, a.spec, extra)
    kind, cuda = classify(items)
    torch = next((i for i in items if i["name"].lower() == "torch"), None)
    if kind == "installed":
        say(f"{a.spec} is already installed: {installed_build(a.python)}")
        return 0
    if kind == "cpu":
        say(f"the default package index has the CPU build: torch {torch['version']} ({torch['url'] or 'cached'})")
    else:
        say(f"NOTE: the default package index has only the CUDA build of torch {torch['version']}: it pulls "
            f"{len(cuda)} CUDA packages ({', '.join(cuda[:4])}{', ...' if len(cuda) > 4 else ''}), several GB in "
            f"all. It runs on a CPU too{' (--dry-run: nothing is installed)' if a.dry_run else ', and is what gets installed now'}. "
            "For the CPU build (about 200 MB) make "
            f"{a.index} reachable, or set TORCH_INDEX to a mirror of it, and run make again after make clean.")
    if a.dry_run:
        return 0
    r = pip(a.python, "install", "-q", a.spec)
    if r.returncode != 0:
        return r.returncode
    say(f"installed {installed_build(a.python)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
