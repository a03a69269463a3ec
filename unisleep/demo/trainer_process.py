"""The embedded demo's trainer: :func:`trainer_main` runs in its own process (its own model copy and
optimizer; it scores, trains and sends its weights over a private transfer group), and
:class:`TrainerProcess` is the engine side's handle on it (commands over a pipe)."""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from typing import Any, Callable, Optional

from ..errors import EngineError, UnisleepError
from ..platform import detect_platform
from .constants import BUCKET_BYTES


def trainer_main(conn, rendezvous: str, cfg: dict, platform_name: str, lr: float, top_p: float,
                 timeout_s: float) -> None:
    """The trainer: its own copy of the model and optimizer, in its own process."""
    import torch

    from ..engines.torch_generator import TinyLM, TinyLMConfig, sequence_logprobs
    from ..transfer import TransferGroup, WeightSender

    torch.set_num_threads(1)
    try:  # a failure here (a bad option, a platform that cannot work) goes back to the engine side
        plat = detect_platform(platform_name)
        device = torch.device(plat.torch_device(0))
        model = TinyLM(TinyLMConfig(**cfg)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        conn.send(("init", os.getpid()))
        group = TransferGroup.create(rendezvous, rank=0, world_size=2, platform=plat, timeout_s=timeout_s)
        # host: the collective (gloo) path, as the demo is meant to show; an accelerator: "auto", which
        # picks IPC when both processes share one device (NCCL cannot join two processes on one GPU)
        # keep_buffers=False on every platform: between updates neither side holds any of the
        # transfer's memory, which the demo's residue check reads (the host default would keep it)
        sender = WeightSender(group, bucket_bytes=BUCKET_BYTES, keep_buffers=False,
                              path="auto" if plat.is_accelerator else "collective")
    except BaseException as e:
        _report(conn, e)
        if not isinstance(e, (UnisleepError, ValueError, OSError)):
            traceback.print_exc()  # a bug, not a bad option: keep the trace
        if "group" in locals():
            group.close()
        raise SystemExit(1)  # the engine side shows the error; no traceback here
    conn.send(("ready", os.getpid()))
    try:
        for cmd, arg in commands(conn):
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
                    "loss": loss.detach().item(), "seconds": time.perf_counter() - t0,
                }))
            elif cmd == "send":  # the engine side is receiving now (and is awake: it asked)
                t0 = time.perf_counter()
                named = [(n, p.detach()) for n, p in model.named_parameters()]
                rep = sender.send(named, version=arg)
                conn.send(("sent", {"seconds": time.perf_counter() - t0, "version": getattr(rep, "version", arg)}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except BaseException as e:  # tell the engine side why, then die
        _report(conn, e)
        raise
    finally:
        try:
            group.close()
        except Exception:  # closing after the child's work: a close error must not hide its result
            pass


def commands(conn):
    """The engine side's (command, argument) pairs, until "stop" (answered) or a closed pipe."""
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            conn.send(("stopped", None))
            return
        yield cmd, arg


def _report(conn, e: BaseException) -> None:
    try:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    except Exception:  # the parent is gone: no one to report to
        pass


class TrainerProcess:
    """The engine side's handle on the trainer process."""

    def __init__(self, proc, conn, timeout_s: float):
        self.proc, self.conn, self.timeout_s = proc, conn, timeout_s

    def call(self, cmd: str, arg: Any = None, expect: Optional[str] = None) -> Any:
        self.conn.send((cmd, arg))
        return self.wait(expect)

    def _next(self, also: Optional[Callable[[], bool]] = None) -> Optional[tuple]:
        """The trainer's next message ``(kind, payload)``.  Raises :class:`EngineError` with the
        trainer's own error, or within ~0.1 s of its process dying, or after ``timeout_s``.
        ``also``: return None as soon as it is true."""
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0.05):
            if also is not None and also():
                return None
            if not self.proc.is_alive():
                if self.conn.poll(0):  # its last words, sent before it exited
                    break
                raise EngineError(f"the trainer process {self.proc.pid} died (exit code {self.proc.exitcode}) "
                                  "without saying why; its output above shows the cause")
            if time.monotonic() > deadline:
                raise EngineError(f"the trainer did not answer within {self.timeout_s:.0f} s (--timeout)")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise EngineError(f"the trainer process failed: {payload}")
        return kind, payload

    def wait(self, expect: Optional[str]) -> Any:
        kind, payload = self._next()
        if expect is not None and kind != expect:
            raise EngineError(f"trainer answered {kind!r}, expected {expect!r}")
        return payload

    def run_beside(self, fn: Callable[[], Any], expect: str) -> Any:
        """Run ``fn`` (e.g. joining the transfer group, which blocks until the trainer joins too) in
        a thread while watching the trainer, whose answer when it is done is ``expect``: the
        trainer's error or death is raised within a fraction of a second instead of after ``fn``'s
        own timeout.  Returns what ``fn`` returned."""
        box: dict = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=target, name="unisleep-demo-join", daemon=True)
        t.start()
        got = None
        while got is None and t.is_alive():
            got = self._next(also=lambda: not t.is_alive())
        t.join()
        if "error" in box:
            raise box["error"]
        kind = (got or self._next())[0]
        if kind != expect:
            raise EngineError(f"trainer answered {kind!r}, expected {expect!r}")
        return box["value"]

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop", None))
                self.conn.poll(5)
        except Exception:  # the child may be gone already; it is joined next
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
