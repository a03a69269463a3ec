"""Each pip extra installs a set that works together (docs/install.md has the dry runs): read from
pyproject.toml and checked offline, with vllm-ascend's own pins where its source is unpacked."""

from __future__ import annotations

import os
import re
import sys

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extras() -> dict[str, list[Requirement]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return {k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()}


def _applies(req: Requirement, **env) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def _one(extra: str, name: str, **env) -> Requirement:
    found = [r for r in extras()[extra] if r.name == name and _applies(r, **env)]
    assert len(found) == 1, (extra, name, env, found)
    return found[0]


@pytest.mark.parametrize("major", [12, 13])
def test_cuda_extras_pin_one_major_each(major):
    r = _one(f"cuda{major}", "cuda-bindings")
    assert f"{major}.9" in r.specifier and f"{major + 1}.0" not in r.specifier and f"{major - 1}.9" not in r.specifier
    assert "cuda" not in extras()  # no extra that lets the major float


def test_rocm_extra_pulls_no_torch_and_no_amdsmi():
    """A ROCm torch comes from ROCm's wheel index and amdsmi from the ROCm install (its
    libamd_smi): the extra must not drag the index's CUDA torch or another amdsmi in."""
    names = {r.name for r in extras()["rocm"]}
    assert not names & {"torch", "amdsmi"}


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_vllm_extra_resolves_on_every_python_unisleep_supports(python):
    """vLLM >= 0.32 requires Python 3.11 (its Requires-Python); on 3.10 the extra takes 0.31."""
    env = {"python_version": python, "python_full_version": python + ".0"}
    r = _one("vllm", "vllm", **env)
    if python == "3.10":
        assert "0.31.0" in r.specifier and "0.32.0" not in r.specifier
    else:
        assert "0.32.0" in r.specifier


def _vllm_ascend_pins():
    """(torch, torch-npu) pins from vllm-ascend's released requirements.txt, where its source is
    unpacked (make test does it) or installed."""
    base = os.environ.get("UNISLEEP_VLLM_ASCEND_SRC") or os.path.join(sys.prefix, "vllm-ascend-src")
    path = os.path.join(base, "requirements.txt")
    if not os.path.exists(path):
        pytest.skip(f"needs vllm-ascend's release source in {base} (make test unpacks it)")
    pins = {}
    for line in open(path):
        m = re.match(r"\s*(torch|torch-npu)\s*==\s*([^\s#]+)", line)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def test_ascend_extra_pins_what_vllm_ascend_pins():
    """torch-npu exactly as vllm-ascend pins it; torch is left to torch-npu's own pin (its
    wheels require torch 2.10.0 on aarch64 and 2.10.0+cpu on x86_64), never a second pin here."""
    pins = _vllm_ascend_pins()
    for extra in ("ascend", "vllm-ascend"):
        assert str(_one(extra, "torch-npu").specifier) == f"=={pins['torch-npu']}", (extra, pins)
        assert not [r for r in extras()[extra] if r.name == "torch"]


def test_vllm_ascend_extra_applies_only_where_it_builds():
    (r,) = [r for r in extras()["vllm-ascend"] if r.name == "vllm-ascend"]
    assert r.marker is not None
    assert r.marker.evaluate({"platform_machine": "aarch64"}) and not r.marker.evaluate({"platform_machine": "x86_64"})
    with open(os.path.join(ROOT, "Makefile")) as f:  # the source the tests read is the release the extra pins
        assert f"VLLM_ASCEND ?= {str(r.specifier).lstrip('=')}" in f.read()


def test_cuda_bindings_checks_name_the_extra():
    from unisleep.backends.cuda import cu

    assert cu.bindings_vs_torch("13.3.1", "13.0") is None  # the H200's pair (torch 2.11.0+cu130)
    assert "unisleep[cuda12]" in cu.bindings_vs_torch("13.3.1", "12.8")
    assert cu.bindings_vs_driver("13.3.1", 13000) is None
    assert "unisleep[cuda12]" in cu.bindings_vs_driver("13.3.1", 12080)


def test_install_extra_follows_torchs_cuda_build(monkeypatch):
    from unisleep import platform as plat
    from unisleep.backends.cuda import detect as cuda_detect

    monkeypatch.setattr(cuda_detect, "torch_version", lambda attr: "13.0" if attr == "cuda" else None)
    assert plat.install_extra("cuda") == "cuda13"
    monkeypatch.setattr(cuda_detect, "torch_version", lambda attr: "12.8" if attr == "cuda" else None)
    assert plat.install_extra("cuda") == "cuda12"
    monkeypatch.setattr(cuda_detect, "torch_version", lambda attr: None)
    assert plat.install_extra("cuda") == "cuda12"  # no CUDA build of torch: the descriptor's default
    assert plat.install_extra("rocm") == "rocm" and plat.install_extra("ascend") == "ascend"
    assert all(plat.install_extra(n) in extras() for n in plat.platform_names() if n != "host")


def test_test_extra_is_test_core_plus_ray_and_test_core_has_no_ray():
    """The vendor CI images keep their own ray: test-core is everything the tests need but ray;
    test (the CPU CI's) is test-core plus the ray its Ray tests run against."""
    ex = extras()
    assert not [r for r in ex["test-core"] if r.name == "ray"]
    assert {str(r) for r in ex["test"]} == {"unisleep[test-core]", "ray==2.60.0"}
