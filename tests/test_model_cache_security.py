"""Another user (uid 65534 through ``setpriv``) plants the tiny test model's cache before root
builds it (docs/security.md, "Model directories and secrets of child processes").

``build_tiny_llama(dir)`` reuses a directory that carries its marker.  A cache under ``/tmp`` that
another user made first — its marker, config and weights planted there, or reached through that
user's link — would have root load the attacker's files; so a model directory, its files, or
anything on the way to it that another user owns or may write is refused with
:class:`~unisleep.errors.ModelDirError`, before anything is read from it.  By default the models
are built in the user's private run directory.  The attacker is a standard-library Python run as
uid 65534; without root or ``setpriv`` the attacks skip, saying which is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import pytest

from nobody import NOBODY, as_nobody, stdlib_python_for_nobody

from unisleep.engines.tiny_model import MARKER, RECIPE_VERSION, build_tiny_llama, build_tiny_pair
from unisleep.errors import ModelDirError

#: uid 65534's side: a finished-looking tiny model (marker, config, "weights") at ``model``,
#: made under ``cache`` (a directory, or a link to one of its own at ``link``)
PLANT = r"""
import json, os, sys
cache, model, link, marker, recipe = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
if link != "-":  # the cache name is a link to a directory of ours
    real = cache + ".attacker"
    os.makedirs(real, exist_ok=True)
    os.symlink(real, link)
else:
    os.makedirs(cache, exist_ok=True)
os.makedirs(model)
files = {marker: json.dumps({"seed": 0, "recipe": recipe}),
         "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
         "model.safetensors": "the attacker's weights"}
for name, text in files.items():
    with open(os.path.join(model, name), "w") as f:
        f.write(text)
print("RESULT", os.lstat(model).st_uid)
"""


@pytest.fixture
def base():
    """A root-owned directory like /tmp (sticky, everyone may write) for the cache."""
    d = tempfile.mkdtemp(prefix="us-model-cache-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tree(d: str) -> dict:
    out = {}
    for root, dirs, files in os.walk(d):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.join(root, f)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cache-made-by-them", "cache-writable-by-others", "cache-is-their-link"])
def test_a_planted_model_cache_is_refused(base, case):
    """uid 65534 makes the cache root will build in (``/tmp/tiny-models``), or plants a model in
    root's world-writable cache, or links the cache name to its own directory, with a
    finished-looking model (marker, config, weights) in it.  Root's ``build_tiny_pair`` refuses it
    with ModelDirError naming the directory, its owner or its mode, and the fix; it reads nothing
    there and changes nothing (before: it returned the planted directory, and vLLM loaded it)."""
    python = stdlib_python_for_nobody()
    cache = os.path.join(base, "tiny-models")
    if case == "cache-writable-by-others":
        os.mkdir(cache)
        os.chmod(cache, 0o777)
    model = os.path.join(cache, "tiny-llama-s0")
    script = os.path.join(base, "plant.py")
    with open(script, "w") as f:
        f.write(PLANT)
    os.chmod(script, 0o644)
    link = cache if case == "cache-is-their-link" else "-"
    r = subprocess.run(as_nobody(["-I", "-S", script, cache, model, link, MARKER, str(RECIPE_VERSION)], python=python),
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and f"RESULT {NOBODY}" in r.stdout, r.stdout + r.stderr
    os.unlink(script)
    before = _tree(base)
    with pytest.raises(ModelDirError) as e:
        build_tiny_pair(cache)
    msg = str(e.value)
    assert "not safe" in msg and "Nothing was loaded from it" in msg and "build_tiny_pair() with no directory" in msg
    if case == "cache-made-by-them":
        assert f"{cache} belongs to uid {NOBODY}" in msg and f"rm -r {cache}" in msg, msg
    elif case == "cache-writable-by-others":
        assert f"other users can write in {cache}" in msg and f"chmod go-w {cache}" in msg, msg
    else:
        assert f"{cache} is a link of uid {NOBODY}" in msg and f"rm {cache}" in msg, msg
    assert _tree(base) == before


def test_a_model_file_others_may_write_is_refused(base):
    """Root's own cached model whose weights file is writable by others (an earlier build under a
    permissive umask, a careless chmod): anyone could have replaced the weights, so it is refused
    rather than loaded."""
    cache = os.path.join(base, "tiny-models")
    model = os.path.join(cache, "tiny-llama-s0")
    os.makedirs(model, mode=0o755)
    os.chmod(cache, 0o755)
    with open(os.path.join(model, MARKER), "w") as f:
        json.dump({"seed": 0, "recipe": RECIPE_VERSION}, f)
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "w") as f:
        f.write("x")
    os.chmod(weights, 0o666)
    with pytest.raises(ModelDirError) as e:
        build_tiny_llama(model, seed=0)
    assert f"{weights} may be written by others" in str(e.value) and f"rm -r {model}" in str(e.value), str(e.value)


def test_the_models_are_built_in_the_private_run_directory_by_default(tmp_path, monkeypatch):
    """No directory given: the models go to ``tiny-models`` in unisleep's private run directory
    (mode 0700, this user's), and are reused from there."""
    pytest.importorskip("transformers", reason="building the tiny model needs transformers (pip install vllm)")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    a = build_tiny_llama(seed=0)
    assert a == os.path.join(str(run), "unisleep", "tiny-models", "tiny-llama-s0"), a
    assert os.stat(os.path.dirname(os.path.dirname(a))).st_mode & 0o777 == 0o700
    assert os.path.isfile(os.path.join(a, "model.safetensors"))
    built = os.stat(os.path.join(a, MARKER)).st_mtime_ns
    assert build_tiny_pair()[0] == a and os.stat(os.path.join(a, MARKER)).st_mtime_ns == built  # reused
