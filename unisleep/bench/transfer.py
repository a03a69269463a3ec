"""``unisleep bench --transfer``: weight-transfer time and throughput by path.

Paths (each a sender process and a receiver process, spawned fresh):

=================  ==========================================================================
``gloo``           host memory over gloo on 127.0.0.1, as between machines: every pair proves
                   the group secret, every bucket AES-256-GCM encrypted (``via="gloo"``)
``gloo-plain``     the same without encryption (``encrypt=False``): what the cipher costs
``host-socket``    host memory over a Unix socket (the collective path between processes of
                   one machine, its default there)
``host-ipc``       host memory shared through a memfd passed over a Unix socket
``device-ipc``     two processes on one accelerator, colocated IPC (when the platform has it)
``device-coll``    two accelerators, the platform's collective (when >= 2 devices)
``allreduce``      all-reduce bus bandwidth of the same collective, the reference for device-coll
=================  ==========================================================================

The sender streams the update from a generator (one source chunk reused under many names), so an
8 GiB update never needs 8 GiB on the sender; the receiver verifies every bucket against the
manifest and lands it in its own memory (``staged=False``, an apply callback that keeps nothing),
so memory stays at a few buckets per process whatever the size, and nothing is written to disk; the
callback copies every tensor into one receiver-owned tensor, as ``model.load_weights`` copies into
parameters.  Each size runs one warm-up update, then ``--repeat`` timed updates; the best is
reported.  By default every update makes its bucket memory and gives it back when it ends;
``--keep-buffers`` keeps it between updates (``WeightSender(keep_buffers=True)``): the note says what
making and giving back cost.  The memory the host paths need is checked before anything starts; a long
update reports its progress every 10 s; Ctrl-C stops both processes of the path.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
import traceback
from typing import Any, Optional

from ..backup import host_available_bytes
from ..cli import check_out_file, parse_args, plain
from ..errors import UnisleepError
from .common import children_leave_ctrl_c_to_us, print_table, progress, write_json

GiB = 2**30
MiB = 2**20
PATHS = ("gloo", "gloo-plain", "host-socket", "host-ipc", "device-ipc", "device-coll", "allreduce")
HOST_PATHS = ("gloo", "gloo-plain", "host-socket", "host-ipc")
#: the WeightSender arguments of each path
SENDER = {"gloo": {"path": "collective", "via": "gloo"}, "gloo-plain": {"path": "collective", "via": "gloo", "encrypt": False},
          "host-socket": {"path": "collective", "via": "socket"}, "host-ipc": {"path": "ipc"},
          "device-ipc": {"path": "ipc"}, "device-coll": {"path": "collective"}}


#: seconds between two progress lines of one update
PROGRESS_EVERY_S = 10.0


def _with_progress(gen, total: int, label: str):
    """``gen``'s items, with a progress line every PROGRESS_EVERY_S seconds (bytes yielded so far,
    what is left at that pace)."""
    t0 = last = time.perf_counter()
    done = 0
    for name, t in gen:
        yield name, t
        done += t.numel() * t.element_size()
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S and done < total:
            last = now
            left = (total - done) * (now - t0) / done
            progress(f"{label}: {done / GiB:.1f} of {total / GiB:.1f} GiB after {now - t0:.0f} s, about {left:.0f} s left")


def parse_sizes(text: str, chunk: int) -> list[int]:
    """``--sizes`` (GiB, comma-separated) -> the bytes each update moves: whole tensors of
    ``chunk`` bytes, at least one.  Raises ValueError saying which value is wrong and why."""
    out = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        try:
            gib = float(tok)
        except ValueError:
            raise ValueError(f"--sizes takes GiB numbers, comma-separated (e.g. 1,8), got {tok!r}") from None
        if not 0 < gib < float("inf"):
            raise ValueError(f"--sizes {tok}: a size must be a positive number of GiB")
        n = int(gib * GiB) // chunk
        if n < 1:
            raise ValueError(f"--sizes {tok}: smaller than one tensor of the update (--chunk-mib {chunk // MiB} = "
                             f"{chunk / GiB:g} GiB); pass at least {chunk / GiB:g}, or a smaller --chunk-mib")
        out.append(n * chunk)
    if not out:
        raise ValueError("--sizes names no size (e.g. --sizes 1,8)")
    return out


def host_path_need(chunk: int, bucket) -> int:
    """Host memory one host path needs at once, whatever the update's size: the source tensor,
    two send and two receive buffers of a bucket, and two interpreters."""
    return chunk + 6 * ((bucket or GiB) + 4096) + 1 * GiB


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, job: dict, q) -> None:
    try:
        q.put(_run_side(rank, port, job))
    except BaseException:
        q.put({"rank": rank, "error": traceback.format_exc()})


def _run_side(rank: int, port: int, job: dict) -> dict:
    import torch

    from ..platform import detect_platform
    from ..transfer import TransferGroup, WeightReceiver, WeightSender

    plat = detect_platform(job["platform"])
    dev_index = job["devices"][rank]
    if plat.is_accelerator:
        torch.accelerator.set_device_index(dev_index)
    device = torch.device(plat.torch_device(dev_index))
    if job["path"] == "allreduce":
        return _allreduce(rank, port, job, plat, device)
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, platform=plat, timeout_s=600, device=dev_index)
    chunk = job["chunk_bytes"]
    sizes = job["sizes"]
    out: dict[str, Any] = {"rank": rank, "colocated": g.colocated, "backend": g.backend, "results": []}
    if rank == 0:
        src = torch.randint(0, 2**15, (chunk // 2,), dtype=torch.int16, device=device).view(torch.bfloat16)
        tx = WeightSender(g, bucket_bytes=job["bucket_bytes"], verify=job["verify"], keep_buffers=job["keep_buffers"],
                          **SENDER[job["path"]])
        version = 0  # versions must increase across sizes too
        for size in sizes:
            n = max(1, size // chunk)
            specs = [(f"layer.{i}.weight", (chunk // 2,), "bfloat16") for i in range(n)]
            times = []
            for rep in range(job["repeat"] + 1):
                label = f"{job['path']}: {n * chunk / GiB:.2f} GiB {'warm-up' if not rep else f'run {rep}'}"
                gen = _with_progress(((name, src) for name, _, _ in specs), n * chunk, label)
                version += 1
                t0 = time.perf_counter()
                rep_ = tx.send(gen, version, specs=specs)
                dt = time.perf_counter() - t0
                if rep:
                    times.append((dt, rep_.phases))
                progress(f"{job['path']}: {n * chunk / GiB:.2f} GiB {'warm-up' if not rep else f'run {rep}'}: {dt:.3f} s")
            best = min(times, key=lambda x: x[0])
            out["results"].append({"bytes": n * chunk, "seconds": best[0], "all_seconds": [t for t, _ in times],
                                   "phases": best[1], "buckets": rep_.buckets, "bucket_bytes": tx.bucket_bytes,
                                   "cipher": tx.resolve()[2]})
    else:
        landed = {"bytes": 0}
        dst = torch.empty(chunk // 2, dtype=torch.bfloat16, device=device)  # the "model" copy lands here

        def apply(pairs):  # what load_weights does: copy each tensor into the engine's parameter
            for _, t in pairs:
                dst[: t.numel()].copy_(t.view(-1))
                landed["bytes"] += t.numel() * t.element_size()

        rx = WeightReceiver(g, apply=apply, staged=False)
        for size in sizes:
            for rep in range(job["repeat"] + 1):
                landed["bytes"] = 0
                r = rx.receive(timeout_s=600)
                out["results"].append({"bytes": landed["bytes"], "seconds": r.seconds})
    g.close()
    return out


def _allreduce(rank: int, port: int, job: dict, plat, device) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group(plat.collective_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = torch.ones(job["allreduce_bytes"] // 4, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        torch.accelerator.synchronize()
        best = float("inf")
        for _ in range(job["repeat"] + 4):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            torch.accelerator.synchronize()
            best = min(best, time.perf_counter() - t0)
        n = 2
        busbw = x.numel() * 4 / best * 2 * (n - 1) / n
        return {"rank": rank, "seconds": best, "bytes": x.numel() * 4, "busbw": busbw}
    finally:
        dist.destroy_process_group()


def _spawn(job: dict, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    ps = [ctx.Process(target=_worker, args=(r, port, job, q)) for r in (0, 1)]
    with children_leave_ctrl_c_to_us():  # Ctrl-C: this process stops them (below), they print nothing
        for p in ps:
            p.start()
    out: dict[int, dict] = {}
    stopped = False
    try:
        deadline = time.monotonic() + timeout
        while len(out) < 2:
            res = q.get(timeout=max(1.0, deadline - time.monotonic()))
            out[res["rank"]] = res
            if "error" in res:
                break
    except BaseException:  # Ctrl-C, or no answer in time: nothing more to wait for
        stopped = True
        raise
    finally:
        for p in ps:
            if stopped:
                p.terminate()
            p.join(2 if stopped else 5 if "error" in str(out) else 60)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="unisleep bench --transfer", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8", help="update sizes in GiB, comma-separated (default 1,8); each a whole "
                    "number of --chunk-mib tensors (rounded down), at least one")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    ap.add_argument("--bucket-mib", default="auto",
                    help="bucket size in MiB, or 'auto' (the default): the library's default for the path "
                         "(sized from free memory, up to 1 GiB; 4 GiB for colocated IPC on a device); "
                         "figures recorded before 2026-12-01 without this option ran with 512")
    ap.add_argument("--chunk-mib", type=int, default=256, help="tensor size in MiB in the synthetic update (default 256)")
    ap.add_argument("--repeat", type=int, default=2, help="timed updates per size after one warm-up (default 2)")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-tensor keyed digests")
    ap.add_argument("--keep-buffers", action="store_true",
                    help=("keep the bucket memory between updates (default: made per update and given back at its end, "
                          "as WeightSender does on an accelerator; on the host platform WeightSender keeps it unless told)"))
    ap.add_argument("--platform", default=None, help="platform for the device paths (default: detected)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = parse_args(ap, list(argv if argv is not None else []))

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        ap.error(f"unknown path(s) {bad}; choose from {PATHS}")
    if args.chunk_mib < 1:
        ap.error(f"--chunk-mib must be >= 1, got {args.chunk_mib}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    chunk = args.chunk_mib * MiB
    try:
        sizes = parse_sizes(args.sizes, chunk)
    except ValueError as e:
        ap.error(str(e))
    if args.bucket_mib != "auto" and not (args.bucket_mib.isdigit() and int(args.bucket_mib) > 0):
        ap.error(f"--bucket-mib takes a positive number of MiB or 'auto', got {args.bucket_mib!r}")
    bucket = None if args.bucket_mib == "auto" else int(args.bucket_mib) * MiB
    need, free = host_path_need(chunk, bucket), host_available_bytes()
    if any(p in HOST_PATHS for p in paths) and free and free < need:
        ap.exit(2, f"unisleep bench: the host paths need about {need / GiB:.1f} GiB of host memory at once (the "
                   f"source tensor, 2 send and 2 receive buffers of a bucket, two interpreters; the update streams, so "
                   f"its size adds nothing) and {free / GiB:.1f} GiB is available (MemAvailable). Pass a smaller "
                   "--bucket-mib or --chunk-mib, or --paths without the host paths.\n")
    if args.json:
        try:
            check_out_file(args.json, "--json")
        except UnisleepError as e:
            ap.exit(2, f"unisleep bench: {e}\n")

    from ..platform import detect_platform

    plat = detect_platform(args.platform)
    ndev = len(plat.devices) if plat.is_accelerator else 0
    shown = ", ".join(f"{n / GiB:g}" for n in sizes)
    moved = sum(sizes) * (args.repeat + 1)
    progress(f"platform {plat}; {ndev} device(s); sizes {shown} GiB (whole {args.chunk_mib} MiB tensors); each path "
             f"moves {moved / GiB:g} GiB (a warm-up and {args.repeat} timed update{'s' if args.repeat > 1 else ''} "
             f"per size); bucket {args.bucket_mib}{'' if bucket is None else ' MiB'}")
    rows, results = [], []
    busbw = None

    def skip(path, why):
        progress(f"{path}: skipped: {why}")
        rows.append([path, "-", None, None, None, f"skipped: {why}"])
        results.append({"path": path, "skipped": why})

    for path in paths:
        host = path in HOST_PATHS
        if not host and not plat.is_accelerator:
            skip(path, "no accelerator on this machine")
            continue
        if path in ("device-coll", "allreduce") and ndev < 2:
            skip(path, f"needs 2 devices, found {ndev}")
            continue
        devices = [0, 0] if host or path == "device-ipc" else [0, 1]
        job = {"path": path, "platform": "host" if host else plat.name, "devices": devices, "sizes": sizes,
               "chunk_bytes": chunk, "bucket_bytes": bucket, "repeat": args.repeat,
               "verify": not args.no_verify, "allreduce_bytes": 1 * GiB, "keep_buffers": args.keep_buffers}
        if host:
            free = host_available_bytes()
            if free < need:  # (checked at the start; the paths before this one may hold memory still)
                skip(path, f"needs ~{need / GiB:.1f} GiB free host memory, {free / GiB:.1f} GiB available")
                continue
        progress(f"{path}: starting two processes")
        out = _spawn(job, timeout=3600)
        err = next((o["error"] for o in out.values() if "error" in o), None)
        if err or len(out) < 2:
            why = (err or "a process did not answer").strip().splitlines()[-1]
            skip(path, f"failed: {why}")
            progress(err or "")
            continue
        if path == "allreduce":
            busbw = out[0]["busbw"]
            rows.append([path, f"{out[0]['bytes'] / GiB:.0f}", out[0]["seconds"], None, busbw / 1e9,
                         f"bus bandwidth of {plat.collective_backend} all-reduce, 2 ranks"])
            results.append({"path": path, **out[0]})
            continue
        for r in out[0]["results"]:
            gbps = r["bytes"] / r["seconds"] / 1e9
            note = f"{r['buckets']} bucket{'' if r['buckets'] == 1 else 's'} of {r['bucket_bytes'] / MiB:.0f} MiB"
            if r.get("cipher", "none") != "none":
                note += f"; {r['cipher']}"
            ph = r.get("phases") or {}
            if args.keep_buffers:
                note += "; buffers kept"
            elif "buffers" in ph:
                note += f"; buffers made {ph['buffers'] * 1e3:.1f} ms, given back {ph.get('release', 0) * 1e3:.1f} ms"
            if path == "device-ipc" and r["bytes"] >= 8 * GiB and not args.no_verify:
                note += f"; goal 8 GiB verified <= 15 ms: {'met' if r['seconds'] <= 0.015 else 'not met'}"
            rows.append([path, f"{r['bytes'] / GiB:.2f}", r["seconds"], r["bytes"] / r["seconds"] / GiB, gbps, note])
            results.append({"path": path, "backend": out[0]["backend"], "colocated": out[0]["colocated"],
                            "verify": not args.no_verify, "keep_buffers": args.keep_buffers, **r})
    clear = {res["bytes"]: res["seconds"] for res in results if res.get("path") == "gloo-plain" and "seconds" in res}
    for row, res in zip(rows, results):  # what encryption costs, beside the plain path in the same call
        if res.get("path") == "gloo" and res.get("bytes") in clear:
            cost = res["seconds"] / clear[res["bytes"]] - 1
            res["cipher_cost"] = cost
            goal = f" (goal <= 10 % at 1 GiB: {'met' if cost <= 0.10 else 'not met'})" if res["bytes"] == GiB else ""
            row[5] += f"; encryption {cost * 100:+.1f} % against gloo-plain{goal}"
    if busbw:
        for row, res in zip(rows, results):
            if res.get("path") == "device-coll" and "seconds" in res:
                frac = res["bytes"] / res["seconds"] / busbw
                res["fraction_of_allreduce_busbw"] = frac
                row[5] += f"; {frac * 100:.0f}% of all-reduce busbw (goal >= 80%)"
    print_table(f"weight transfer ({plat.name}; bucket {args.bucket_mib}{'' if bucket is None else ' MiB'}; "
                f"digests {'off' if args.no_verify else 'on'}; bucket memory "
                f"{'kept between updates' if args.keep_buffers else 'made per update'})",
                ["path", "GiB", "seconds", "GiB/s", "GB/s", "note"], rows)
    write_json(args.json, "transfer", results, ["--transfer"] + list(argv if argv is not None else []))
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main(sys.argv[1:]))
