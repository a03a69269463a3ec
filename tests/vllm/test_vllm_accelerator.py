"""vLLM's own engine on an accelerator with its sleep-mode memory in unisleep (the plugin, with
``UNISLEEP_VLLM_ALLOCATOR=1``): the tiny model generates, sleeps at level 1 — the device must get
back what unisleep's allocator says it released — wakes, and generates the same tokens.

Runs where vLLM runs on a GPU or NPU: CUDA, ROCm (a ROCm build of torch), Ascend (vllm-ascend,
whose ``CaMemAllocator`` then answers with unisleep's allocator).  The vendor CI workflows run it
(``pytest -m vllm tests/vllm/test_vllm_accelerator.py``); on a CPU machine it skips: vLLM refuses
sleep mode there.  NOT RUN so far: written for the first run on each vendor's runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _vllm_common import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _accelerator():
    try:
        from unisleep.platform import detect_platform

        p = detect_platform()
        return p.name if p.is_accelerator and p.devices else None
    except Exception:
        return None


PLATFORM = _accelerator()


@pytest.mark.skipif(PLATFORM is None, reason="needs a GPU or NPU that vLLM runs on (vLLM refuses sleep mode on CPU)")
def test_vllm_sleeps_into_unisleep_on_the_accelerator(tiny_models, tmp_path):
    require_vllm("needs vLLM built for this accelerator")
    code = textwrap.dedent(f"""
        import json, torch
        from vllm import LLM
        from unisleep.vllm_worker.allocator import UnisleepAllocator
        prompts = [[0, 5, 17, 42, 99, 300], [0, 7, 7, 300, 12]]
        acc = getattr(torch, torch.accelerator.current_accelerator().type)
        llm = LLM(model={tiny_models[0]!r}, enable_sleep_mode=True, dtype="float32", enforce_eager=True,
                  max_model_len=512, max_num_seqs=8, seed=0, gpu_memory_utilization=0.3)
        greedy = lambda: [o.outputs[0].token_ids for o in llm.generate(
            [{{"prompt_token_ids": p}} for p in prompts], __import__("vllm").SamplingParams(max_tokens=12, temperature=0))]
        before = greedy()
        free_awake = acc.mem_get_info()[0]
        llm.sleep(level=1)
        free_asleep = acc.mem_get_info()[0]
        alloc = UnisleepAllocator.instance
        released = alloc.last_report.bytes_released if alloc is not None and alloc.last_report else None
        llm.wake_up()
        after = greedy()
        print(json.dumps({{"same": [list(a) for a in before] == [list(a) for a in after],
                          "freed": free_asleep - free_awake, "released": released,
                          "allocator": alloc is not None}}))
        """)
    env = dict(os.environ, UNISLEEP_VLLM_ALLOCATOR="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-6000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["allocator"], "vLLM's worker did not use unisleep's allocator"
    assert res["released"] and res["released"] >= 64 << 20, res
    assert res["freed"] >= 0.9 * res["released"], res  # the device really got the memory back
    assert res["same"], res
