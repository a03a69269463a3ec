"""docs/transfer.md's two-process example, started engine-first twice on one port: the first run
leaves its loopback secret file behind (the example never closes its group), the second run's engine
reads that stale file before the trainer replaces it.  Neither run may report an intrusion: the
engine's proof under the previous secret is refused quietly and it re-reads the file.  Real
processes, real loopback sockets, real 0600 secret files."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = re.compile(r"<!-- process: (\w+\.py) -->\n```python\n(.*?)```", re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_engine_first(d: str, env: dict) -> tuple[str, str]:
    engine = subprocess.Popen([sys.executable, "engine.py"], cwd=d, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(2.0)  # the engine reads the secret file (a stale one on the second run) before rank 0 starts
    trainer = subprocess.Popen([sys.executable, "trainer.py"], cwd=d, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        t_out, _ = trainer.communicate(timeout=180)
        e_out, _ = engine.communicate(timeout=180)
    finally:
        for p in (trainer, engine):
            if p.poll() is None:
                p.kill()
    assert trainer.returncode == 0 and engine.returncode == 0, f"trainer:\n{t_out[-2000:]}\nengine:\n{e_out[-2000:]}"
    return t_out, e_out


@pytest.mark.slow
def test_engine_first_twice_logs_no_intrusion(tmp_path):
    with open(os.path.join(ROOT, "docs", "transfer.md")) as f:
        blocks = dict(BLOCK.findall(f.read()))
    assert {"trainer.py", "engine.py"} <= set(blocks), "docs/transfer.md's two-process example moved?"
    port = str(_free_port())
    for name in ("trainer.py", "engine.py"):
        assert "29555" in blocks[name]
        (tmp_path / name).write_text(blocks[name].replace("29555", port))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1")
    from unisleep.transfer.secret import loopback_secret_path

    for run in (1, 2):
        if run == 2:
            assert os.path.exists(loopback_secret_path(int(port), "default")), \
                "the first run left no secret file: the second run would not test a stale one"
        t_out, e_out = _run_engine_first(str(tmp_path), env)
        for who, out in (("trainer", t_out), ("engine", e_out)):
            assert "intrusion" not in out and "proof of the group secret" not in out, f"run {run}, {who}:\n{out[-3000:]}"
