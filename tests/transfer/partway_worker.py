"""The two processes of test_failure_partway.py: an engine (a TorchGenerator on a host
MemoryLifecycle) and a trainer that sends it weights.  The test kills the sender, or limits the
engine's address space, part-way through an update.

    python partway_worker.py engine RETAIN MODE PORT [PORT2] SPILL_DIR
    python partway_worker.py sender MODE PATH PORT VERSION[,VERSION...] [slow]

``RETAIN``: 1 — the lifecycle retains its level-1 backups (``MemoryLifecycle("host",
retain_backups=True)``) and the engine slept at level 1 before the failing update; 0 — it slept at
level 2 (verl's sleep before every sync), no backup holds the weights.  ``MODE``: ``kill`` (the
test SIGKILLs the sender of update 2; update 3 comes from a fresh sender on ``PORT2``) or ``oom``
(the engine receives update 2 under an address-space limit that its largest bucket does not fit
in; update 3 comes from the same sender, the limit lifted).  ``PATH``: the sender's ``path``
(``ipc``: the engine maps the sender's bucket memory; ``collective``: the bytes come over a
socket into the engine's own bucket buffers).

Every step is one JSON line on stdout.  The engine prints ``{"applied": n}`` after each bucket it
wrote (through :class:`Observed`, a test-side subclass: the receiver's apply is the engine's own
``update_weights``), then ``{"update": 2, ...}`` with the outcome of the failed update and what
generation did, then ``{"update": 3, ...}``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback

import torch

#: the kill test: the default tiny model, in small buckets (about 20 of them)
SMALL = dict()
#: the memory test: two 64 MiB tensors (the token embedding and the head) that come last, each
#: in a bucket of its own whose memory (a mapping of the sender's, or a receive buffer) the
#: address-space limit leaves no room for
BIG = dict(vocab_size=131072, d_model=128)
BUCKET_BYTES = 16 << 10
#: address space the engine may still take during update 2 (the big buckets need 64 MiB more)
OOM_ROOM = 24 << 20
PROMPT = [[1, 2, 3, 4], [5, 6]]


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def config(mode: str):
    from unisleep.engines.torch_generator import TinyLMConfig

    return TinyLMConfig(**(BIG if mode == "oom" else SMALL))


def weights(mode: str, v: int) -> dict:
    """Version ``v`` of the model's weights, smallest tensors first (the sender's order)."""
    from unisleep.engines.torch_generator import TinyLM

    shapes = {k: tuple(p.shape) for k, p in TinyLM(config(mode)).named_parameters()}
    g = torch.Generator().manual_seed(v)
    out = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    return dict(sorted(out.items(), key=lambda kv: kv[1].numel()))


def sender(mode: str, path: str, port: int, versions: list, slow: bool) -> int:
    from unisleep.transfer import TransferGroup, WeightSender

    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", 0, 2, platform="host", timeout_s=60)
    say(ready="sender")
    # the memory test: the receive buffers are given back after each update (as on an accelerator), so
    # that update 2 allocates its big buckets anew
    tx = WeightSender(g, bucket_bytes=BUCKET_BYTES, path=path, keep_buffers=False if mode == "oom" else None)
    for i, v in enumerate(versions):
        w = weights(mode, v)
        items = w.items()
        if slow and i == len(versions) - 1:  # a trainer's generator: one tensor every 50 ms
            def trickle(w=w):
                for k, t in w.items():
                    time.sleep(0.05)
                    yield k, t

            items = trickle()
        specs = [(k, tuple(t.shape), t.dtype) for k, t in w.items()]
        try:
            tx.send(items, v, specs=specs)
            say(sent=v, ok=True)
        except Exception as e:  # noqa: BLE001
            say(sent=v, ok=False, type=type(e).__name__, msg=str(e)[:500])
    g.close()
    return 0


def engine(retain: bool, mode: str, ports: list, spill: str) -> int:
    from unisleep import MemoryLifecycle
    from unisleep.engines.torch_generator import TorchGenerator
    from unisleep.errors import TornWeightsError

    class Observed(TorchGenerator):
        """The engine, saying how many buckets it has written so far (the test's seam)."""

        applied = 0

        def update_weights(self, update_info):
            super().update_weights(update_info)
            Observed.applied += 1
            say(applied=Observed.applied)

    lc = MemoryLifecycle("host", retain_backups=retain, spill_dir=spill)
    gen = Observed(config(mode), lifecycle=lc, max_batch=4)
    rx = [gen.init_weight_transfer({"rendezvous": f"tcp://127.0.0.1:{ports[0]}", "timeout_s": 60})]

    def receive(limit: int = 0) -> dict:
        Observed.applied = 0
        gen.start_weight_update()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        t0 = time.monotonic()
        try:
            if limit:
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            try:
                rep = rx[0].receive()
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            gen.finish_weight_update(str(rep.version))
            return {"ok": True, "version": rep.version, "seconds": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001
            gen.abort_weight_update()
            cause = e.__cause__
            where = traceback.format_exception(cause)[-3:] if cause is not None else []
            return {"ok": False, "type": type(e).__name__, "msg": str(e)[:2000], "cause": "".join(where)[-1500:],
                    "outcome": getattr(e, "outcome", None), "seconds": time.monotonic() - t0}

    def generation() -> dict:
        try:
            return {"tokens": [g.token_ids for g in gen.generate(PROMPT, max_tokens=4)]}
        except TornWeightsError as e:
            return {"refused": type(e).__name__, "msg": str(e), "version": e.version, "previous": e.previous,
                    "names": len(e.names or ())}

    def exact(v: int) -> bool:
        want = weights(mode, v)
        return all(torch.equal(p, want[k]) for k, p in gen.model.named_parameters())

    if not retain:  # verl: a level-2 sleep before every sync; the weights come back by update 1
        gen.sleep(2)
        gen.wake_up()
    one = receive()
    assert one["ok"], one
    if retain:  # the level-1 backup of version 1 stays after the wake
        gen.sleep(1)
        gen.wake_up()
    before = generation()
    say(ready="engine", update1=one, exact1=exact(1))
    limit = 0
    if mode == "oom":
        vm = int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmSize:"))) * 1024
        limit = vm + OOM_ROOM
    two = receive(limit)
    two.update(update=2, applied=Observed.applied, exact1=exact(1), torn=lc.torn is not None)
    two["generate"] = generation()
    two["same_tokens"] = two["generate"].get("tokens") == before["tokens"]
    say(**two)
    if mode == "kill":  # the sender died with its store: a fresh sender, a fresh group
        rx[0] = gen.init_weight_transfer({"rendezvous": f"tcp://127.0.0.1:{ports[1]}", "timeout_s": 60})
    three = receive()
    three.update(update=3, exact3=exact(3), torn=lc.torn is not None, generate=generation())
    say(**three)
    gen.close()
    lc.close()
    return 0


def main() -> int:
    role = sys.argv[1]
    if role == "sender":
        mode, path, port, versions = sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(v) for v in sys.argv[5].split(",")]
        return sender(mode, path, port, versions, slow=sys.argv[6:] == ["slow"])
    retain, mode = sys.argv[2] == "1", sys.argv[3]
    ports = [int(p) for p in sys.argv[4:-1]]
    return engine(retain, mode, ports, sys.argv[-1])


if __name__ == "__main__":
    sys.exit(main())
