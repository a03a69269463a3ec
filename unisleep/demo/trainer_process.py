"""The embedded demo's trainer: :func:`trainer_main` runs in its own process (its own model copy and
optimizer; it scores, trains and sends its weights over a private transfer group), and
:class:`TrainerProcess` is the engine side's handle on it (commands over a pipe)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional

from ..errors import EngineError
from ..platform import detect_platform
from .constants import BUCKET_BYTES


def trainer_main(conn, rendezvous: str, cfg: dict, platform_name: str, lr: float, top_p: float,
                 timeout_s: float) -> None:
    """The trainer: its own copy of the model and optimizer, in its own process."""
    import torch

    from ..engines.torch_generator import TinyLM, TinyLMConfig, sequence_logprobs
    from ..transfer import TransferGroup, WeightSender

    torch.set_num_threads(1)
    plat = detect_platform(platform_name)
    device = torch.device(plat.torch_device(0))
    model = TinyLM(TinyLMConfig(**cfg)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    group = TransferGroup.create(rendezvous, rank=0, world_size=2, platform=plat, timeout_s=timeout_s)
    # host: the collective (gloo) path, as the demo is meant to show; an accelerator: "auto", which
    # picks IPC when both processes share one device (NCCL cannot join two processes on one GPU)
    sender = WeightSender(group, bucket_bytes=BUCKET_BYTES, path="auto" if plat.is_accelerator else "collective")
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                return
            if cmd == "stop":
                conn.send(("stopped", None))
                return
            if cmd == "score":  # the trainer's logprobs of tokens the engine generated
                p = torch.tensor(arg["prompts"], device=device)
                c = torch.tensor(arg["tokens"], device=device)
                with torch.no_grad():
                    lp, kept = sequence_logprobs(model, p, c, top_p=top_p, with_kept_mass=True)
                conn.send(("scored", {"logprobs": lp.cpu().tolist(), "kept_mass": kept.cpu().tolist()}))
            elif cmd == "train":  # score (pre-update: same version as the engine) + one REINFORCE step
                t0 = time.perf_counter()
                p = torch.tensor(arg["prompts"], device=device)
                c = torch.tensor(arg["tokens"], device=device)
                r = torch.tensor(arg["rewards"], device=device, dtype=torch.float32)
                lp, kept = sequence_logprobs(model, p, c, top_p=top_p, with_kept_mass=True)
                adv = r - r.mean()
                loss = -(adv[:, None] * lp).sum(dim=1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                conn.send(("trained", {
                    "logprobs": lp.detach().cpu().tolist(), "kept_mass": kept.detach().cpu().tolist(),
                    "loss": float(loss), "seconds": time.perf_counter() - t0,
                }))
            elif cmd == "send":  # the engine side is receiving now (and is awake: it asked)
                t0 = time.perf_counter()
                named = [(n, p.detach()) for n, p in model.named_parameters()]
                rep = sender.send(named, version=arg)
                conn.send(("sent", {"seconds": time.perf_counter() - t0, "version": getattr(rep, "version", arg)}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except BaseException as e:  # tell the engine side why, then die
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        raise
    finally:
        try:
            group.close()
        except Exception:
            pass


class TrainerProcess:
    """The engine side's handle on the trainer process."""

    def __init__(self, proc, conn, timeout_s: float):
        self.proc, self.conn, self.timeout_s = proc, conn, timeout_s

    def call(self, cmd: str, arg: Any = None, expect: Optional[str] = None) -> Any:
        self.conn.send((cmd, arg))
        return self.wait(expect)

    def wait(self, expect: Optional[str]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise EngineError(f"the trainer process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineError(f"the trainer did not answer within {self.timeout_s:.0f} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise EngineError(f"trainer process: {payload}")
        if expect is not None and kind != expect:
            raise EngineError(f"trainer answered {kind!r}, expected {expect!r}")
        return payload

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop", None))
                self.conn.poll(5)
        except Exception:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
