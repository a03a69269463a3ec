"""What giving CUDA device memory back costs, per call: ``cuMemUnmap`` + ``cuMemRelease`` of the
regions a sleep discards, in vLLM's layout (32 weight tensors of 256 MiB + 16 KV tensors of
1 GiB, one region each) and in a few large regions (8 GiB + 16 GiB in 1 GiB chunks), one
region after another, all unmaps then all releases, and spread over threads; the unmaps and
the releases timed apart (``--only split``); and what a wake right after a release pays
(``--only after-release``).

    PYTHONPATH=. python3 tools/cuda_probes/release_cost.py --out result.json

Each figure is the median of ``--repeat`` rounds; every round checks with ``cuMemGetInfo`` that
the memory came back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

MiB, GiB = 1 << 20, 1 << 30
LAYOUTS = {
    "vllm (32 x 256 MiB + 16 x 1 GiB regions)": [256 * MiB] * 32 + [GiB] * 16,
    "two regions (8 GiB + 16 GiB, 1 GiB chunks)": [8 * GiB, 16 * GiB],
}


def _release_serial(drv, regions, _threads):
    for r in regions:
        r.release(drv)


def _release_phased(drv, regions, _threads):
    from unisleep.backends.cuda import cu

    cu.ensure_context(drv.device)
    chunks = [(r, c) for r in regions for c in r.chunks if c.handle is not None]
    for r, c in chunks:
        drv.unmap(r.va + c.offset, c.size)
    for _r, c in chunks:
        drv.release(c.handle)
        c.handle = None


def _release_threads(drv, regions, threads):
    from unisleep.backends.cuda import cu

    chunks = [(r, c) for r in regions for c in r.chunks if c.handle is not None]
    errors = []

    def work(part):
        try:
            cu.ensure_context(drv.device)
            for r, c in part:
                r.release_chunk(drv, c)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(chunks[i::threads],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


MODES = {"one after another": (_release_serial, 1), "unmap all, then release all": (_release_phased, 1),
         "2 threads": (_release_threads, 2), "4 threads": (_release_threads, 4)}


def run(repeat: int = 3) -> dict:
    import torch

    from unisleep.region import Region

    from unisleep.backends.cuda.driver import CudaDriver

    drv = CudaDriver(torch.cuda.current_device())
    out = {}
    for lname, layout in LAYOUTS.items():
        for mname, (fn, threads) in MODES.items():
            times, freed_ok = [], True
            for _ in range(repeat):
                regions = [Region.allocate(drv, n, drv.config.chunk_bytes) for n in layout]
                for r in regions:
                    drv.zero(r.va, r.size)  # touched, as a model's memory is
                drv.synchronize()
                free0 = drv.memory_info()[0]
                t0 = time.perf_counter()
                fn(drv, regions, threads)
                dt = time.perf_counter() - t0
                freed = drv.memory_info()[0] - free0
                freed_ok &= freed >= 0.99 * sum(layout)
                times.append(dt)
                for r in regions:
                    r.free(drv)
            key = f"{lname}: {mname}"
            out[key] = {"median_s": statistics.median(times), "min_s": min(times),
                        "chunks": sum(len(r_chunks(n, drv)) for n in layout),
                        "freed_ok": freed_ok}
            print(f"{key:75s} {1e3 * out[key]['median_s']:7.2f} ms  (chunks {out[key]['chunks']}, freed {freed_ok})",
                  flush=True)
    return out


def overlap(repeat: int = 3) -> dict:
    """Whether the driver's releases overlap with other work of the process: the keyed-digest
    check of 35 regions (what a skip-unchanged sleep runs before its copies) alone, the release
    of 16 x 1 GiB alone, and both at once (the release on a second thread)."""
    import torch

    from unisleep.keyed_hash import HashKey
    from unisleep.region import Region

    from unisleep.backends.cuda.driver import CudaDriver

    drv = CudaDriver(torch.cuda.current_device())
    checked = [Region.allocate(drv, n) for n in [256 * MiB] * 32 + [64 * MiB, 20 * MiB, 20 * MiB]]
    views = [drv.view(r.va, r.size) for r in checked]
    keys = [HashKey.new(r.size) for r in checked]
    for v in views:
        v.fill_(3)
    drv.keyed_digests(views, keys)  # keys on the device, as for a retained backup

    def check():
        drv.keyed_digests(views, keys)

    out = {}
    ts = []
    for _ in range(repeat):
        drv.synchronize()
        t0 = time.perf_counter()
        check()
        ts.append(time.perf_counter() - t0)
    out["digest check alone"] = statistics.median(ts)
    for mode in ("release alone", "both, release on a thread"):
        times = []
        for _ in range(repeat):
            kv = [Region.allocate(drv, GiB) for _ in range(16)]
            for r in kv:
                drv.zero(r.va, r.size)
            drv.synchronize()
            t0 = time.perf_counter()
            if mode == "release alone":
                drv._release_regions(kv)
            else:
                t = threading.Thread(target=drv._release_regions, args=(kv,))
                t.start()
                check()
                t.join()
            times.append(time.perf_counter() - t0)
            for r in kv:
                r.free(drv)
        out[mode] = statistics.median(times)
    for r in checked:
        r.free(drv)
    for k, v in out.items():
        print(f"overlap: {k:40s} {1e3 * v:7.2f} ms", flush=True)
    return out


def split(repeat: int = 3) -> dict:
    """Where the time of giving memory back goes: every ``cuMemUnmap`` of a layout, then every
    ``cuMemRelease`` (what ``release_behind`` leaves to its thread), each timed on its own."""
    import torch

    from unisleep.region import Region

    from unisleep.backends.cuda import cu
    from unisleep.backends.cuda.driver import CudaDriver

    drv = CudaDriver(torch.cuda.current_device())
    out = {}
    for lname, layout in LAYOUTS.items():
        unmaps, releases = [], []
        for _ in range(repeat):
            regions = [Region.allocate(drv, n, drv.config.chunk_bytes) for n in layout]
            for r in regions:
                drv.zero(r.va, r.size)
            drv.synchronize()
            chunks = [(r, c) for r in regions for c in r.chunks]
            cu.ensure_context(drv.device)
            t0 = time.perf_counter()
            for r, c in chunks:
                cu.call("cuMemUnmap", r.va + c.offset, c.size)
            t1 = time.perf_counter()
            for _r, c in chunks:
                drv.release(c.handle)
                c.handle = None
            t2 = time.perf_counter()
            unmaps.append(t1 - t0)
            releases.append(t2 - t1)
            for r in regions:
                r.free(drv)
        out[lname] = {"unmap_s": statistics.median(unmaps), "release_s": statistics.median(releases)}
        print(f"split: {lname:45s} unmap all {1e3 * out[lname]['unmap_s']:6.2f} ms, "
              f"then release all {1e3 * out[lname]['release_s']:6.2f} ms", flush=True)
    return out


def after_release(repeat: int = 3) -> dict:
    """What a wake right after a release pays: 8 GiB created, mapped and copied in from pinned
    host memory once the driver has settled, and 0, 30 and 100 ms after releasing 24 GiB."""
    import torch

    from unisleep.region import Region

    from unisleep.backends.cuda.driver import CudaDriver

    drv = CudaDriver(torch.cuda.current_device())
    host = torch.empty(8 * GiB, dtype=torch.uint8).pin_memory()
    host.fill_(3)

    def wait_idle():
        last, same, t0 = drv.memory_info()[0], 0, time.monotonic()
        while same < 3 and time.monotonic() - t0 < 2:
            time.sleep(0.02)
            f = drv.memory_info()[0]
            same, last = (same + 1 if f == last else 0), f

    out = {}
    for mode, gap in (("settled", None), ("right after releasing 24 GiB", 0.0), ("30 ms after", 0.03),
                      ("100 ms after", 0.1)):
        maps, copies = [], []
        for _ in range(repeat):
            wait_idle()
            if gap is not None:
                big = [Region.allocate(drv, n, drv.config.chunk_bytes) for n in (8 * GiB, 16 * GiB)]
                for b in big:
                    drv.zero(b.va, b.size)
                drv.synchronize()
                for b in big:
                    b.free(drv)
                time.sleep(gap)
            t0 = time.perf_counter()
            r = Region.allocate(drv, 8 * GiB, drv.config.chunk_bytes)
            t1 = time.perf_counter()
            drv.view(r.va, r.size).copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            maps.append(t1 - t0)
            copies.append(t2 - t1)
            r.free(drv)
        out[mode] = {"create_map_s": statistics.median(maps), "copy_s": statistics.median(copies)}
        print(f"after release: {mode:30s} create+map {1e3 * out[mode]['create_map_s']:6.2f} ms, "
              f"copy 8 GiB in {1e3 * out[mode]['copy_s']:7.2f} ms", flush=True)
    return out


def r_chunks(n, drv):
    from unisleep.region import chunk_sizes, round_up

    return chunk_sizes(round_up(n, drv.granularity()), drv.config.chunk_bytes, drv.granularity())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--only", choices=["layouts", "overlap", "split", "after-release"], action="append",
                    help="run only these parts (repeatable); default: all")
    args = ap.parse_args(argv)
    import torch

    parts = args.only or ["layouts", "overlap", "split", "after-release"]
    res = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if "layouts" in parts:
        res["figures"] = run(args.repeat)
    if "overlap" in parts:
        res["overlap_s"] = overlap(args.repeat)
    if "split" in parts:
        res["split"] = split(args.repeat)
    if "after-release" in parts:
        res["after_release"] = after_release(args.repeat)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
