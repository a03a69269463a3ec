"""The trainer of ``unisleep demo --model``, in its own process: the preset's model (float32
master weights; bf16 autocast forward for the bf16 presets), AdamW, and its memory in its OWN
:class:`~unisleep.lifecycle.MemoryLifecycle`, so it can be offloaded while the engine generates —
the other direction of the colocated handoff (verl and slime offload the trainer's parameters,
gradients and optimizer state while the rollout engine runs).

Tags of the trainer's lifecycle: ``"weights"`` (the parameters, adopted), ``"optimizer"`` (AdamW's
``exp_avg`` / ``exp_avg_sq``, allocated there, two flat buffers) and ``"grads"`` (the gradients, one
flat buffer that backward accumulates into).  ``offload`` is a level-1 sleep with ``"optimizer"``
among the offloaded tags: weights and optimizer state are copied to host memory and their device
memory released; the gradients are discarded (they come back as zeros — what ``zero_grad`` gives).
``train`` wakes everything, takes one policy-gradient step, and discards the gradients at once.

Commands (over the pipe, answered by name): ``offload``, ``train``, ``send``, ``score``, ``stop``.
"""

from __future__ import annotations

import os
import time
import traceback

from ..errors import UnisleepError
from ..platform import detect_platform
from .presets import action_logprobs, build_model, fingerprint, preset, torch_dtype
from .hf_engine import flat_pieces
from .trainer_process import _report, commands

BUCKET_BYTES_MODEL = 512 << 20


def _dev_mod(torch, device):
    return getattr(torch, device.type, None)


def _sync(torch, device):
    mod = _dev_mod(torch, device)
    if device.type != "cpu" and mod is not None:
        mod.synchronize()


