"""The trainer of ``unisleep demo --model``, in its own process: the preset's model (float32
master weights; bf16 autocast forward for the bf16 presets), AdamW, and its memory in its OWN
:class:`~unisleep.lifecycle.MemoryLifecycle`, so it can be offloaded while the engine generates —
the other direction of the colocated handoff (verl and slime offload the trainer's parameters,
gradients and optimizer state while the rollout engine runs).

Tags of the trainer's lifecycle: ``"weights"`` (the parameters, adopted), ``"optimizer"`` (AdamW's
``exp_avg`` / ``exp_avg_sq``, allocated there, two flat buffers) and ``"grads"`` (the gradients, one
flat buffer that backward accumulates into).  The offload is a level-1 sleep with ``"optimizer"``
among the offloaded tags: weights and optimizer state are copied to host memory and their device
memory released; the gradients are discarded (they come back as zeros — what ``zero_grad`` gives).
``train`` wakes the weights and gradients, runs the forward and backward, wakes the optimizer
state for the step only, discards the gradients, makes the serving copy (the new weights in the
engine's dtype, one flat buffer in the engine's layout) and offloads the rest at once: until the
probe is scored the trainer holds only that copy on the device.

Commands (over the pipe, answered by name): ``offload``, ``train``, ``send``, ``score``, ``stop``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Optional

from ..errors import UnisleepError
from ..platform import detect_platform
from .presets import action_logprobs, build_model, fingerprint, preset, torch_dtype
from .hf_engine import flat_pieces
from .residue import host_backup, rss_bytes
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


def allocated_live(torch, device) -> int:
    """Bytes of live tensors in the framework allocator on the device (what ``empty_cache`` cannot
    give back; 0 on host)."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "memory_allocated"):
        return 0
    return int(mod.memory_allocated(device))


def largest_live_blocks(torch, device, n: int = 8) -> list[int]:
    """The sizes of the ``n`` largest live blocks in the framework allocator (what a sleeping
    process still holds there); empty on host or where the allocator cannot say."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "memory_snapshot"):
        return []
    try:
        sizes = [b["size"] for seg in mod.memory_snapshot() for b in seg.get("blocks", ())
                 if b.get("state") == "active_allocated"]
    except Exception:  # a figure for a table
        return []
    return sorted(sizes, reverse=True)[:n]


def empty_cache(torch, device, lc=None) -> None:
    """Empty the framework allocator's cache on the device; with ``lc`` (a side going to sleep)
    first give back what the platform's device libraries keep (``release_library_caches``: on
    CUDA torch's cuBLAS workspaces, one per thread that ran a matmul — backward's among them)."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "empty_cache"):
        return
    if lc is not None:
        from ..registry import backend_of

        described = backend_of(lc.driver)
        if described is not None:
            described.release_library_caches()
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


def device_used(torch, device) -> Optional[int]:
    """Bytes in use on the whole device (every process), or None on host."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "mem_get_info"):
        return None
    free, total = mod.mem_get_info(device)
    return int(total - free)


def allocator_peak(torch, device, reset: bool = False) -> int:
    """The most bytes the framework's allocator reserved since the last reset (0 on host)."""
    mod = _dev_mod(torch, device)
    if device.type == "cpu" or mod is None or not hasattr(mod, "max_memory_reserved"):
        return 0
    if reset:
        mod.reset_peak_memory_stats(device)
    return int(mod.max_memory_reserved(device))


