"""The ``unisleep`` command line as a user runs it (every call is a real ``python -m unisleep``
process): help exits 0 in plain text, ``--version``, a mistyped command is named with the closest
one, every subcommand's ``--help`` lists its options, ``bench --size`` that cannot fit is refused
before anything is allocated, and ``bench --check`` turns a missed goal into a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import unisleep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RST = re.compile(r"``|:(mod|class|func|meth|attr):`|^\s*=+\s+=+", re.MULTILINE)


def cli(*args: str, timeout: float = 120, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "UNISLEEP_SPILL_DIR")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "unisleep", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def options_of(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and a.help != "==SUPPRESS=="}


# ------------------------------------------------------------------------- the top level
@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["--help"], ["-h"], ["-v", "--help"]])
def test_help_exits_zero_in_plain_text(args):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: unisleep")
    for name in ("doctor", "demo", "bench", "--version"):
        assert name in r.stdout
    assert not RST.search(r.stdout), r.stdout
    assert r.stderr == ""


@pytest.mark.slow
def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"unisleep {unisleep.__version__}"


@pytest.mark.slow
@pytest.mark.parametrize("typo,closest", [("docter", "doctor"), ("demoo", "demo"), ("bnech", "bench")])
def test_unknown_command_names_the_closest(typo, closest):
    r = cli(typo)
    assert r.returncode == 2
    assert f"unknown command '{typo}'" in r.stderr and f"Did you mean '{closest}'?" in r.stderr
    assert "usage:" not in r.stdout  # not a silent dump of the help


@pytest.mark.slow
def test_unknown_command_without_a_close_one():
    r = cli("xyzzy")
    assert r.returncode == 2 and "unknown command 'xyzzy'" in r.stderr and "Did you mean" not in r.stderr
    assert "doctor, demo, bench" in r.stderr


@pytest.mark.slow
def test_unknown_global_option():
    r = cli("--frobnicate", "doctor")
    assert r.returncode == 2 and "--frobnicate" in r.stderr


# ------------------------------------------------------------------------- each command's --help
def _parsers():
    from unisleep.bench import chunk_sweep, host, transfer
    from unisleep.demo import build_parser

    yield ("demo", "--help"), options_of(build_parser())
    yield ("bench", "--help"), options_of(host.build_parser()) | {"--transfer", "--chunk-sweep", "--backend"}
    yield ("doctor", "--help"), {"--json"}
    # the other bench modes: the options their own parser declares (read from the source's add_argument calls)
    for mod, flag in ((transfer, "--transfer"), (chunk_sweep, "--chunk-sweep")):
        src = open(mod.__file__).read()
        yield ("bench", flag, "--help"), set(re.findall(r'add_argument\("(--[a-z-]+)"', src))


@pytest.mark.slow
@pytest.mark.parametrize("args,options", list(_parsers()), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_help_lists_its_options(args, options):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    missing = [o for o in sorted(options) if o not in r.stdout]
    assert options and not missing, f"{' '.join(args)} does not list {missing}:\n{r.stdout}"
    assert not RST.search(r.stdout), r.stdout


@pytest.mark.slow
def test_bench_help_names_the_host_options():
    out = cli("bench", "--help").stdout
    for opt in ("--size", "--cycles", "--spill-dir", "--json", "--out", "--check"):
        assert opt in out


@pytest.mark.slow
def test_device_bench_help():
    """The device benchmark's options are listed without an accelerator (nothing is touched)."""
    r = cli("bench", "--backend", "cuda", "--help")
    assert r.returncode == 0 and "--weights" in r.stdout and "--kv" in r.stdout and not RST.search(r.stdout)


# ------------------------------------------------------------------------- bench --size and --check
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo (needs Linux >= 3.14)")


