#!/usr/bin/env python3
"""Copy torch_memory_saver's own public-API examples into ``tools/tms_examples/upstream/``
(git-ignored; carried to a GPU machine that has no network), unmodified, from a clone of its
repository (fzyzcjy/torch_memory_saver) at a given release tag or commit:

    python tools/tms_examples/fetch.py --repo /path/to/torch_memory_saver --ref <tag-or-commit>
    python tools/tms_examples/fetch.py --url https://github.com/fzyzcjy/torch_memory_saver --ref <tag>

Copied: ``test/examples/*.py``, ``test/test_examples.py`` (the list of cases run.py follows) and
the two helper modules the examples import, ``torch_memory_saver/testing_utils.py`` and
``torch_memory_saver/utils.py`` (run.py serves them as submodules of unisleep's facade).  ``REF``
in the folder names the commit used.  Nothing here is imported by unisleep or its tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, "upstream")
HELPERS = ("torch_memory_saver/testing_utils.py", "torch_memory_saver/utils.py")


def git(*args: str, cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def export(repo: str, ref: str, dest: str = DEST) -> str:
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}", cwd=repo).strip()
    names = [n for n in git("ls-tree", "-r", "--name-only", commit, "test", "torch_memory_saver", cwd=repo).split()
             if (n.startswith("test/examples/") and n.endswith(".py")) or n == "test/test_examples.py" or n in HELPERS]
    if not any(n.startswith("test/examples/") for n in names):
        raise SystemExit(f"{ref} ({commit[:12]}) has no test/examples/: pick a release that has them")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    for n in names:
        out = os.path.join(dest, n)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(subprocess.run(["git", "show", f"{commit}:{n}"], cwd=repo, check=True, capture_output=True).stdout)
    with open(os.path.join(dest, "REF"), "w") as f:
        f.write(f"{ref} {commit}\n")
    print(f"copied {len(names)} files of torch_memory_saver at {ref} ({commit[:12]}) into {dest}")
    return commit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--repo", help="a local clone (or bare mirror) of torch_memory_saver")
    src.add_argument("--url", help="clone from this URL (needs network)")
    ap.add_argument("--ref", required=True, help="release tag or commit to copy the examples from")
    args = ap.parse_args()
    if args.repo:
        export(args.repo, args.ref)
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "clone", "-q", args.url, tmp], check=True)
        export(tmp, args.ref)


if __name__ == "__main__":
    sys.exit(main())