def hf_trainer_main(conn, rendezvous: str, model_name: str, platform_name: str, lr: float, top_p: float,
                    timeout_s: float, seed: int) -> None:
    import torch

    from ..lifecycle import MemoryLifecycle
    from ..transfer import TransferGroup, WeightSender

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    group = sender = None
    marks: list = []

    def memory() -> dict:
        """Where this process's memory is now: its lifecycle, its allocator, the device, its
        resident set, the transfer's buckets it holds, its backups' host memory."""
        return {"resident": lc.resident_bytes(), "allocator": allocator_bytes(torch, device),
                "allocated": allocated_live(torch, device), "device_used": device_used(torch, device), "rss": rss_bytes(),
                "transfer": sender.buffer_bytes() if sender is not None else 0, "host_backup": host_backup(lc)}

    def mark(phase: str) -> None:
        marks.append({"t": time.monotonic(), "phase": phase, **memory()})

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
        del t, g, m, v
        grad_ptr = plist[0].grad.data_ptr()
        send_dtype = torch_dtype(p.dtype)
        autocast = (torch.autocast(device_type=device.type, dtype=send_dtype) if p.mixed
                    else torch.autocast(device_type=device.type, enabled=False))
        mark("trainer built: weights, AdamW state, grads")
        # offloaded before the engine is built: the two never hold their whole state at once
        rep = lc.sleep(1, offload_tags=["optimizer"])
        mark("trainer offloaded")
        conn.send(("init", {"pid": os.getpid(), "params": total, "layout": [(n, t.numel()) for n, t in params.items()],
                            "copy_limit": limit, "tags": {t: lc.allocated_bytes(t) for t in lc.tags},
                            "phases": marks, "offload": {"seconds": rep.seconds, "bytes_copied": rep.bytes_copied}}))
        group = TransferGroup.create(rendezvous, rank=0, world_size=2, platform=plat, timeout_s=timeout_s)
        # keep_buffers=False on every platform: between updates neither side holds any of the
        # transfer's memory, which the demo's residue check reads (the host default would keep it)
        # buckets: the library's default on an accelerator (sized from free memory), 512 MiB on the host
        sender = WeightSender(group, bucket_bytes=None if plat.is_accelerator else BUCKET_BYTES_MODEL, keep_buffers=False,
                              path="auto" if plat.is_accelerator else "collective")
    except BaseException as e:
        _report(conn, e)
        if not isinstance(e, (UnisleepError, ValueError, OSError)):
            traceback.print_exc()
        if group is not None:
            group.close()
        raise SystemExit(1)

    def logprobs(prompts, tokens, served=None):
        """Action logprobs of ``tokens`` after ``prompts`` in one full forward: the trainer's own
        numerics (its float32 master weights, bf16 autocast for the bf16 presets), or with
        ``served`` — ``{name: tensor}`` in the serving dtype — the engine's numerics: those bytes,
        no autocast, activations in the serving dtype."""
        ids = torch.cat([prompts, tokens], dim=1)
        P, C = prompts.shape[1], tokens.shape[1]
        if served is None:
            with autocast:
                logits = model(input_ids=ids, use_cache=False).logits[:, P - 1:P + C - 1]
        else:
            with torch.autocast(device_type=device.type, enabled=False):
                logits = torch.func.functional_call(model, served, (), {"input_ids": ids, "use_cache": False}
                                                    ).logits[:, P - 1:P + C - 1]
        return action_logprobs(logits, tokens)

    def serving_copy():
        """The weights as the engine serves them: one flat buffer in the serving dtype (the engine's
        layout), its per-parameter views by name, and their fingerprints."""
        with torch.no_grad():
            buf = torch.empty(total, dtype=send_dtype, device=device)
            named = dict(zip(params, views(buf)))
            for n, t in params.items():
                named[n].copy_(t)
        return buf, named, fingerprint(named.items())

    conn.send(("ready", os.getpid()))
    outgoing = served = None  # the serving-dtype copy of the last step: sent, then scored by the probe
    try:
        for cmd, arg in commands(conn):
            if cmd == "offload":  # the engine is about to generate: give the device back
                before = memory()
                outgoing = served = None
                empty_cache(torch, device, lc)
                rep = lc.sleep(1, offload_tags=["optimizer"])  # already asleep after a step: nothing moves
                conn.send(("offloaded", {"seconds": rep.seconds, "bytes_copied": rep.bytes_copied,
                                         "bytes_released": rep.bytes_released, "before": before,
                                         "after": {**memory(), "live_blocks": largest_live_blocks(torch, device)},
                                         "state": lc.state()}))
            elif cmd == "train":
                marks.clear()
                before = memory()
                allocator_peak(torch, device, reset=True)
                # the optimizer state (2 x 4 B/param) stays on the host through the forward and
                # backward and comes back only for the step: at 7B the three awake at once do not
                # leave room for the activations on one H200
                rep = lc.wake_up(["weights", "grads"])
                restore = {"seconds": rep.seconds, "bytes_copied": rep.bytes_copied}
                mark("trainer: weights + grads awake")
                t0 = time.perf_counter()
                pr = torch.tensor(arg["prompts"], device=device)
                tk = torch.tensor(arg["tokens"], device=device)
                r = torch.tensor(arg["rewards"], device=device, dtype=torch.float32)
                lp_served = None
                if p.mixed:  # the rollouts scored in the engine's numerics too: what the gap is made of
                    with torch.no_grad():
                        cast = {n: t.detach().to(send_dtype) for n, t in params.items()}
                        lp_served = logprobs(pr, tk, served=cast).cpu().tolist()
                        del cast
                lp = logprobs(pr, tk)
                adv = r - r.mean()
                loss = -(adv[:, None] * lp).sum(dim=1).mean()
                loss.backward()
                if plist[0].grad is None or plist[0].grad.data_ptr() != grad_ptr:
                    raise UnisleepError("backward did not accumulate into the gradient buffer of the trainer's "
                                        "lifecycle; this torch version replaces .grad")
                lp_list, loss_v = lp.detach().cpu().tolist(), loss.detach().item()
                del lp, loss
                mark("trainer: backward done")
                empty_cache(torch, device)  # the activations and autocast casts: room for the optimizer state
                rep = lc.wake_up(["optimizer"])
                restore = {"seconds": restore["seconds"] + rep.seconds,
                           "bytes_copied": restore["bytes_copied"] + rep.bytes_copied}
                mark("trainer: optimizer awake (the step)")
                opt.step()
                lc.discard(["grads"])  # used: release them now (they wake as zeros)
                outgoing, served, fp = serving_copy()
                mark("trainer: stepped, serving copy made")
                _sync(torch, device)
                train_s = time.perf_counter() - t0
                # the new weights are in the serving copy: the master weights and the AdamW state go
                # to host memory now, before the engine wakes to receive (the trainer keeps the copy)
                awake = lc.resident_bytes()
                off = lc.sleep(1, offload_tags=["optimizer"])
                empty_cache(torch, device, lc)
                mark("trainer: offloaded (serving copy kept)")
                conn.send(("trained", {
                    "logprobs": lp_list, "logprobs_served": lp_served, "loss": loss_v,
                    "seconds": train_s, "restore": restore, "before": before, "awake": awake, "after": memory(),
                    "offload": {"seconds": off.seconds, "bytes_copied": off.bytes_copied,
                                "bytes_released": off.bytes_released},
                    "allocator_peak": allocator_peak(torch, device), "phases": list(marks), "fingerprint": fp,
                }))
            elif cmd == "send":
                t0 = time.perf_counter()
                rep = sender.send(flat_pieces(outgoing), version=arg)
                conn.send(("sent", {"seconds": time.perf_counter() - t0, "report": rep.as_dict()}))
            elif cmd == "score":  # the probe: in the engine's numerics, from the bytes that were sent
                pr = torch.tensor(arg["prompts"], device=device)
                tk = torch.tensor(arg["tokens"], device=device)
                with torch.no_grad():
                    lp = logprobs(pr, tk, served=served)
                conn.send(("scored", {"logprobs": lp.cpu().tolist(), "memory": memory()}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except BaseException as e:
        _report(conn, e)
        raise
    finally:
        try:
            group.close()
        except Exception:  # closing after the run's result: a close error must not hide it
            pass
        try:
            lc.close()
        except Exception:  # closing after the run's result: a close error must not hide it
            pass
