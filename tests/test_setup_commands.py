"""The set-up a newcomer meets: the README's two commands on a fresh machine (``make demo`` runs the
demo on the embedded default, ``make test`` passes the tests), CI runs exactly that test command,
and everything the commands write by default goes under ``out/``, which git ignores."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _commands(script: str) -> list[str]:
    """The command lines of a shell text: no comments, blank lines or ``set``/``cd`` set-up lines."""
    out = []
    for ln in script.splitlines():
        ln = ln.split("#", 1)[0].strip()
        if ln and not re.match(r"(set|cd)\b", ln):
            out.append(ln)
    return out


def _recipe(makefile: str, target: str) -> list[str]:
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.MULTILINE)
    assert m, f"the Makefile has no {target} target with a recipe"
    return [ln.strip() for ln in m.group(1).splitlines()]


def test_readme_gives_two_commands_for_a_fresh_machine():
    readme = _read("README.md")
    section = readme.split("\n## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, section
    assert _commands(block.group(1)) == ["make demo", "make test"]


def test_make_demo_runs_the_demo_on_the_embedded_default():
    """``make demo``: ``unisleep demo`` with its defaults — the embedded engine on host memory (the
    embedded default platform), whatever accelerator the machine has — output under out/."""
    recipe = _recipe(_read("Makefile"), "demo")
    assert len(recipe) == 1 and re.fullmatch(r"\$\(BIN\)/unisleep demo( --out out/demo)?", recipe[0]), recipe
    from unisleep.demo.cli import build_parser, platform_for

    args = build_parser().parse_args([])
    assert args.engine == "torch" and args.model is None and not args.ray, args
    assert platform_for(args.device).name == "host", args.device


def test_ci_runs_exactly_the_readme_test_command():
    assert _commands(_read(".ci", "run")) == ["make test"]
    recipe = _recipe(_read("Makefile"), "test")  # every test: no marker left out
    assert re.fullmatch(r"(\w+=\S+ )*\$\(BIN\)/python -m pytest", recipe[-1]), recipe
    # before it only the environments' `pip check` summaries (tools/pip_unmet.py)
    assert all(ln.startswith("$(BIN)/python tools/pip_unmet.py ") for ln in recipe[:-1]), recipe


def test_default_outputs_go_under_an_ignored_out_folder():
    lines = [ln.strip() for ln in _read(".gitignore").splitlines()]
    assert "/out/" in lines or "out/" in lines, lines
    from unisleep.bench.common import default_json
    from unisleep.demo.cli import build_parser

    assert os.path.normpath(build_parser().parse_args([]).out) == os.path.join("out", "demo")
    assert os.path.normpath(default_json("host")) == os.path.join("out", "bench-host.json")
    if shutil.which("git") and os.path.exists(os.path.join(ROOT, ".git")):  # as git itself reads .gitignore
        for path in ("out/demo/demo.json", "out/demo/demo.png", "out/bench-host.json"):
            r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
            assert r.returncode == 0, f"git does not ignore {path}"
