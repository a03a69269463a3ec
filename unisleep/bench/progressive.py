"""``unisleep bench --backend NAME --progressive``: hide the bus behind the forward pass.

A model of ``--layers`` equal layers (``--weights`` GiB in all, tag "weights", adopted in layer
order) and ``--kv`` GiB of KV cache (tag "kv_cache").  Each cycle changes the weights a little
(so every copy really runs), then measures, beside each other in the same run:

=====================================  ==========================================================
plain wake                             ``wake_up(["weights"])`` until its copies are done (the
                                       copy alone), then the forward pass
progressive: returns                   ``wake_up(["weights"], progressive=True)`` returning
progressive: first layer can start     until layer 0's bytes are back (its ``ready`` fence done)
progressive: full forward              from the call until a forward pass with the ready hooks
                                       installed has finished (goal: <= 1.05 x the copy alone)
plain sleep                            ``sleep(1)`` (weights backed up, KV cache released)
background sleep: returns              ``sleep(1, background=True)``: KV cache free on return
background sleep: copies done          until ``wait()`` returns
=====================================  ==========================================================

Every progressive forward is checked against the output of the plain path, and the woken
weights byte for byte.  Accelerators (``--backend`` a device platform) default to 8 GiB in 32
layers + 16 GiB KV; the host backend to 1 GiB in 32 layers + 1 GiB KV (spill files).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

from ..cli import CommandParser, parse_args, plain
from ..errors import UnisleepError
from .common import add_output_options, output_path, print_table, progress, write_json

GiB = 1 << 30

GOALS = {"first_layer_s": 0.010, "full_forward_ratio": 1.05, "bg_sleep_return_s": 0.010}


def _shape(on_host: bool) -> tuple[int, int]:
    """(columns of each layer's weight, bytes per element): float32 x 1024 on the host, bfloat16
    x 8192 on an accelerator."""
    return (1024, 4) if on_host else (8192, 2)


def min_weights_gib(layers: int, on_host: bool) -> float:
    """The least --weights for ``layers`` layers: each layer's weight must have at least as many
    rows as columns (its output is folded back to the next layer's width)."""
    cols, elem = _shape(on_host)
    return layers * cols * cols * elem / GiB


def _model(lc, layers: int, nbytes: int, on_host: bool):
    import torch

    dtype = torch.float32 if on_host else torch.bfloat16
    cols, elem = _shape(on_host)
    rows = max(2, nbytes // layers // (cols * elem)) // 2 * 2

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=lc.torch_device),
                                             requires_grad=False)

        def forward(self, x):
            y = x @ self.weight.t()  # rows outputs, folded back to cols
            y = y.view(x.shape[0], -1, cols).sum(1) if rows % cols == 0 else y[:, :cols]
            return torch.tanh(y)

    model = torch.nn.Sequential(*[Layer() for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    lc.adopt(model, tag="weights")
    x = torch.randn(8, cols, dtype=dtype, device=lc.torch_device)
    return model, x


def run(platform: str, device: int, weights_gib: float, kv_gib: float, layers: int, cycles: int,
        chunk_bytes: Optional[int] = None) -> dict:
    import torch

    from unisleep import MemoryLifecycle

    lc = MemoryLifecycle(platform, device=device, chunk_bytes=chunk_bytes)
    on_host = lc.platform_name == "host"
    drv = lc.driver
    sync = drv.synchronize
    model, x = _model(lc, layers, int(weights_gib * GiB), on_host)
    kv = lc.empty((int(kv_gib * GiB),), torch.uint8, tag="kv_cache")
    kv.fill_(1)
    params = list(model.parameters())
    out: dict = {"backend": lc.platform_name, "layers": layers, "weights_bytes": sum(p.numel() * p.element_size()
                                                                                       for p in params),
                 "kv_bytes": kv.numel(), "chunk_bytes": lc.chunk_bytes}
    hooks = lc.install_ready_hooks(model)  # no-ops unless a progressive wake is in flight
    lc.prepare_backup(background=False)
    ok = True

    def change():
        with torch.no_grad():
            for p in params:
                p.view(-1)[:64].mul_(-1)  # a real change: every copy must run
        sync()

    def forward():
        with torch.no_grad():
            return model(x)

    forward(), sync()  # warm the kernels
    timings = []  # the progressive worker's own phases
    rows = {k: [] for k in ("plain_sleep_s", "plain_wake_s", "plain_wake_forward_s", "forward_s",
                            "prog_return_s", "first_layer_s", "full_forward_s", "bg_sleep_return_s",
                            "bg_sleep_done_s", "bg_kv_freed_bytes")}
    for i in range(cycles):
        change()
        ref_w = [p.detach().clone() for p in params]
        ref_out = forward()
        sync()
        t0 = time.perf_counter()
        forward()
        sync()
        rows["forward_s"].append(time.perf_counter() - t0)

        # plain sleep, plain wake (the copy alone), then the forward
        t0 = time.perf_counter()
        lc.sleep(1)
        sync()
        rows["plain_sleep_s"].append(time.perf_counter() - t0)
        lc.wake_up(["kv_cache"])
        sync()
        t0 = time.perf_counter()
        lc.wake_up(["weights"])
        sync()
        rows["plain_wake_s"].append(time.perf_counter() - t0)
        y = forward()
        sync()
        rows["plain_wake_forward_s"].append(time.perf_counter() - t0)
        ok = ok and bool(torch.equal(y, ref_out))

        # background sleep of changed weights (the copy really runs): the KV cache is free when it returns
        change()
        free0 = drv.memory_info()[0]
        t0 = time.perf_counter()
        lc.sleep(1, background=True)
        rows["bg_sleep_return_s"].append(time.perf_counter() - t0)
        freed = drv.memory_info()[0] - free0 if not on_host else kv.numel() - lc.resident_bytes("kv_cache")
        rows["bg_kv_freed_bytes"].append(freed)
        lc.wait()
        sync()
        rows["bg_sleep_done_s"].append(time.perf_counter() - t0)
        ok = ok and lc.state() == {"weights": "offloaded", "kv_cache": "discarded"}

        # progressive wake: when layer 0 can start (its fence), on its own ...
        lc.wake_up(["kv_cache"])
        sync()
        t0 = time.perf_counter()
        pw = lc.wake_up(["weights"], progressive=True)
        rows["prog_return_s"].append(time.perf_counter() - t0)
        lc.ready(model[0])
        drv.fence_sync(drv.fence())
        rows["first_layer_s"].append(time.perf_counter() - t0)
        lc.wait()
        timings.append(dict(pw.timings))
        change()  # back to the reference weights
        ok = ok and all(torch.equal(p, r) for p, r in zip(params, ref_w))

        # ... and a full forward right after the call, layer by layer behind the copies
        lc.sleep(1)
        lc.wake_up(["kv_cache"])
        sync()
        t0 = time.perf_counter()
        pw = lc.wake_up(["weights"], progressive=True)
        y = forward()
        sync()
        rows["full_forward_s"].append(time.perf_counter() - t0)
        lc.wait()
        timings.append(dict(pw.timings))
        ok = ok and bool(torch.equal(y, ref_out)) and all(torch.equal(p, r) for p, r in zip(params, ref_w))
        progress(f"cycle {i + 1}/{cycles}: plain wake {rows['plain_wake_s'][-1]:.4f}s, progressive first layer "
                 f"{rows['first_layer_s'][-1]:.4f}s, full forward {rows['full_forward_s'][-1]:.4f}s, background "
                 f"sleep returns {rows['bg_sleep_return_s'][-1]:.4f}s; verified {ok}")
    for h in hooks:
        h.remove()
    for k, v in rows.items():
        out[k] = statistics.median(v)
        out[k + "_all"] = v
    out["full_forward_ratio"] = out["full_forward_s"] / out["plain_wake_s"]
    out["progressive_timings"] = timings
    for k in ("map_first_s", "map_rest_s", "queued_s"):
        vals = [t[k] for t in timings if k in t]
        if vals:
            out["progressive_" + k] = statistics.median(vals)
    out["verified"] = ok
    del kv, model, params, ref_w
    lc.close()
    return out


LABELS = [
    ("plain_wake_s", "plain wake 'weights' (the copy alone)", None),
    ("plain_wake_forward_s", "plain wake, then forward", None),
    ("forward_s", "forward alone (weights resident)", None),
    ("prog_return_s", "progressive wake: call returns", None),
    ("first_layer_s", "progressive: layer 0 can start", "first_layer_s"),
    ("full_forward_s", "progressive: full forward done", None),
    ("full_forward_ratio", "  ratio to the copy alone", "full_forward_ratio"),
    ("plain_sleep_s", "plain level-1 sleep", None),
    ("bg_sleep_return_s", "background sleep: returns, KV free", "bg_sleep_return_s"),
    ("bg_sleep_done_s", "background sleep: copies done (wait)", None),
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = CommandParser(prog="unisleep bench", description=plain(__doc__))
    ap.add_argument("--backend", default="host", help="the platform to measure (default host; an accelerator: a "
                    "device of it must be here)")
    ap.add_argument("--progressive", action="store_true", help="this benchmark")
    ap.add_argument("--device", type=int, default=0, help="the device index (default 0)")
    ap.add_argument("--weights", type=float, default=None, help="GiB of weights (default 8; host 1)")
    ap.add_argument("--kv", type=float, default=None, help="GiB of KV cache (default 16; host 1)")
    ap.add_argument("--layers", type=int, default=32, help="layers the weights are split into (default 32)")
    ap.add_argument("--cycles", type=int, default=3, help="cycles; the table shows medians (default 3)")
    ap.add_argument("--chunk-mib", type=int, default=None,
                    help="physical chunk size (default: the backend's; host 32, since creating the first chunk "
                         "delays the first layer)")
    add_output_options(ap, "progressive-<backend>")
    args = parse_args(ap, list(argv or []))
    on_host = args.backend == "host"
    w = args.weights if args.weights is not None else (1.0 if on_host else 8.0)
    k = args.kv if args.kv is not None else (1.0 if on_host else 16.0)
    chunk = args.chunk_mib if args.chunk_mib is not None else (32 if on_host else None)
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.cycles < 1:
        ap.error(f"--cycles must be >= 1, got {args.cycles}")
    least = min_weights_gib(args.layers, on_host)
    if not least <= w < float("inf"):
        ap.error(f"--weights must be at least {least:g} GiB with --layers {args.layers} (each layer at least as many "
                 f"rows as columns), got {w:g}; or pass fewer --layers")
    if not 0 < k < float("inf"):
        ap.error(f"--kv must be a positive number of GiB, got {k:g}")
    if chunk is not None and chunk < 1:
        ap.error(f"--chunk-mib must be >= 1, got {chunk}")
    try:
        path = output_path(args, f"progressive-{args.backend}")
    except UnisleepError as e:
        ap.exit(2, f"unisleep bench: {e}\n")
    r = run(args.backend, args.device, w, k, args.layers, args.cycles, chunk << 20 if chunk else None)
    rows = []
    for key, label, goal in LABELS:
        g = GOALS.get(goal) if goal and not on_host else None  # the goals are set for an accelerator
        v = r.get(key)
        rows.append([label, v, g, ("yes" if v <= g else "no") if g is not None and v is not None else "-"])
    print_table(f"progressive wake / background sleep on {args.backend}: {w:g} GiB weights in {args.layers} layers "
                f"+ {k:g} GiB kv_cache (seconds, medians of {args.cycles})", ["figure", "unisleep", "goal", "met"], rows)
    if "progressive_map_first_s" in r:
        print("progressive worker (medians): first chunk mapped after "
              f"{1e3 * r['progressive_map_first_s']:.2f} ms, "
              + (f"the other chunks in {1e3 * r['progressive_map_rest_s']:.2f} ms, " if "progressive_map_rest_s" in r
                 else "the others each before its first step, ")
              + "every step queued after "
              f"{1e3 * r.get('progressive_queued_s', 0.0):.2f} ms")
    print(f"KV cache freed when the background sleep returned: {r['bg_kv_freed_bytes'] / GiB:.2f} GiB of "
          f"{r['kv_bytes'] / GiB:.2f} GiB; verified (outputs and bytes exact): {r['verified']}")
    write_json(path, f"progressive-{args.backend}", r, argv)
    return 0 if r["verified"] else 1
