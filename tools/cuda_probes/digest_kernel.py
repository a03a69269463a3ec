"""Bandwidth of the keyed NH level-1 kernel against the HBM read bandwidth measured in the same
run (a torch reduction over the same bytes), and the cost of a whole keyed digest, on the CUDA
backend's kernel (``unisleep.backends.cuda.checksum``).

    PYTHONPATH=. python3 tools/cuda_probes/digest_kernel.py --gib 8 --out result.json [--sleep]

``--sleep`` adds the level-1 sleep figures of 8 GiB weights + 16 GiB KV through the public API
(steady and unchanged-weights sleeps, discards released during or after the copies).

Every kernel variant is checked equal to ``keyed_hash.nh_level`` before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _time(fn, iters=10, warm=3):
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def sleep_figures(weights_gib: float = 8, kv_gib: float = 16, cycles: int = 4) -> dict:
    """Level-1 sleep/wake of ``weights`` (backed up) + ``kv`` (discarded) through the public API:
    steady (weights changed, copied) and unchanged (skipped by the keyed digest) sleeps, with the
    discarded memory released during the copies (default) and after them (strict order)."""
    import torch

    from unisleep import MemoryLifecycle

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, r

    out: dict = {"weights_gib": weights_gib, "kv_gib": kv_gib}
    lc = MemoryLifecycle()  # the GPU the platform detection finds
    try:
        w = lc.empty((int(weights_gib * (1 << 30)),), torch.uint8, tag="weights")
        kv = lc.empty((int(kv_gib * (1 << 30)),), torch.uint8, tag="kv_cache")
        w.view(torch.int32).random_()
        kv.fill_(1)
        ref = w.clone()
        lc.prepare_backup(background=False)
        out["first_sleep_s"] = timed(lambda: lc.sleep(1))[0]
        lc.wake_up()
        ok = bool(torch.equal(w, ref))
        for early in (True, False):
            lc.driver.configure(release_discards_during_copies=early)
            sl, wk, un, copied_unchanged = [], [], [], []
            for _ in range(cycles):
                w[:4096].add_(1)
                ref[:4096].add_(1)
                sl.append(timed(lambda: lc.sleep(1))[0])
                wk.append(timed(lambda: lc.wake_up())[0])
                ok = ok and bool(torch.equal(w, ref))
            for _ in range(cycles):
                t, rep = timed(lambda: lc.sleep(1))
                un.append(t)
                copied_unchanged.append(rep.bytes_copied)
                lc.wake_up()
                ok = ok and bool(torch.equal(w, ref))
            name = "discards_during_copies" if early else "discards_after_copies"
            out[name] = {
                "steady_sleep_s": statistics.median(sl),
                "steady_wake_s": statistics.median(wk),
                "unchanged_sleep_s": statistics.median(un),
                "unchanged_bytes_copied": copied_unchanged,
                "all_sleep_s": sl,
                "all_unchanged_s": un,
            }
            print(name, json.dumps(out[name]), flush=True)
        lc.driver.configure(release_discards_during_copies=True)
        out["verified"] = ok
    finally:
        lc.close()
    return out


def main(argv=None) -> int:
    import torch

    from unisleep import keyed_hash as kh

    from unisleep.backends.cuda import checksum as cs

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sleep", action="store_true", help="also the level-1 sleep figures (8 + 16 GiB)")
    ap.add_argument(
        "--sweep",
        default="pairs:1x4,pairs:2x4,pairs:2x8,pairs:4x4,pairs:4x8,pairs:8x8,pairs:8x16,pairs:16x16,"
        "split:2x8,split:4x8,split:8x16",
    )
    args = ap.parse_args(argv)
    dev = torch.device(0)  # the first GPU
    nbytes = int(args.gib * (1 << 30))
    x = torch.empty(nbytes // 4, dtype=torch.int32, device=dev).random_()
    res: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": nbytes,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    # HBM read references over the same bytes
    ref = {
        "sum_int32": _time(lambda: x.sum()),
        "sum_f32": _time(lambda: x.view(torch.float32).sum()),
        "amax_int32": _time(lambda: x.amax()),
    }
    y = torch.empty_like(x)
    ref["copy_d2d_rw"] = _time(lambda: y.copy_(x))
    del y
    res["reference_s"] = ref
    res["hbm_read_GBps"] = {k: nbytes / v / 1e9 for k, v in ref.items() if k != "copy_d2d_rw"}
    res["hbm_read_best_GBps"] = max(res["hbm_read_GBps"].values())
    res["copy_d2d_GBps_read_plus_write"] = 2 * nbytes / ref["copy_d2d_rw"] / 1e9
    key = kh.HashKey.new()
    k0 = key.level_tensor(0, dev)
    probe = x[: (64 << 20) // 4 + 12345]
    want = kh.nh_level(probe, k0)
    variants = []
    for spec in args.sweep.split(","):
        kind, gw = spec.split(":")
        g, wps = (int(v) for v in gw.split("x"))
        row = {"kind": kind, "blocks_per_program": g, "num_warps": wps}
        try:
            row["equal_to_nh_level"] = bool(torch.equal(cs.nh_level1(probe, k0, g, wps, kind), want))
            t = _time(lambda: cs.nh_level1(x, k0, g, wps, kind))
            row["s"] = t
            row["GBps"] = nbytes / t / 1e9
            row["fraction_of_hbm_read"] = row["GBps"] / res["hbm_read_best_GBps"]
        except Exception as e:  # a variant that does not compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        variants.append(row)
        print(json.dumps(row), flush=True)
    res["variants"] = variants
    # the default variant, a whole digest (all levels, host sync), and the torch-ops path
    t = _time(lambda: cs.nh_level1(x, k0))
    res["default"] = {
        "kind": cs.KIND,
        "blocks_per_program": cs.BLOCKS_PER_PROGRAM,
        "num_warps": cs.NUM_WARPS,
        "s": t,
        "GBps": nbytes / t / 1e9,
        "fraction_of_hbm_read": nbytes / t / 1e9 / res["hbm_read_best_GBps"],
    }
    u8 = x.view(torch.uint8)
    res["digest_all_levels_s"] = _time(lambda: kh.digest(u8, key), iters=5)
    res["digest_torch_ops_s"] = _time(lambda: kh.digest(u8, key, level1=kh.nh_level), iters=3, warm=1)
    # one compiled kernel serves every size (the warm-up's)
    sizes = [1, 2047, 2048, 2049, 4096 * 7 + 3, (1 << 20) + 1, 1 << 24]
    ok = all(torch.equal(cs.nh_level1(x[:n], k0), kh.nh_level(x[:n], k0)) for n in sizes)
    kern = cs._triton_kernel()
    try:  # compiled specialisations of the default kernel: the sweep's configs of its kind + the default
        ncomp = sum(len(c[0]) for c in kern.device_caches.values())
    except Exception:
        ncomp = None
    res["sizes_equal"] = ok
    res["default_kind_compiled_specialisations"] = ncomp
    res["default_kind_configs_used"] = len(
        {(v["blocks_per_program"], v["num_warps"]) for v in variants if v["kind"] == cs.KIND}
        | {(cs.BLOCKS_PER_PROGRAM, cs.NUM_WARPS)}
    )
    del x, u8, probe
    torch.cuda.empty_cache()
    if args.sleep:
        res["sleep"] = sleep_figures()
    print(json.dumps({k: v for k, v in res.items() if k != "variants"}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
