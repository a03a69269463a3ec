"""``unisleep demo`` on the embedded default: a colocated RL loop, end to end.

The engine (a :class:`~unisleep.engines.torch_generator.TorchGenerator` on lifecycle memory)
lives in this process; the trainer lives in ANOTHER process (:mod:`.trainer_process`) and sends its
weights over a private transfer group (gloo on host).  Each step:

1. the engine samples rollouts (prompts -> tokens + logprobs);
2. ``Handoff.release(level)``: pause -> sleep -> the engine must REPORT sleeping, and its
   resident bytes (read from the backend) must fall;
3. the trainer scores the rollouts (its logprobs feed the gap monitor) and takes a REINFORCE
   step towards emitting the target token;
4. ``Handoff.reacquire``: wake weights -> transfer (start, send, finish, version) -> wake KV
   cache -> reset prefix cache -> resume;
5. a probe: the engine's greedy outputs are scored by the trainer — the logprobs must match.

At the end: a table per step, ``demo.json`` and ``demo.png`` in ``--out``, and the checks
(weights arrived, memory freed, gap steady).  Exit 0 only when every check passed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Optional

from ..errors import UnisleepError
from .checks import embedded_checks, max_logprob_gap
from ..cli import children_leave_ctrl_c_to_us
from .cli import platform_for
from .constants import PROBE_PROMPTS, PROMPT_LEN
from .report import kib, plot_steps, print_run, step_progress, verdict, write_json
from .steps import DemoStep
from .trainer_process import TrainerProcess, free_port, trainer_main


def _reward(tokens: list[int], target: int) -> float:
    return sum(t == target for t in tokens) / max(len(tokens), 1)


def _make_engine(args, platform):
    from ..engines.torch_generator import TinyLMConfig, TorchGenerator
    from ..lifecycle import MemoryLifecycle

    cfg = TinyLMConfig(seed=args.seed)
    cls = TorchGenerator
    if args.sabotage == "skip-sleep":
        class _NoSleep(TorchGenerator):
            def sleep(self, level: int = 1) -> None:  # accepts the call and frees nothing
                pass
        cls = _NoSleep
    lc = MemoryLifecycle(platform)
    eng = cls(cfg, lifecycle=lc, max_batch=args.batch, logprobs_mode=args.logprobs_mode, seed=args.seed)
    return eng, lc, cfg


def run_torch(args) -> int:
    from ..logprob_gap import LogprobGapMonitor
    from ..loop import Handoff

    platform = platform_for(args.device)
    try:
        eng, lc, cfg = _make_engine(args, platform)
    except UnisleepError as e:  # e.g. the platform's packages are missing: nothing was started
        print(f"unisleep demo: the engine cannot start on {platform.name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import torch

    rng = torch.Generator().manual_seed(args.seed + 1)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    proc = ctx.Process(
        target=trainer_main, name="unisleep-demo-trainer", daemon=True,
        args=(there, rendezvous, cfg.as_dict(), platform.name, args.lr, args.top_p, args.timeout),
    )
    t_start = time.perf_counter()
    with children_leave_ctrl_c_to_us():  # Ctrl-C: this process stops the trainer and says so, once
        proc.start()
    trainer = TrainerProcess(proc, here, args.timeout)
    steps: list[DemoStep] = []
    monitor = LogprobGapMonitor()
    failure: Optional[str] = None
    transfer_info: dict = {}
    group = None
    try:
        from ..transfer import TransferGroup, WeightReceiver

        trainer.wait("init")  # its model and optimizer exist (a bad option would have failed there)
        # joining blocks until the trainer joins too; if it fails or dies meanwhile, say so at once
        group = trainer.run_beside(
            lambda: TransferGroup.create(rendezvous, rank=1, world_size=2, platform=platform, timeout_s=args.timeout),
            "ready")

        def apply(named):
            if args.sabotage == "drop-weights":
                # a loader that "succeeds" but keeps the old tensors: every name is written back
                # with the engine's own bytes, so the update looks complete and the version moves
                named = [(n, eng._params[n].detach().clone()) for n, _ in named]
            eng.update_weights(named)

        receiver = WeightReceiver(group, apply=apply, guard=eng.can_receive_weights)
        transfer_info.update(backend=group.backend, rendezvous=rendezvous)
        handoff = Handoff(eng, pause_mode="wait")
        if not args.quiet:
            print(f"unisleep demo: engine={eng.kind} platform={platform.name} level={args.level} steps={args.steps} "
                  f"trainer pid={proc.pid} (another process) transfer={group.backend} out={args.out}")
        for step in range(1, args.steps + 1):  # counted from 1 everywhere: progress, table, demo.json
            # 1. rollouts with the engine's current weights
            prompts = torch.randint(0, cfg.vocab_size, (args.batch, PROMPT_LEN), generator=rng).tolist()
            gens = eng.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p,
                                seed=args.seed * 1000 + step - 1)
            tokens = [g.token_ids for g in gens]
            rewards = [_reward(t, args.target) for t in tokens]
            version_served = eng.weight_version()
            # 2. release the engine's memory for the trainer
            asked = None if args.free_at_least is None else int(args.free_at_least * (1 << 20))
            rep = handoff.release(level=args.level, free_at_least=asked)
            # 3. train in the other process (scores the rollouts first: the gap)
            t0 = time.perf_counter()
            tr = trainer.call("train", {"prompts": prompts, "tokens": tokens, "rewards": rewards}, "trained")
            train_ms = (time.perf_counter() - t0) * 1e3
            gs = monitor.observe([g.logprobs for g in gens], tr["logprobs"], top_p=args.top_p,
                                 kept_mass=tr["kept_mass"], step=step, version=version_served)
            # 4. take the memory back with the new weights
            version = str(step)

            def send_weights(engine, version=version):
                trainer.conn.send(("send", version))
                got = receiver.receive()
                trainer.wait("sent")
                if got.version != version:
                    raise UnisleepError(f"received version {got.version!r}, expected {version!r}")
                transfer_info["path"] = got.path

            rep = handoff.reacquire(send_weights, version=version)
            # 5. probe: does the engine now compute what the trainer's model computes?
            probe = eng.generate(PROBE_PROMPTS, max_tokens=args.max_tokens, temperature=0.0)
            sc = trainer.call("score", {"prompts": PROBE_PROMPTS, "tokens": [g.token_ids for g in probe]}, "scored")
            probe_gap = max_logprob_gap(probe, sc["logprobs"])
            ds = DemoStep(
                step=step, version=version, level=args.level, resident_before=rep.resident_before,
                resident_asleep=rep.resident_asleep, release_ms=rep.release_s * 1e3,
                reacquire_ms=rep.reacquire_s * 1e3, transfer_ms=rep.transfer_s * 1e3, train_ms=train_ms,
                gap=gs.median_abs_gap, probe_gap=probe_gap, reward=statistics.fmean(rewards),
                findings=[str(f) for f in gs.findings], free_at_least=rep.free_at_least, budget=rep.budget,
            )
            steps.append(ds)
            step_progress(args, step, f"v{version}  released {kib(ds.released)} KiB  handoff {ds.handoff_ms:.1f} ms  "
                                      f"gap {ds.gap:.1e}  probe {ds.probe_gap:.1e}  reward {ds.reward:.2f}", gs.findings)
    except (UnisleepError, OSError) as e:
        failure = f"{type(e).__name__}: {e}"
    finally:
        if group is not None:
            group.close()  # before the trainer (which hosts the group's store) goes
        trainer.stop()
        eng.close()
        lc.close()
    elapsed = time.perf_counter() - t_start

    checks = embedded_checks(steps, monitor, failure, args.target)
    ok = bool(steps) and all(c.ok is not False for c in checks) and len(steps) == args.steps

    # ---- report
    print_run(steps, checks, args.target, elapsed)
    result = {
        "ok": ok, "engine": "torch", "platform": platform.name, "args": vars(args), "seconds": elapsed,
        "steps": [s.as_dict() for s in steps], "checks": [c.__dict__ for c in checks],
        "gap": monitor.summary(), "failure": failure, "engine_pid": os.getpid(), "trainer_pid": proc.pid,
        "transfer": transfer_info,
    }
    jpath = write_json(args.out, result)
    ppath = None
    if not args.no_plot and steps:
        ppath = plot_steps(steps, os.path.join(args.out, "demo.png"))
        if ppath is None:
            print("plot skipped: matplotlib is not installed (pip install 'unisleep[plot]')")
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    return verdict(ok)
