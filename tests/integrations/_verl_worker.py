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


def main(role: str, is_master: bool, bucket_size: int, engine_kwargs: dict, conn) -> None:
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
                    eng._sender = eng._sender or _faulty_sender(eng)
                    eng._sender.corrupt = {0}
                metrics = asyncio.run(eng.send_weights(iter(make_state(seed).items()), global_steps=seed))
                if hasattr(eng._sender, "corrupt"):
                    eng._sender.corrupt = set()
                out = metrics
            elif cmd == "recv":
                got = asyncio.run(_collect(eng.receive_weights(global_steps=arg)))
                out = {"names": [n for n, _ in got], "digest": digest(got),
                       "version": eng.last_report.version, "path": eng.last_report.path}
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
