"""``unisleep demo --ray``: the embedded loop with the trainer and the engine as Ray actors.

The two actors build their transfer group with :func:`unisleep.ray.connect` (the rendezvous and
the group secret travel through Ray's object store); the driver (this process) runs the steps:
rollouts on the engine actor, ``Handoff.release`` there, a REINFORCE step on the trainer actor,
then ``Handoff.reacquire`` on the engine while the trainer sends, and the probe.  Besides the
embedded demo's checks, the engine's weights are compared byte for byte with the trainer's after
every update.  A local Ray cluster is started (``num_cpus=2``) unless ``RAY_ADDRESS`` names one.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

from ..errors import InvalidArgumentError, UnisleepError
from .checks import Check, embedded_checks
from .constants import BUCKET_BYTES, PROBE_PROMPTS, PROMPT_LEN
from .report import kib, plot_steps, print_run, step_progress, verdict, write_json
from .steps import DemoStep


class _EngineSide:
    """The engine actor's body: TorchGenerator on lifecycle memory, the Handoff, the receiver."""

    def __init__(self, cfg: dict, platform_name: str, batch: int, seed: int, logprobs_mode: str):
        from ..engines.torch_generator import TinyLMConfig, TorchGenerator
        from ..lifecycle import MemoryLifecycle
        from ..loop import Handoff
        from ..platform import detect_platform

        self.unisleep_platform = detect_platform(platform_name)
        self.lc = MemoryLifecycle(self.unisleep_platform)
        self.eng = TorchGenerator(TinyLMConfig(**cfg), lifecycle=self.lc, max_batch=batch, seed=seed,
                                  logprobs_mode=logprobs_mode)
        self.handoff = Handoff(self.eng, pause_mode="wait")
        self.receiver = None

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts, max_tokens, temperature, top_p, seed=None):
        gens = self.eng.generate(prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        return [(g.token_ids, g.logprobs) for g in gens], self.eng.weight_version()

    def release(self, level: int) -> dict:
        rep = self.handoff.release(level=level)
        return {"before": rep.resident_before, "asleep": rep.resident_asleep, "seconds": rep.release_s}

    def reacquire(self, version: str) -> dict:
        from ..transfer import WeightReceiver

        if self.receiver is None:
            self.receiver = WeightReceiver(self.unisleep_group, apply=self.eng.update_weights,
                                           guard=self.eng.can_receive_weights)
        got = {}

        def send_weights(engine):
            rep = self.receiver.receive()
            if rep.version != version:
                raise UnisleepError(f"received version {rep.version!r}, expected {version!r}")
            got["path"] = rep.path

        rep = self.handoff.reacquire(send_weights, version=version)
        from .presets import fingerprint

        return {"seconds": rep.reacquire_s, "transfer": rep.transfer_s, "path": got.get("path"),
                "fingerprint": fingerprint(list(self.eng._params.items()))}

    def close(self) -> None:
        self.unisleep_close()
        self.eng.close()
        self.lc.close()


class _TrainerSide:
    """The trainer actor's body: its own TinyLM and Adam; sends over the group."""

    def __init__(self, cfg: dict, platform_name: str, lr: float, top_p: float):
        import torch

        from ..engines.torch_generator import TinyLM, TinyLMConfig
        from ..platform import detect_platform

        torch.set_num_threads(1)
        self.unisleep_platform = detect_platform(platform_name)
        self.device = torch.device(self.unisleep_platform.torch_device(0))
        self.model = TinyLM(TinyLMConfig(**cfg)).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.top_p = top_p
        self.sender = None

    def pid(self) -> int:
        return os.getpid()

    def train(self, prompts, tokens, rewards) -> dict:
        import torch

        from ..engines.torch_generator import sequence_logprobs

        p = torch.tensor(prompts, device=self.device)
        c = torch.tensor(tokens, device=self.device)
        r = torch.tensor(rewards, device=self.device, dtype=torch.float32)
        lp, kept = sequence_logprobs(self.model, p, c, top_p=self.top_p, with_kept_mass=True)
        loss = -((r - r.mean())[:, None] * lp).sum(dim=1).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"logprobs": lp.detach().cpu().tolist(), "kept_mass": kept.detach().cpu().tolist()}

    def send(self, version: str) -> dict:
        from .presets import fingerprint

        if self.sender is None:
            self.sender = self.unisleep_sender(bucket_bytes=BUCKET_BYTES,
                                               path="auto" if self.unisleep_platform.is_accelerator else "collective")
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        self.sender.send(named, version=version)
        return {"fingerprint": fingerprint(named)}

    def score(self, prompts, tokens) -> list:
        import torch

        from ..engines.torch_generator import sequence_logprobs

        with torch.no_grad():
            lp = sequence_logprobs(self.model, torch.tensor(prompts, device=self.device),
                                   torch.tensor(tokens, device=self.device))
        return lp.cpu().tolist()

    def close(self) -> None:
        self.unisleep_close()


def actor_classes(ray):
    """The two actor classes (Ray imported by the caller)."""
    from ..ray import TransferActor

    Engine = ray.remote(num_cpus=1)(type("UnisleepEngineActor", (_EngineSide, TransferActor), {}))
    Trainer = ray.remote(num_cpus=1)(type("UnisleepTrainerActor", (_TrainerSide, TransferActor), {}))
    return Engine, Trainer


