"""Closing a ``VLLMWeightPusher`` ends the engine's side first: the worker-extension example of
docs/vllm.md, run as a user runs it (a fresh process, the engine kept alive after the pusher
closed), prints no warning that the group's store vanished or that rank 0 may have died.  Before,
the pusher closed its group (the store host) first and every worker's heartbeat then warned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine in a child process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXAMPLE = textwrap.dedent("""
    import time
    from unisleep.engines.tiny_model import build_tiny_llama, tiny_state_dict
    from unisleep.engines.vllm_inprocess import VLLMEngine
    from unisleep.engines.vllm_trainer import VLLMWeightPusher

    if __name__ == "__main__":
        model_dir = build_tiny_llama(seed=0)
        eng = VLLMEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=512,
                         kv_cache_memory_bytes=256 << 20,
                         worker_extension_cls="unisleep.vllm_worker.extension.UnisleepWorkerExtension")
        with VLLMWeightPusher(eng, route="extension") as pusher:
            pusher.push(tiny_state_dict(seed=1).items(), version="step-3", chunks=2)
        time.sleep(3)      # the engine serves on; several of the workers' heartbeats pass
        print(eng.collective_rpc("unisleep_weight_version"), flush=True)
        eng.close()
""")


def test_the_extension_example_closes_without_a_false_alarm(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "['step-3']" in r.stdout, r.stdout
    for alarm in ("heartbeat stopped", "may have died", "lost the group's store"):
        assert alarm not in r.stderr, r.stderr[-4000:]
