"""``unisleep demo --model NAME``: the colocated RL loop at model size, both sides sleeping.

The engine (:class:`~.hf_engine.HFGenerator`, this process) and the trainer
(:func:`~.hf_trainer.hf_trainer_main`, another process) share one device and take turns, as verl
and slime colocate them.  The trainer builds its model, AdamW state and gradients and offloads
them before the engine is built, so the two never hold their whole state at once.  Each step:

1. the engine generates rollouts while the trainer is OFFLOADED (its weights and AdamW state in
   host memory, its gradients discarded);
2. ``Handoff.release(level)``: the engine empties its allocator cache and sleeps (level 2 by
   default: weights and KV cache released);
3. the trainer wakes its weights and gradients, scores the rollouts (the gap: in its own numerics
   and in the engine's), backpropagates, wakes the AdamW state for the step only, makes the
   serving copy (the new weights in the engine's dtype and layout) and offloads everything else;
4. ``Handoff.reacquire``: the engine wakes its weights, the serving copy arrives (colocated IPC on
   an accelerator, gloo on host) verified against its manifest, the KV cache wakes; the engine
   gives the received buckets back to the device;
5. probe: the engine's weights compared byte for byte with what the trainer sent (fingerprints),
   and the engine's greedy outputs scored by both sides in one full forward — the engine with the
   weights it computes with, the trainer from the bytes it sent (checked); the engine's own
   decoding logprobs beside them show the numeric noise of decoding with a KV cache (reported);
6. the trainer drops its serving copy.

Recorded per step: GiB freed on each side, the handoff in sleep / wake / transfer phases, the
trainer's offload and restore against the host<->device copy limit measured in the same run,
rollout tokens per second; the device memory of both sides at every phase (printed, in the JSON,
and drawn over time in ``demo.png``) and its peak.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from ..errors import UnisleepError
from ..units import human_bytes
from .checks import Check, _gap_steady, _loop_ran, learned, max_logprob_gap
from ..cli import children_leave_ctrl_c_to_us
from .cli import platform_for
from .constants import PROBE_PROMPTS, RELEASED_MIN
from .presets import fingerprint, preset
from .report import print_checks, step_progress, verdict, write_json
from . import residue as R
from .scaled_report import format_memory, gib, memory_peak, plot_scaled, table_unit
from .trainer_process import TrainerProcess, free_port

#: goals on an accelerator (the colocated loop at real size)
GOAL_COPY_SHARE = 0.9  # trainer offload and restore, each, >= this share of the copy limit
GOAL_ENGINE_MS = 30.0  # engine level-2 sleep + weights wake + verified update, per step


@dataclass
class ScaledStep:
    step: int
    version: str
    level: int
    engine_before: int  # engine resident bytes (lifecycle) awake
    engine_asleep: int  # ... while the trainer trains
    trainer_awake: int  # trainer resident bytes (lifecycle) after training
    trainer_asleep: int  # ... while the engine generates
    trainer_allocator: int  # the trainer's framework allocator after training (activations, the bf16 copy)
    offload_s: float
    offload_bytes: int
    restore_s: float
    restore_bytes: int
    sleep_ms: float
    wake_weights_ms: float
    wake_kv_ms: float
    transfer_ms: float  # start + send (handshake, stream with per-bucket verification, commit) + finish
    transfer_phases_ms: dict
    release_ms: float
    reacquire_ms: float
    train_ms: float
    gen_s: float
    gen_tokens: int
    gap: float  # median |engine − trainer| on the rollouts: the trainer in its own numerics (the gap monitor's)
    gap_served: float  # the same tokens, the trainer in the engine's numerics (the bytes it served, no autocast)
    probe_gap: float  # max |engine − trainer| on the probe, both one full forward from the bytes sent (checked)
    probe_decode_gap: float  # max |engine decoding with its KV cache − trainer| on the probe (bf16 noise, reported)
    weights_exact: bool
    reward: float
    trainer_allocator_peak: int = 0  # the most the trainer's framework allocator reserved during the step
    drop_staging_ms: float = 0.0  # the engine giving its received (staged) buckets back after the update
    findings: list = field(default_factory=list)

    @property
    def engine_freed(self) -> int:
        return self.engine_before - self.engine_asleep

    @property
    def trainer_freed(self) -> int:
        return self.trainer_awake - self.trainer_asleep

    @property
    def engine_goal_ms(self) -> float:
        return self.sleep_ms + self.wake_weights_ms + self.transfer_ms

    @property
    def tokens_per_s(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    @property
    def handoff_ms(self) -> float:
        return self.release_ms + self.reacquire_ms

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("engine_freed", "trainer_freed", "engine_goal_ms", "tokens_per_s", "handoff_ms"):
            d[k] = getattr(self, k)
        return d


def hb(n) -> str:
    return "n/a" if n is None else human_bytes(n)


def format_table_scaled(steps: list[ScaledStep]) -> str:
    u = table_unit(*(n for s in steps for n in (s.engine_freed, s.trainer_freed)))
    head = (f"{'step':>4} {'eng freed ' + u[0]:>13} {'trn freed ' + u[0]:>13} {'offload s':>9} {'restore s':>9} "
            f"{'sleep ms':>8} {'wake ms':>7} {'xfer ms':>8} {'eng sum ms':>10} {'kv wake ms':>10} {'drop ms':>7} {'train s':>7} "
            f"{'tok/s':>8} {'gap':>8} {'gap srv':>8} {'probe Δ':>8} {'decode Δ':>8} {'exact':>5} {'reward':>6}")
    lines = [head, "-" * len(head)]
    for s in steps:
        lines.append(
            f"{s.step:>4} {gib(s.engine_freed, u):>13} {gib(s.trainer_freed, u):>13} {s.offload_s:>9.3f} {s.restore_s:>9.3f} "
            f"{s.sleep_ms:>8.2f} {s.wake_weights_ms:>7.2f} {s.transfer_ms:>8.1f} {s.engine_goal_ms:>10.1f} "
            f"{s.wake_kv_ms:>10.2f} {s.drop_staging_ms:>7.2f} {s.train_ms / 1e3:>7.2f} {s.tokens_per_s:>8.0f} {s.gap:>8.1e} {s.gap_served:>8.1e} "
            f"{s.probe_gap:>8.1e} {s.probe_decode_gap:>8.1e} "
            f"{'yes' if s.weights_exact else 'NO':>5} {s.reward:>6.2f}")
    return "\n".join(lines)


def scaled_checks(steps: list[ScaledStep], monitor, failure: Optional[str], target: int, tol: float,
                  timeline: Optional[list] = None) -> list[Check]:
    checks = _loop_ran(failure)
    if not steps:
        return checks
    inexact = [s.step for s in steps if not s.weights_exact]
    far = [s.step for s in steps if not s.probe_gap <= tol]
    checks.append(Check(
        "weights arrived", not inexact and not far,
        (f"after every update the engine's weights are byte-exact to what the trainer sent (per-tensor "
         f"fingerprints) and the engine computes with them: its logprobs of the greedy probe match the trainer's "
         f"from the sent bytes (max Δ {max(s.probe_gap for s in steps):.1e} <= {tol:g}; decoding with the KV cache "
         f"adds up to {max(s.probe_decode_gap for s in steps):.1e} of numeric noise)") if not inexact and not far else
        (f"steps {inexact}: the engine's weights differ from what the trainer sent; " if inexact else "") +
        (f"steps {far}: probe logprobs differ by up to {max(s.probe_gap for s in steps):.3f} (> {tol:g})" if far else ""),
    ))
    low_e = [s.step for s in steps if s.engine_freed < RELEASED_MIN * s.engine_before]
    low_t = [s.step for s in steps if s.trainer_freed < RELEASED_MIN * s.trainer_awake]
    s0 = steps[0]
    checks.append(Check(
        "memory freed", not low_e and not low_t,
        (f"both sides slept every step: the engine released >= {RELEASED_MIN:.0%} of its bytes "
         f"({hb(s0.engine_before)} -> {hb(s0.engine_asleep)}) while the trainer trained, and the trainer "
         f">= {RELEASED_MIN:.0%} of its ({hb(s0.trainer_awake)} -> {hb(s0.trainer_asleep)}) while the engine "
         "generated") if not low_e and not low_t else
        f"engine released too little at steps {low_e}; trainer at steps {low_t}",
    ))
    if timeline is not None:
        checks.append(R.check(timeline))
    checks.append(_gap_steady(steps, monitor))
    checks.append(learned(steps, target))
    return checks


def goals(steps: list[ScaledStep], limit: dict) -> list[tuple[str, str, Optional[bool]]]:
    """(goal, figure, met) — performance goals on an accelerator; None: not measurable here."""
    if not steps or not limit:
        return [("trainer offload/restore >= 90 % of the copy limit; engine sleep + wake + update <= 30 ms",
                 "not measured: no accelerator (host memory has no host<->device copy)", None)]
    later = steps[1:] or steps  # the first offload also pins its host buffers
    off = statistics.median(s.offload_bytes / s.offload_s / 1e9 for s in later if s.offload_s > 0)
    res = statistics.median(s.restore_bytes / s.restore_s / 1e9 for s in later if s.restore_s > 0)
    eng = statistics.median(s.engine_goal_ms for s in later)
    out = [
        (f"trainer offload >= {GOAL_COPY_SHARE:.0%} of the device->host copy limit",
         f"{off:.1f} GB/s median = {off / limit['d2h_gbps']:.0%} of {limit['d2h_gbps']:.1f} GB/s",
         off >= GOAL_COPY_SHARE * limit["d2h_gbps"]),
        (f"trainer restore >= {GOAL_COPY_SHARE:.0%} of the host->device copy limit",
         f"{res:.1f} GB/s median = {res / limit['h2d_gbps']:.0%} of {limit['h2d_gbps']:.1f} GB/s",
         res >= GOAL_COPY_SHARE * limit["h2d_gbps"]),
        (f"engine level-{steps[0].level} sleep + weights wake + verified update <= {GOAL_ENGINE_MS:g} ms",
         f"{eng:.1f} ms median (sleep {statistics.median(s.sleep_ms for s in later):.1f} + wake "
         f"{statistics.median(s.wake_weights_ms for s in later):.1f} + transfer "
         f"{statistics.median(s.transfer_ms for s in later):.1f})", eng <= GOAL_ENGINE_MS),
    ]
    return out


def run_model(args) -> int:
    import torch

    from ..lifecycle import MemoryLifecycle
    from ..logprob_gap import LogprobGapMonitor
    from ..loop import Handoff
    from ..transfer import TransferGroup, WeightReceiver
    from .hf_engine import HFGenerator, flat_pieces
    from .hf_trainer import allocated_live, allocator_bytes, hf_trainer_main

    p = preset(args.model)
    platform = platform_for(args.device)
    dev = torch.device(platform.torch_device(0))
    os.makedirs(args.out, exist_ok=True)
    rng = torch.Generator().manual_seed(args.seed + 1)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    proc = ctx.Process(target=hf_trainer_main, name="unisleep-demo-trainer", daemon=True,
                       args=(there, rendezvous, args.model, platform.name, args.lr, args.top_p, args.timeout, args.seed))
    t_start = time.perf_counter()
    t_mono = time.monotonic()  # the clock both processes stamp their memory marks with
    with children_leave_ctrl_c_to_us():  # Ctrl-C: this process stops the trainer and says so, once
        proc.start()
    trainer = TrainerProcess(proc, here, args.timeout)
    steps: list[ScaledStep] = []
    timeline: list[dict] = []
    monitor = LogprobGapMonitor()
    failure: Optional[str] = None
    init: dict = {}
    group = None
    eng = None
    lc = MemoryLifecycle(platform)
    mod = getattr(torch, dev.type, None)
    tr_mem = {"resident": 0, "allocator": 0, "allocated": 0, "rss": None, "transfer": 0, "host_backup": None,
              "live_blocks": []}
    receiver = None
    device_total = None
    if dev.type != "cpu" and mod is not None and hasattr(mod, "mem_get_info"):
        device_total = int(mod.mem_get_info(dev)[1])

    def used_now():
        if device_total is None:
            return None
        free, total = mod.mem_get_info(dev)
        return int(total - free)

    def engine_side() -> dict:
        return {"engine": lc.resident_bytes(), "engine_allocator": allocator_bytes(torch, dev),
                "engine_allocated": allocated_live(torch, dev), "engine_rss": R.rss_bytes(), "engine_transfer": receiver.buffer_bytes() if receiver is not None else 0,
                "engine_host_backup": R.host_backup(lc)}

    def take(mem: dict) -> None:
        """The trainer's figures as it last reported them (it does not change while it waits)."""
        tr_mem.update(resident=mem["resident"], allocator=mem["allocator"], allocated=mem.get("allocated", 0),
                      rss=mem.get("rss"), transfer=mem.get("transfer", 0), host_backup=mem.get("host_backup"),
                      live_blocks=mem.get("live_blocks", []))

    def mark(phase: str, step: int) -> None:
        timeline.append({"t": time.monotonic() - t_mono, "phase": phase, "step": step, "works": R.WORKS.get(phase),
                         **engine_side(), "trainer": tr_mem["resident"], "trainer_allocator": tr_mem["allocator"],
                         "trainer_allocated": tr_mem["allocated"], "trainer_live_blocks": tr_mem["live_blocks"],
                         "trainer_rss": R.rss_bytes(proc.pid), "trainer_transfer": tr_mem["transfer"],
                         "trainer_host_backup": tr_mem["host_backup"], "device_used": used_now()})

    def trainer_marks(phases: list, step: int) -> None:
        """The trainer's own marks (inside a command), with the engine side as it is now."""
        for ph in phases:
            timeline.append({"t": ph["t"] - t_mono, "phase": ph["phase"], "step": step,
                             "works": R.WORKS.get(ph["phase"]), **engine_side(), "trainer": ph["resident"],
                             "trainer_allocator": ph["allocator"], "trainer_allocated": ph.get("allocated", 0),
                             "trainer_rss": ph.get("rss"),
                             "trainer_transfer": ph.get("transfer", 0), "trainer_host_backup": ph.get("host_backup"),
                             "device_used": ph["device_used"]})
        if phases:
            take(phases[-1])

    try:
        # the trainer builds its model, optimizer state and gradients and offloads them before the
        # engine is built: the two never hold their whole state on the device at once
        init = trainer.wait("init")
        trainer_marks(init.get("phases") or [], 0)
        try:
            eng = HFGenerator(p, lifecycle=lc, device=str(dev), max_batch=args.batch,
                              kv_len=max(p.kv_len, p.prompt_len + args.max_tokens), logprobs_mode=args.logprobs_mode,
                              seed=args.seed)
        except UnisleepError as e:
            trainer.stop()
            lc.close()
            print(f"unisleep demo: the engine cannot start on {platform.name}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        if args.sabotage == "skip-sleep":
            eng.sleep = lambda level=1: None  # accepts the call and frees nothing
        if [tuple(x) for x in init["layout"]] != eng.layout:
            raise UnisleepError("the trainer's parameters (names, sizes, order) differ from the engine's; both build "
                                f"--model {p.name} from the same config, so this is a bug: trainer "
                                f"{init['layout'][:3]}..., engine {eng.layout[:3]}...")
        mark("engine built", 0)
        group = trainer.run_beside(
            lambda: TransferGroup.create(rendezvous, rank=1, world_size=2, platform=platform, timeout_s=args.timeout),
            "ready")

        def apply(named):
            if args.sabotage == "drop-weights":  # a loader that "succeeds" but keeps the engine's own bytes
                named = [(n, v.detach().clone()) for n, v in flat_pieces(eng.flat)]
            eng.update_weights(named)

        receiver = WeightReceiver(group, apply=apply, guard=eng.can_receive_weights)
        handoff = Handoff(eng, pause_mode="wait")
        if not args.quiet:
            print(f"unisleep demo: model={p.name} ({init['params'] / 1e9:.3f} B parameters, engine {p.dtype}) "
                  f"platform={platform.name} level={args.level} steps={args.steps} batch={args.batch} "
                  f"trainer pid={proc.pid} (another process) transfer={group.backend} out={args.out}")
            if init["copy_limit"]:
                cl = init["copy_limit"]
                print(f"copy limit measured now (pinned, 1 GiB): host->device {cl['h2d_gbps']:.1f} GB/s, "
                      f"device->host {cl['d2h_gbps']:.1f} GB/s")
        off = trainer.call("offload", None, "offloaded")
        take(off["after"])
        mark(R.BASELINE, 0)
        for step in range(1, args.steps + 1):
            prompts = torch.randint(0, p.config["vocab_size"], (args.batch, p.prompt_len), generator=rng).tolist()
            t0 = time.perf_counter()
            gens = eng.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p,
                                seed=args.seed * 1000 + step - 1)
            gen_s = time.perf_counter() - t0
            tokens = [g.token_ids for g in gens]
            rewards = [sum(t == args.target for t in tk) / len(tk) for tk in tokens]
            version_served = eng.weight_version()
            mark("engine generated", step)
            rel = handoff.release(level=args.level)
            mark("engine asleep (its allocator cache emptied)", step)
            t0 = time.perf_counter()
            tr = trainer.call("train", {"prompts": prompts, "tokens": tokens, "rewards": rewards}, "trained")
            train_ms = (time.perf_counter() - t0) * 1e3
            trainer_marks(tr["phases"], step)
            take(tr["after"])
            gs = monitor.observe([g.logprobs for g in gens], tr["logprobs"], top_p=args.top_p, step=step,
                                 version=version_served)
            served = tr["logprobs_served"] or tr["logprobs"]
            gap_served = statistics.median(abs(a - b) for g, r in zip(gens, served) for a, b in zip(g.logprobs, r))
            version = str(step)
            sent: dict = {}

            def send_weights(engine, version=version):
                trainer.conn.send(("send", version))
                got = receiver.receive()
                sent.update(trainer.wait("sent"))
                sent["recv"] = got.as_dict()
                if got.version != version:
                    raise UnisleepError(f"received version {got.version!r}, expected {version!r}")

            rep = handoff.reacquire(send_weights, version=version)
            exact = fingerprint(list(eng._params.items())) == tr["fingerprint"]
            mark("engine updated (weights, KV cache awake)", step)
            t0 = time.perf_counter()
            eng.release_cache()  # the staged buckets of the update: freed, and now given back
            drop_ms = (time.perf_counter() - t0) * 1e3
            mark("engine: received buckets given back", step)
            probe = eng.generate(PROBE_PROMPTS, max_tokens=args.max_tokens, temperature=0.0)
            probe_tokens = [g.token_ids for g in probe]
            full = eng.full_logprobs(PROBE_PROMPTS, probe_tokens)
            sc = trainer.call("score", {"prompts": PROBE_PROMPTS, "tokens": probe_tokens}, "scored")
            take(sc["memory"])
            probe_gap = max(abs(a - b) for e, t in zip(full, sc["logprobs"]) for a, b in zip(e, t))
            probe_decode_gap = max_logprob_gap(probe, sc["logprobs"])
            mark("probe scored by both sides", step)
            off = trainer.call("offload", None, "offloaded")
            take(off["after"])
            mark("trainer dropped its serving copy", step)
            tm = rep.timings
            ph = sent["recv"].get("phases", {})
            ds = ScaledStep(
                step=step, version=version, level=args.level, engine_before=rel.resident_before or 0,
                engine_asleep=rel.resident_asleep or 0, trainer_awake=tr["awake"],
                trainer_asleep=tr["after"]["resident"], trainer_allocator=tr["after"]["allocator"],
                offload_s=tr["offload"]["seconds"], offload_bytes=tr["offload"]["bytes_copied"],
                restore_s=tr["restore"]["seconds"], restore_bytes=tr["restore"]["bytes_copied"],
                sleep_ms=tm.get("sleep", 0) * 1e3, wake_weights_ms=tm.get("wake_weights", 0) * 1e3,
                wake_kv_ms=tm.get("wake_kv", 0) * 1e3, transfer_ms=rep.transfer_s * 1e3,
                transfer_phases_ms={k: v * 1e3 for k, v in ph.items()},
                release_ms=rel.release_s * 1e3, reacquire_ms=rep.reacquire_s * 1e3, train_ms=train_ms, gen_s=gen_s,
                gen_tokens=sum(len(t) for t in tokens), gap=gs.median_abs_gap, gap_served=gap_served,
                probe_gap=probe_gap, probe_decode_gap=probe_decode_gap, weights_exact=exact,
                reward=statistics.fmean(rewards), trainer_allocator_peak=tr.get("allocator_peak", 0), drop_staging_ms=drop_ms,
                findings=[str(f) for f in gs.findings])
            steps.append(ds)
            step_progress(args, step, f"v{version}  freed engine {hb(ds.engine_freed)}, trainer "
                                      f"{hb(ds.trainer_freed)}  engine sleep+wake+xfer {ds.engine_goal_ms:.1f} ms  "
                                      f"offload {ds.offload_s:.2f} s  {ds.tokens_per_s:,.0f} tok/s  gap {ds.gap:.1e}  "
                                      f"probe {ds.probe_gap:.1e} (decode {ds.probe_decode_gap:.1e})  "
                                      f"reward {ds.reward:.2f}", gs.findings)
    except (UnisleepError, OSError) as e:
        failure = f"{type(e).__name__}: {e}"
    finally:
        if group is not None:
            group.close()
        trainer.stop()
        if eng is not None:
            eng.close()
        lc.close()
    elapsed = time.perf_counter() - t_start
    checks = scaled_checks(steps, monitor, failure, args.target, p.probe_tol, timeline)
    ok = bool(steps) and all(c.ok is not False for c in checks) and len(steps) == args.steps
    gl = goals(steps, init.get("copy_limit") or {})
    peak = memory_peak(timeline, device_total)
    print()
    if steps:
        print(format_table_scaled(steps))
        print()
        print(f"{p.name}: {init.get('params', 0) / 1e9:.3f} B parameters; trainer lifecycle tags "
              + ", ".join(f"{t} {hb(n)}" for t, n in (init.get("tags") or {}).items())
              + f"; {len(steps)} steps in {elapsed:.1f} s")
    if timeline:
        print()
        on_device = any(e.get("device_used") is not None for e in timeline)
        print(("device memory by phase (in use: the device's, all processes" if on_device else
               "host memory by phase (in use: the two processes' resident sets") +
              "; life: lifecycle memory; alloc: the framework allocator of that process; xfer: the transfer's "
              "buckets both sides hold; other: in use minus the four before; residue: in use minus the working "
              "side's own, against what the start allows, where one side works and the other sleeps)")
        print(format_memory(timeline, 0))
        if steps:
            print(format_memory(timeline, steps[-1].step))
    if peak is not None:
        print(f"peak device memory in use (both processes): {hb(peak['device_used'])} of {hb(peak['device_total'])} "
              f"at '{peak['phase']}' (step {peak['step']}): engine {hb(peak['engine'])}, trainer "
              f"{hb(peak['trainer'])}"
              + (f"; the trainer's allocator peaked at {hb(max(s.trainer_allocator_peak for s in steps))} "
                 "within a step" if steps else ""))
    for name, fig, met in gl:
        print(f"[goal {'n/a' if met is None else ('MET' if met else 'MISSED')}] {name}: {fig}")
    print_checks(checks)
    result = {
        "ok": ok, "engine": "hf", "model": p.name, "params": init.get("params"), "platform": platform.name,
        "args": vars(args), "seconds": elapsed, "copy_limit": init.get("copy_limit"),
        "trainer_tags": init.get("tags"), "steps": [s.as_dict() for s in steps], "timeline": timeline,
        "memory_peak": peak, "residue": R.summary(timeline),
        "goals": [{"goal": g, "figure": f, "met": m} for g, f, m in gl], "checks": [c.__dict__ for c in checks],
        "gap": monitor.summary(), "failure": failure, "engine_pid": os.getpid(), "trainer_pid": proc.pid,
        "transfer": {"backend": getattr(group, "backend", None), "path": (steps and sent.get("recv", {}).get("path"))},
    }
    jpath = write_json(args.out, result)
    ppath = None
    if not args.no_plot and steps:
        ppath = plot_scaled(steps, timeline, os.path.join(args.out, "demo.png"),
                            f"unisleep demo --model {p.name} on {platform.name}: device memory of both sides", device_total)
        if ppath is None:
            print("plot skipped: matplotlib is not installed (pip install 'unisleep[plot]')")
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    return verdict(ok)


__all__ = ["run_model", "ScaledStep", "format_table_scaled", "scaled_checks", "goals"]
