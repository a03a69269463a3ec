"""A verl worker process for tests/integrations/test_verl.py: builds the checkpoint engine the way
verl's workers do (verl's ``import_external_libs`` on ``custom_backend_module``, then
``CheckpointEngineRegistry.new``) and runs the commands the test sends, as verl's
``CheckpointEngineManager`` calls them."""

from __future__ import annotations

import asyncio
import hashlib
import traceback

BACKEND_MODULE = "unisleep.integrations.verl"


def make_state(seed: int) -> dict:
    """The weights of update ``seed``: a few tensors of several dtypes and shapes (one larger
    than the bucket, so it takes a bucket of its own)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=g, dtype=torch.float32),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g, dtype=torch.float32),
        "lm_head.weight": torch.randn(1024, 512, generator=g, dtype=torch.float32),  # 2 MiB
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def digest(named) -> dict:
    return {n: hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
            + f"|{tuple(t.shape)}|{t.dtype}" for n, t in named}


def _faulty_sender(eng):
    """The engine's sender, as the engine makes it, but one that can alter a bucket on its way."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "transfer"))
    from faults import FaultySender

    return FaultySender(eng.group, bucket_bytes=eng.bucket_size, path=eng.path)


async def _collect(agen) -> list:
    return [(n, t) async for n, t in agen]


def lazy_state(n: int, numel: int, seed: int):
    """``n`` float32 tensors of ``numel`` elements, each made only when the generator reaches it
    (the model never exists at once on the actor, as with verl's gathered parameters)."""
    import torch

    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        yield f"layers.{i}.weight", torch.randn(numel, generator=g)


def lazy_digest(n: int, numel: int, seed: int) -> str:
    h = hashlib.sha256()
    for _, t in lazy_state(n, numel, seed):
        h.update(memoryview(t.numpy()))
    return h.hexdigest()


def _vm(key: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset the peak resident set (Linux: clear_refs 5) and return the resident set now."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _vm("VmRSS")


def main(role: str, is_master: bool, bucket_size: int, engine_kwargs: dict, conn, first=None) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(BACKEND_MODULE)   # what checkpoint_engine.custom_backend_module does
    kw = {"is_master": is_master} if role == "actor" else {}
    # as verl's workers build it: bucket_size from update_weights_bucket_megabytes, then
    # checkpoint_engine.engine_kwargs["unisleep"]
    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=bucket_size, **kw, **engine_kwargs)
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "prepare":
                out = eng.prepare()
            elif cmd == "init":
                eng.init_process_group(**arg)
                out = id(eng.group)
            elif cmd == "send":
                seed, corrupt = arg
                if corrupt:  # a sender whose first bucket goes out altered (tests/transfer/faults.py)
                    if not hasattr(eng._sender, "corrupt"):  # the engine keeps its own sender across syncs
                        if eng._sender is not None:
                            eng._sender.close()
                        eng._sender = _faulty_sender(eng)
                    eng._sender.corrupt = {0}
                try:
                    out = asyncio.run(eng.send_weights(iter(make_state(seed).items()), global_steps=seed))
                finally:  # the sender is kept across syncs: the fault must not outlive this one
                    if hasattr(eng._sender, "corrupt"):
                        eng._sender.corrupt = set()
            elif cmd == "recv":
                got = asyncio.run(_collect(eng.receive_weights(global_steps=arg)))
                if eng.last_error is not None:  # the stream ended early; the engine kept the error
                    raise eng.last_error
                out = {"names": [n for n, _ in got], "digest": digest(got),
                       "version": eng.last_report.version, "path": eng.last_report.path}
            elif cmd == "send_lazy":  # a model many buckets long, produced tensor by tensor
                n, numel, seed, wait_s = arg[:4]
                fail_at = arg[4] if len(arg) > 4 else None
                saw_first = []

                def gen():
                    for i, pair in enumerate(lazy_state(n, numel, seed)):
                        if i == fail_at:
                            raise RuntimeError(f"the trainer's generator failed at tensor {i}")
                        if i == n - 1 and first is not None:  # has the rollout seen the first tensor?
                            saw_first.append(first.wait(wait_s))
                        yield pair

                base = _reset_peak()
                asyncio.run(eng.send_weights(gen(), global_steps=seed))
                out = {"saw_first": saw_first, "peak_extra": _vm("VmHWM") - base}
            elif cmd == "recv_lazy":  # verl's consumer: takes each tensor and drops it
                async def consume():
                    h, names = hashlib.sha256(), []
                    async for name, t in eng.receive_weights(global_steps=arg):
                        if first is not None:
                            first.set()
                        h.update(memoryview(t.contiguous().numpy()))
                        names.append(name)
                        del t
                    return h.hexdigest(), names

                base = _reset_peak()
                dig, names = asyncio.run(consume())
                e = eng.last_error   # a broken sync ends the stream early and keeps its named error
                if e is not None:
                    out = {"error": type(e).__name__, "outcome": getattr(e, "outcome", None), "msg": str(e),
                           "yielded": len(names)}
                else:
                    out = {"digest": dig, "names": names, "peak_extra": _vm("VmHWM") - base}
            elif cmd == "finalize":
                eng.finalize()
                out = None
            elif cmd == "stop":
                eng._close_group()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
            conn.send(("ok", out))
        except BaseException as e:  # reported to the test, which decides
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))
