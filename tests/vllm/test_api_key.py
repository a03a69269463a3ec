"""The vLLM server's API key never reaches its command line (docs/security.md, "Model directories
and secrets of child processes").

Every user of the host reads any process's arguments in ``/proc/PID/cmdline``; a process's
environment is readable only by its own user.  So ``launch_vllm_server(api_key=...)`` hands vLLM
the key as ``VLLM_API_KEY``: another user (uid 65534 through ``setpriv``) reads the arguments of
the server and of every process under it and finds no key, while the key still guards vLLM's
``/v1`` routes.  This module starts its own server and sorts before ``test_loop_vllm.py``, so it
runs before the session server exists (two servers never run at once).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import pytest

from _vllm_common import SERVER_ARGS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nobody import NOBODY, as_nobody, stdlib_python_for_nobody  # noqa: E402

from unisleep.errors import InvalidArgumentError  # noqa: E402

#: uid 65534's side: the arguments (and, where it may, the environment) of PID and all below it
READER = r"""
import json, os, sys
root, key = int(sys.argv[1]), sys.argv[2].encode()
kids = {}
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            with open(f"/proc/{d}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except OSError:
            pass
tree, todo = [], [root]
while todo:
    p = todo.pop()
    tree.append(p)
    todo += kids.get(p, [])
out = {"uid": os.getuid(), "pids": tree, "cmdlines": 0, "key_in": []}
for p in tree:
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{p}/{what}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        out["cmdlines"] += what == "cmdline"
        if key in data:
            out["key_in"].append(f"/proc/{p}/{what}")
print("RESULT " + json.dumps(out))
"""


def _status(url: str, key=None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_api_key_on_the_command_line_is_refused(tiny_models):
    """``--api-key`` in ``extra_args`` is refused before anything starts, naming api_key=."""
    from unisleep.engines.vllm_server import launch_vllm_server

    for extra in (["--api-key", "k"], ["--api-key=k"]):
        with pytest.raises(InvalidArgumentError) as e:
            launch_vllm_server(tiny_models[0], extra_args=extra, progress=False).stop()  # stopped if it started
        assert "api_key=" in str(e.value) and "/proc/PID/cmdline" in str(e.value), str(e.value)


@pytest.mark.slow
def test_another_user_never_reads_the_api_key(tiny_models, tmp_path):
    python = stdlib_python_for_nobody()
    from unisleep.engines.vllm_server import launch_vllm_server

    key = "sk-" + secrets.token_hex(16)
    shared = tempfile.mkdtemp(prefix="us-api-key-", dir="/tmp")  # pytest's tmp_path is 0700 to root
    os.chmod(shared, 0o755)
    reader = os.path.join(shared, "reader.py")
    with open(reader, "w") as f:
        f.write(READER)
    os.chmod(reader, 0o644)
    log_path = str(tmp_path / "server.log")
    with launch_vllm_server(tiny_models[0], extra_args=SERVER_ARGS, log_path=log_path, startup_timeout=300.0,
                            api_key=key, progress=False) as server:
        r = subprocess.run(as_nobody(["-I", "-S", reader, str(server.pid), key], python=python),
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stdout + r.stderr
        got = json.loads([l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
        assert got["uid"] == NOBODY and got["cmdlines"] >= 1, got  # it did read the server's arguments
        assert not got["key_in"], f"uid {NOBODY} read the API key in {got['key_in']}"
        # the key still guards the server: refused without it, served with it
        assert _status(server.base_url + "/v1/models") == 401
        assert _status(server.base_url + "/v1/models", key) == 200
        assert server.engine().generate([[0, 5, 17, 42]], max_tokens=2)[0].token_ids
    shutil.rmtree(shared, ignore_errors=True)
    with open(log_path, errors="replace") as f:
        assert key not in f.read(), "the API key is in the server's log"