def run_ray(args) -> int:
    import torch

    from ..engines.torch_generator import TinyLMConfig
    from ..logprob_gap import LogprobGapMonitor
    from ..ray import connect, require_ray
    from .cli import platform_for

    ray = require_ray()
    if args.model is not None:
        raise InvalidArgumentError("--ray runs the embedded tiny model; --model with --ray is not built yet")
    platform = platform_for(args.device)
    os.makedirs(args.out, exist_ok=True)
    started = False
    if not ray.is_initialized():
        kw = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": 2, "include_dashboard": False}
        ray.init(log_to_driver=False, **kw)
        started = True
    cfg = TinyLMConfig(seed=args.seed)
    rng = torch.Generator().manual_seed(args.seed + 1)
    steps: list[DemoStep] = []
    exact: list[bool] = []
    monitor = LogprobGapMonitor()
    failure: Optional[str] = None
    info: dict = {}
    t_start = time.perf_counter()
    engine = trainer = None
    try:
        Engine, Trainer = actor_classes(ray)
        engine = Engine.remote(cfg.as_dict(), platform.name, args.batch, args.seed, args.logprobs_mode)
        trainer = Trainer.remote(cfg.as_dict(), platform.name, args.lr, args.top_p)
        members = connect(trainer, [engine], timeout_s=args.timeout)
        info = {"members": members, "engine_pid": ray.get(engine.pid.remote()),
                "trainer_pid": ray.get(trainer.pid.remote())}
        if not args.quiet:
            print(f"unisleep demo --ray: engine actor pid={info['engine_pid']} trainer actor pid={info['trainer_pid']} "
                  f"transfer={members[0]['backend']} rendezvous={members[0]['rendezvous']} (from the object store) "
                  f"level={args.level} steps={args.steps} out={args.out}")
        for step in range(1, args.steps + 1):
            prompts = torch.randint(0, cfg.vocab_size, (args.batch, PROMPT_LEN), generator=rng).tolist()
            gens, served = ray.get(engine.generate.remote(prompts, args.max_tokens, 1.0, args.top_p,
                                                          args.seed * 1000 + step - 1))
            tokens = [t for t, _ in gens]
            rewards = [sum(x == args.target for x in t) / max(len(t), 1) for t in tokens]
            rel = ray.get(engine.release.remote(args.level))
            t0 = time.perf_counter()
            tr = ray.get(trainer.train.remote(prompts, tokens, rewards))
            train_ms = (time.perf_counter() - t0) * 1e3
            gs = monitor.observe([lp for _, lp in gens], tr["logprobs"], top_p=args.top_p,
                                 kept_mass=tr["kept_mass"], step=step, version=served)
            version = str(step)
            acq, sent = ray.get([engine.reacquire.remote(version), trainer.send.remote(version)],
                                timeout=args.timeout)
            exact.append(acq["fingerprint"] == sent["fingerprint"])
            probe, _ = ray.get(engine.generate.remote(PROBE_PROMPTS, args.max_tokens, 0.0, 1.0))
            sc = ray.get(trainer.score.remote(PROBE_PROMPTS, [t for t, _ in probe]))
            probe_gap = max(abs(a - b) for (_, lps), ref in zip(probe, sc) for a, b in zip(lps, ref))
            ds = DemoStep(step=step, version=version, level=args.level, resident_before=rel["before"],
                          resident_asleep=rel["asleep"], release_ms=rel["seconds"] * 1e3,
                          reacquire_ms=acq["seconds"] * 1e3, transfer_ms=acq["transfer"] * 1e3, train_ms=train_ms,
                          gap=gs.median_abs_gap, probe_gap=probe_gap, reward=statistics.fmean(rewards),
                          findings=[str(f) for f in gs.findings])
            steps.append(ds)
            step_progress(args, step, f"v{version}  released {kib(ds.released)} KiB  handoff {ds.handoff_ms:.1f} ms  "
                                      f"byte-exact {'yes' if exact[-1] else 'NO'}  probe {ds.probe_gap:.1e}  "
                                      f"reward {ds.reward:.2f}", gs.findings)
    except (UnisleepError, OSError) as e:
        failure = f"{type(e).__name__}: {e}"
    except Exception as e:  # a Ray error wraps the actor's own
        failure = f"{type(e).__name__}: {e}"
    finally:
        for a in (engine, trainer):
            if a is not None:
                try:
                    ray.get(a.close.remote(), timeout=30)
                except Exception:  # the actor is killed next either way
                    pass
                ray.kill(a)
        if started:
            ray.shutdown()
    elapsed = time.perf_counter() - t_start
    checks = embedded_checks(steps, monitor, failure, args.target)
    if steps:
        bad = [s.step for s, e in zip(steps, exact) if not e]
        checks.insert(0, Check("weights byte-exact", not bad,
                               "after every update the engine actor's weights equal the trainer actor's, byte for "
                               "byte (per-tensor fingerprints)" if not bad else
                               f"after steps {bad} the engine actor's weights differ from the trainer actor's"))
    ok = bool(steps) and all(c.ok is not False for c in checks) and len(steps) == args.steps
    print_run(steps, checks, args.target, elapsed, "trainer and engine as Ray actors")
    result = {"ok": ok, "engine": "torch", "ray": True, "platform": platform.name, "args": vars(args),
              "seconds": elapsed, "steps": [s.as_dict() for s in steps], "byte_exact": exact,
              "checks": [c.__dict__ for c in checks], "gap": monitor.summary(), "failure": failure, **info}
    jpath = write_json(args.out, result)
    ppath = None
    if not args.no_plot and steps:
        ppath = plot_steps(steps, os.path.join(args.out, "demo.png"))
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    return verdict(ok)