@pytest.mark.slow
@pytest.mark.parametrize("size", ["10TB", "{4x}"])
def test_bench_refuses_a_size_that_cannot_fit(tmp_path, size):
    if size == "{4x}":
        size = str(4 * _mem_available())
    spill = tmp_path / "spill"
    r = cli("bench", "--size", size, "--spill-dir", str(spill), "--json", str(tmp_path / "b.json"), timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "does not fit in memory" in r.stderr and "MemAvailable" in r.stderr and "Pass --size" in r.stderr
    assert "Traceback" not in r.stderr and "[bench] host bench" not in r.stderr  # nothing started
    assert not spill.exists() and not (tmp_path / "b.json").exists()
    # the size it suggests is accepted by the same check
    from unisleep.bench.host import check_room, parse_size

    hint = re.search(r"Pass --size (\S+) or less", r.stderr).group(1)
    assert check_room(parse_size(hint), str(spill)) == str(spill)


@pytest.mark.slow
def test_bench_refuses_a_size_that_does_not_fit_in_the_spill_dir(tmp_path):
    """A 16 MB filesystem as the spill directory: 32 MiB fits in memory but its two spill files do not."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "trust"))
    from trust_helpers import small_filesystem

    with small_filesystem(16, tmp_path) as (mnt, kind):
        spill = os.path.join(mnt, "spill")
        r = cli("bench", "--size", "32M", "--spill-dir", spill, "--json", str(tmp_path / "b.json"), timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"does not fit in the spill directory {spill}" in r.stderr, r.stderr
        assert f"{mnt} has" in r.stderr and "Pass --size" in r.stderr and "--spill-dir" in r.stderr
        assert not os.path.exists(spill) and not (tmp_path / "b.json").exists()  # nothing created


@pytest.mark.slow
def test_the_size_suggested_fits_the_spill_dir_too(tmp_path):
    """Memory refuses the size first, but the spill directory (a 16 MB filesystem) holds less:
    the size the message suggests fits both, and the message says the directory is the limit."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "trust"))
    from trust_helpers import small_filesystem

    from unisleep.bench.host import check_room, parse_size

    with small_filesystem(16, tmp_path) as (mnt, kind):
        spill = os.path.join(mnt, "spill")
        r = cli("bench", "--size", "10TB", "--spill-dir", spill, "--json", str(tmp_path / "b.json"), timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "does not fit in memory" in r.stderr and f"the spill directory {mnt} has room for" in r.stderr, r.stderr
        hint = re.search(r"Pass --size (\S+) or less", r.stderr).group(1)
        assert parse_size(hint) <= 8 << 20  # half of the 16 MB: the backup and the limit's file
        assert check_room(parse_size(hint), spill) == spill  # accepted by both checks


@pytest.mark.slow
def test_bench_refuses_a_file_as_spill_dir(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    r = cli("bench", "--size", "1M", "--spill-dir", str(f), timeout=60)
    assert r.returncode == 2 and "is a file" in r.stderr and str(f) in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True])
def test_bench_check_exit_code_follows_the_table(tmp_path, check):
    out = tmp_path / "b.json"
    r = cli("bench", "--size", "4M", "--cycles", "1", "--spill-dir", str(tmp_path / "s"), "--json", str(out),
            *(["--check"] if check else []), timeout=300)
    doc = json.loads(out.read_text())
    missed = [row["operation"] for row in doc["results"]["rows"] if row["met"] is False]
    assert doc["results"]["missed"] == missed
    table_no = [ln for ln in r.stdout.splitlines() if re.search(r"\sNO\s*$", ln)]
    assert len(table_no) == len(missed)
    if check and missed:
        assert r.returncode == 1 and "goal missed" in r.stdout
    else:
        assert r.returncode == 0, r.stderr
        assert ("goal missed" in r.stdout) == bool(missed)


# ------------------------------------------------------------------------- a script beside the clone folder
SCRIPT = "from unisleep import MemoryLifecycle\nprint('imported', MemoryLifecycle.__module__)\n"


def _run_script(where, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    script = where / "use_unisleep.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(where), env=env,
                          timeout=120)


@pytest.mark.slow
def test_script_beside_a_folder_named_unisleep(tmp_path):
    """A clone in a folder named unisleep/ (the default name) does not shadow the installed package
    for a script run from the folder above it, editable install (a path entry, as make makes it) or
    not: a regular package found anywhere on the path wins over a folder without __init__.py."""
    (tmp_path / "unisleep").mkdir()  # the clone's folder as seen from above: no __init__.py at its top
    (tmp_path / "unisleep" / "README.md").write_text("a clone\n")
    r = _run_script(tmp_path)
    assert r.returncode == 0 and "imported unisleep.lifecycle" in r.stdout, r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _run_script(elsewhere)
    assert r.returncode == 0 and "imported unisleep.lifecycle" in r.stdout, r.stderr


@pytest.mark.slow
def test_script_inside_the_clone_works(tmp_path):
    script = os.path.join(ROOT, f"_use_unisleep_{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(SCRIPT + "import unisleep.backends.host\n")
    try:
        r = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    finally:
        os.unlink(script)
    assert r.returncode == 0 and "imported unisleep.lifecycle" in r.stdout, r.stderr


@pytest.mark.slow
def test_regular_install_beside_the_folder_works(tmp_path):
    """The README's fix `pip install .` (no -e): a regular package wins over the clone folder. Built
    from a copy of the sources, without dependencies or network."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("unisleep", "backends"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    beside = tmp_path / "work"
    (beside / "unisleep").mkdir(parents=True)
    r = _run_script(beside, {"PYTHONPATH": str(target)})
    assert r.returncode == 0 and "imported unisleep.lifecycle" in r.stdout, r.stderr


# ------------------------------------------------------------------------- what the docs promise
DOCS = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(
    os.path.join(ROOT, "docs"))) if f.endswith(".md")]
#: recorded results: their commands and logs must be rerunnable by a user too
RESULTS = [os.path.join(ROOT, "docs", "results", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs", "results")))
           if f.endswith((".json", ".txt", ".log"))]


def _recorded_commands(path: str) -> list[str]:
    """The commands a result file says it was made with ("command" fields of JSON, "# command:"
    lines of logs)."""
    out: list[str] = []
    if path.endswith(".json"):
        def walk(o, key=""):
            if isinstance(o, dict):
                for k, v in o.items():
                    walk(v, k)
            elif isinstance(o, list):
                for v in o:
                    walk(v, key)
            elif isinstance(o, str) and "command" in key:
                out.append(o)
        with open(path, encoding="utf-8") as f:
            walk(json.load(f))
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            out += [ln.split("command", 1)[1] for ln in f if re.match(r"#.*command", ln, re.I)]
    return out


def test_recorded_commands_can_be_rerun_from_a_clone():
    """A result names the command that made it, run from the repository: no absolute path in it
    (a path of the machine it ran on), except the file the command was told to write."""
    hits = []
    for path in RESULTS:
        for cmd in _recorded_commands(path):
            rest = re.sub(r"--(json|out)[ =]\S+", "", cmd)
            if re.search(r"(^|[\s=:])/[A-Za-z]", rest):
                hits.append(f"{os.path.relpath(path, ROOT)}: {cmd.strip()[:200]}")
    assert not hits, "\n".join(hits)


def test_docs_name_only_files_the_repository_has():
    """Every Markdown file the README and docs point to is in the repository."""
    missing = []
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for ref in sorted(set(re.findall(r"[\w./-]+\.md\b", text))):
            here = [ref, os.path.join(os.path.dirname(path), ref), os.path.join(ROOT, "docs", os.path.basename(ref))]
            if not any(os.path.exists(os.path.join(ROOT, c)) for c in here):
                missing.append(f"{os.path.relpath(path, ROOT)}: {ref}")
    assert not missing, "\n".join(missing)


def test_readme_and_lifecycle_doc_agree_with_the_library(lifecycle):
    """README: waking what is awake (and sleeping what already sleeps the same way) is a no-op; a
    level-1 sleep over a level-2 sleep and a level 3 sleep raise before anything changes."""
    import torch

    from unisleep.errors import InvalidArgumentError, InvalidTransitionError

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lifecycle_md = open(os.path.join(ROOT, "docs", "lifecycle.md"), encoding="utf-8").read()
    assert "(waking what is awake" in readme and "is a harmless no-op" in readme
    assert "raises a named error *before* anything" in readme
    assert "Waking an\n  awake tag is a no-op" in lifecycle_md or "Waking an awake tag is a no-op" in lifecycle_md

    lc = lifecycle
    w = lc.empty((1 << 16,), torch.uint8, tag="weights")
    w.fill_(7)
    lc.wake_up()  # awake: nothing happens
    assert lc.state() == {"weights": "awake"} and int(w[0]) == 7
    lc.sleep(2)
    lc.sleep(2)  # the same sleep again: nothing happens
    with pytest.raises(InvalidTransitionError):
        lc.sleep(1)  # level 1 over level 2
    with pytest.raises(InvalidArgumentError):
        lc.sleep(3)
    assert lc.state() == {"weights": "discarded"}
    lc.wake_up()
    lc.wake_up()
    assert lc.state() == {"weights": "awake"} and int(w.sum()) == 0