def allocator_bytes(torch, device) -> int:
    """Bytes the framework's own allocator holds on the device (0 on host)."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "memory_reserved"):
        return 0
    return int(mod.memory_reserved(device))


def empty_cache(torch, device) -> None:
    mod = _dev_mod(torch, device)
    if device.type != "cpu" and mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()


def copy_limit(torch, device, nbytes: int = 1 << 30) -> dict:
    """The host<->device copy rate of pinned memory on this machine, now (best of 3 each way):
    the limit an offload or a restore is measured against.  Empty on host."""
    if device.type == "cpu":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d_gbps": (dev, host), "d2h_gbps": (host, dev)}.items():
        best = float("inf")
        for _ in range(3):
            _sync(torch, device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(torch, device)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    del host, dev
    empty_cache(torch, device)
    return out


def hf_trainer_main(conn, rendezvous: str, model_name: str, platform_name: str, lr: float, top_p: float,
                    timeout_s: float, seed: int) -> None:
    import torch

    from ..lifecycle import MemoryLifecycle
    from ..transfer import TransferGroup, WeightSender

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    group = None
    try:
        p = preset(model_name)
        plat = detect_platform(platform_name)
        device = torch.device(plat.torch_device(0))
        limit = copy_limit(torch, device)
        lc = MemoryLifecycle(plat)
        model = build_model(p, str(device), seed)
        model.train()
        params = dict(model.named_parameters())
        lc.adopt(params, tag="weights")
        empty_cache(torch, device)  # the pre-adoption copies: back to the device before the optimizer state
        plist = list(params.values())
        sizes = [t.numel() for t in plist]
        total = sum(sizes)
        # the optimizer state and the gradients: flat buffers in lifecycle memory, one view per parameter
        flat = {k: lc.empty((total,), torch.float32, tag=tag) for k, tag in
                (("exp_avg", "optimizer"), ("exp_avg_sq", "optimizer"), ("grad", "grads"))}

        def views(buf):
            out, off = [], 0
            for t, n in zip(plist, sizes):
                out.append(buf[off:off + n].view(t.shape))
                off += n
            return out

        fused = device.type != "cpu" or hasattr(torch, "_fused_adamw_")
        opt = torch.optim.AdamW(plist, lr=lr, weight_decay=0.01, fused=fused)
        for t, g, m, v in zip(plist, views(flat["grad"]), views(flat["exp_avg"]), views(flat["exp_avg_sq"])):
            t.grad = g  # backward accumulates into this lifecycle memory
            opt.state[t] = {"step": torch.zeros((), dtype=torch.float32, device=device if fused else "cpu"),
                            "exp_avg": m, "exp_avg_sq": v}
        grad_ptr = plist[0].grad.data_ptr()
        send_dtype = torch_dtype(p.dtype)
        autocast = (torch.autocast(device_type=device.type, dtype=send_dtype) if p.mixed
                    else torch.autocast(device_type=device.type, enabled=False))
        conn.send(("init", {"pid": os.getpid(), "params": total, "layout": [(n, t.numel()) for n, t in params.items()], "copy_limit": limit,
                            "tags": {t: lc.allocated_bytes(t) for t in lc.tags}}))
        group = TransferGroup.create(rendezvous, rank=0, world_size=2, platform=plat, timeout_s=timeout_s)
        sender = WeightSender(group, bucket_bytes=BUCKET_BYTES_MODEL, path="auto" if plat.is_accelerator else "collective")
    except BaseException as e:
        _report(conn, e)
        if not isinstance(e, (UnisleepError, ValueError, OSError)):
            traceback.print_exc()
        if group is not None:
            group.close()
        raise SystemExit(1)

    def memory() -> dict:
        return {"resident": lc.resident_bytes(), "allocator": allocator_bytes(torch, device)}

    def logprobs(prompts, tokens):
        ids = torch.cat([prompts, tokens], dim=1)
        P, C = prompts.shape[1], tokens.shape[1]
        with autocast:
            logits = model(input_ids=ids).logits[:, P - 1:P + C - 1]
        return action_logprobs(logits, tokens)

    conn.send(("ready", os.getpid()))
    outgoing = None
    try:
        for cmd, arg in commands(conn):
            if cmd == "offload":  # the engine is about to generate: give the device back
                before = memory()
                outgoing = None
                empty_cache(torch, device)
                rep = lc.sleep(1, offload_tags=["optimizer"])
                conn.send(("offloaded", {"seconds": rep.seconds, "bytes_copied": rep.bytes_copied,
                                         "bytes_released": rep.bytes_released, "before": before, "after": memory(),
                                         "state": lc.state()}))
            elif cmd == "train":
                before = memory()
                # the optimizer state (2 x 4 B/param) stays on the host through the forward and
                # backward and comes back only for the step: at 7B the three awake at once do not
                # leave room for the activations on one H200
                rep = lc.wake_up(["weights", "grads"])
                restore = {"seconds": rep.seconds, "bytes_copied": rep.bytes_copied}
                t0 = time.perf_counter()
                pr = torch.tensor(arg["prompts"], device=device)
                tk = torch.tensor(arg["tokens"], device=device)
                r = torch.tensor(arg["rewards"], device=device, dtype=torch.float32)
                lp = logprobs(pr, tk)
                adv = r - r.mean()
                loss = -(adv[:, None] * lp).sum(dim=1).mean()
                loss.backward()
                if plist[0].grad is None or plist[0].grad.data_ptr() != grad_ptr:
                    raise UnisleepError("backward did not accumulate into the gradient buffer of the trainer's "
                                        "lifecycle; this torch version replaces .grad")
                empty_cache(torch, device)  # the activations are gone: room for the optimizer state
                rep = lc.wake_up(["optimizer"])
                restore = {"seconds": restore["seconds"] + rep.seconds,
                           "bytes_copied": restore["bytes_copied"] + rep.bytes_copied}
                opt.step()
                lc.discard(["grads"])  # used: release them now (they wake as zeros)
                with torch.no_grad():  # the engine's layout: one flat buffer in the serving dtype
                    flat_out = torch.empty(total, dtype=send_dtype, device=device)
                    out_views = views(flat_out)
                    for v, t in zip(out_views, plist):
                        v.copy_(t)
                outgoing = flat_pieces(flat_out)
                lp_list, loss_v = lp.detach().cpu().tolist(), loss.detach().item()
                del lp, loss
                empty_cache(torch, device)  # the autocast weight casts and activations: back to the device
                _sync(torch, device)
                conn.send(("trained", {
                    "logprobs": lp_list, "loss": loss_v,
                    "seconds": time.perf_counter() - t0, "restore": restore, "before": before, "after": memory(),
                    "fingerprint": fingerprint(zip(params, out_views)),
                }))
                flat_out = out_views = None  # outgoing holds the buffer until the next offload
            elif cmd == "send":
                t0 = time.perf_counter()
                rep = sender.send(outgoing, version=arg)
                conn.send(("sent", {"seconds": time.perf_counter() - t0, "report": rep.as_dict()}))
            elif cmd == "score":
                pr = torch.tensor(arg["prompts"], device=device)
                tk = torch.tensor(arg["tokens"], device=device)
                with torch.no_grad():
                    lp = logprobs(pr, tk)
                conn.send(("scored", {"logprobs": lp.cpu().tolist()}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except BaseException as e:
        _report(conn, e)
        raise
    finally:
        try:
            group.close()
        except Exception:
            pass
        try:
            lc.close()
        except Exception:
            pass
