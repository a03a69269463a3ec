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
parameters.  ``--staged`` makes the receiver hold the whole verified update before it applies it
(``staged=True``), so both can be compared in one call.  Each size runs one warm-up update, then
``--repeat`` timed updates; the best is reported.

Memory: a second table gives, per path and size, each side's peak memory above its own level
before the update (the largest over the timed updates; :mod:`unisleep.bench.peak_memory`): host
resident memory, its ``buffer_bytes()`` (bucket buffers), and on a device the allocator's peak;
the largest size's row says whether every figure stayed within one bucket of the smallest size's
(a flat line: memory that does not grow with the model).  Shared memory (``host-ipc``'s memfd
buckets) counts in both processes that touch it.  With two or fewer buckets per update the bucket
count itself grows with the size, so choose ``--bucket-mib`` well below the smallest size to see
the line.

Cost per tensor (``--tensors N --chunk-kib K``): after the sizes, an update of N tensors of K KiB
and one of the same bytes in as few tensors as ``--chunk-mib`` allows, alternating in the same
processes; the row gives the seconds per tensor beyond the byte time, (many − few) / (N − few).  By default every update makes its bucket memory and gives it back when it ends;
``--keep-buffers`` keeps it between updates (``WeightSender(keep_buffers=True)``): the note says what
making and giving back cost.  The memory the host paths need is checked before anything starts; a long
update reports its progress every 10 s; Ctrl-C stops both processes of the path.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from typing import Any, Optional

from ..backup import host_available_bytes
from ..cli import CommandParser, parse_args, plain
from ..errors import UnisleepError
from .common import add_output_options, children_leave_ctrl_c_to_us, output_path, print_table, progress, write_json

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


def host_path_need(chunk: int, bucket, staged_bytes: int = 0) -> int:
    """Host memory one host path needs at once: the source tensor, two send and two receive
    buffers of a bucket, and two interpreters — whatever the update's size, unless the receiver
    stages it (``staged_bytes``: the largest update, held whole on the receiver)."""
    return chunk + 6 * ((bucket or GiB) + 4096) + 1 * GiB + staged_bytes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, job: dict, q) -> None:
    try:
        q.put(_run_side(rank, port, job))
    except BaseException:  # sent to the parent, which reports the traceback
        q.put({"rank": rank, "error": traceback.format_exc()})


def _run_side(rank: int, port: int, job: dict) -> dict:
    import torch

    from ..platform import detect_platform
    from ..transfer import TransferGroup

    plat = detect_platform(job["platform"])
    dev_index = job["devices"][rank]
    if plat.is_accelerator:
        torch.accelerator.set_device_index(dev_index)
    device = torch.device(plat.torch_device(dev_index))
    if job["path"] == "allreduce":
        return _allreduce(rank, port, job, plat, device)
    g = TransferGroup.create(f"tcp://127.0.0.1:{port}", rank, 2, platform=plat, timeout_s=600, device=dev_index)
    out: dict[str, Any] = {"rank": rank, "colocated": g.colocated, "backend": g.backend}
    try:
        out.update(_send_all(g, job, device) if rank == 0 else _receive_all(g, job, device))
    finally:
        g.close()
    return out


def _updates(job: dict):
    """What each side runs, in order: ``(kind, key, label, tensor specs, timed)`` — every size
    (a warm-up, then ``repeat`` timed updates), then with ``tensors`` the per-tensor pair (the
    same bytes as ``tensors`` tensors and as few, alternating after one warm-up of each).
    ``warm_up=False`` in the job: no warm-up of the sizes (a test that measures memory, not time)."""
    chunk = job["chunk_bytes"]
    first = 0 if job.get("warm_up", True) else 1
    for size in job["sizes"]:
        n = max(1, size // chunk)
        specs = [(f"layer.{i}.weight", (chunk // 2,), "bfloat16") for i in range(n)]
        for rep in range(first, job["repeat"] + 1):
            yield "size", n * chunk, f"{n * chunk / GiB:.2f} GiB {'warm-up' if not rep else f'run {rep}'}", specs, rep > 0
    many, each = job.get("tensors") or 0, job.get("tensor_bytes") or 0
    if many:
        total = many * each
        few_each = min(chunk, total) // 2 * 2
        few = max(1, total // few_each)
        kinds = {"many": [(f"small.{i}.weight", (each // 2,), "bfloat16") for i in range(many)],
                 "few": [(f"block.{i}.weight", (few_each // 2,), "bfloat16") for i in range(few)]}
        for rep in range(job["repeat"] + 1):
            for kind in ("few", "many"):
                n_t = len(kinds[kind])
                yield (kind, n_t, f"{n_t} tensor{'s' if n_t > 1 else ''} of {int(kinds[kind][0][1][0]) * 2 / 1024:g} KiB "
                       f"{'warm-up' if not rep else f'run {rep}'}", kinds[kind], rep > 0)


def _send_all(g, job: dict, device) -> dict:
    import torch

    from ..transfer import WeightSender
    from .peak_memory import PeakMemory, peak_of

    chunk = job["chunk_bytes"]
    src = torch.randint(0, 2**15, (chunk // 2,), dtype=torch.int16, device=device).view(torch.bfloat16)
    tx = WeightSender(g, bucket_bytes=job["bucket_bytes"], verify=job["verify"], keep_buffers=job["keep_buffers"],
                      **SENDER[job["path"]])
    runs: dict[tuple, list] = {}
    version = 0  # versions must increase across sizes too
    for kind, key, label, specs, timed in _updates(job):
        label = f"{job['path']}: {label}"
        nbytes = sum(int(s[1][0]) * 2 for s in specs)
        gen = _with_progress(((name, src[: shape[0]]) for name, shape, _ in specs), nbytes, label)
        version += 1
        with PeakMemory(device=device, stores=[tx.buffer_bytes]) as pm:
            t0 = time.perf_counter()
            rep_ = tx.send(gen, version, specs=specs)
            dt = time.perf_counter() - t0
        progress(f"{label}: {dt:.3f} s")
        if timed:
            runs.setdefault((kind, key), []).append((dt, rep_, pm.result))
    results, per_tensor = [], None
    for (kind, key), rs in runs.items():
        dt, rep_, _ = min(rs, key=lambda x: x[0])
        entry = {"bytes": rep_.bytes, "seconds": dt, "all_seconds": [r[0] for r in rs], "phases": rep_.phases,
                 "buckets": rep_.buckets, "bucket_bytes": tx.bucket_bytes, "cipher": tx.resolve()[2],
                 "sender_memory": peak_of([r[2] for r in rs]), "all_sender_memory": [r[2] for r in rs]}
        if kind == "size":
            results.append(entry)
        else:
            per_tensor = per_tensor or {}
            per_tensor[kind] = {"tensors": key, **entry}
    return {"results": results, "per_tensor": per_tensor}


def _receive_all(g, job: dict, device) -> dict:
    import torch

    from ..transfer import WeightReceiver
    from .peak_memory import PeakMemory, peak_of

    chunk = job["chunk_bytes"]
    landed = {"bytes": 0}
    # the "model" copy lands here: made and touched before any update, as an engine's weights are
    dst = torch.zeros(chunk // 2, dtype=torch.bfloat16, device=device)

    def apply(pairs):  # what load_weights does: copy each tensor into the engine's parameter
        for _, t in pairs:
            dst[: t.numel()].copy_(t.view(-1))
            landed["bytes"] += t.numel() * t.element_size()

    staged = job.get("staged", False)
    rx = WeightReceiver(g, apply=apply, **({} if staged is None else {"staged": staged}))
    runs: dict[tuple, list] = {}
    for kind, key, _label, _specs, timed in _updates(job):
        landed["bytes"] = 0
        with PeakMemory(device=device, stores=[rx.buffer_bytes]) as pm:
            r = rx.receive(timeout_s=600)
        if timed:
            runs.setdefault((kind, key), []).append((r.seconds, landed["bytes"], pm.result))
    results, per_tensor = [], {}
    for (kind, key), rs in runs.items():
        entry = {"bytes": rs[-1][1], "seconds": min(x[0] for x in rs), "receiver_memory": peak_of([x[2] for x in rs]),
                 "all_receiver_memory": [x[2] for x in rs]}
        if kind == "size":
            results.append(entry)
        else:
            per_tensor[kind] = entry
    return {"results": results, "per_tensor": per_tensor or None, "staged": rx.staged}


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


def per_tensor_result(sent: dict, received: dict) -> dict:
    """The per-tensor figure from the two sides' ``per_tensor`` entries (``many`` and ``few``): seconds
    per tensor beyond the byte time, ``(many - few) / (tensors of many - tensors of few)``, each the
    best of its timed updates, with both sides' memory."""
    many, few = sent["many"], sent["few"]
    extra = (many["seconds"] - few["seconds"]) / max(1, many["tensors"] - few["tensors"])
    for kind in ("many", "few"):
        if kind in received:
            sent[kind] = {**sent[kind], "receiver_memory": received[kind]["receiver_memory"]}
    return {"tensors": many["tensors"], "tensor_bytes": many["bytes"] // max(1, many["tensors"]),
            "bytes": many["bytes"], "per_tensor_s": extra, "many": sent["many"], "few": sent["few"]}


#: (side, figure) pairs the memory table shows, in its column order
MEMORY_FIGURES = (("sender_memory", "host_extra_bytes"), ("sender_memory", "store_peak_bytes"),
                  ("sender_memory", "device_extra_bytes"), ("receiver_memory", "host_extra_bytes"),
                  ("receiver_memory", "store_peak_bytes"), ("receiver_memory", "device_extra_bytes"))


#: what the memory table calls each figure
FIGURE_NAMES = {"host_extra_bytes": "host", "store_peak_bytes": "buffers", "device_extra_bytes": "device"}


def memory_growth(entries: list) -> dict:
    """How much each side's peak extra memory grows from the smallest update of one path to the
    largest: ``{(side, figure): bytes}`` (largest minus smallest; negative when it shrank), for the
    figures both ends measured.  ``entries``: that path's size results (``bytes``, ``sender_memory``,
    ``receiver_memory``)."""
    if len(entries) < 2:
        return {}
    lo, hi = min(entries, key=lambda e: e["bytes"]), max(entries, key=lambda e: e["bytes"])
    out = {}
    for side, fig in MEMORY_FIGURES:
        a, b = (lo.get(side) or {}).get(fig), (hi.get(side) or {}).get(fig)
        if a is not None and b is not None:
            out[(side, fig)] = b - a
    return out


def memory_rows(results: list) -> list:
    """The memory table: one row per path and size; the largest size's note says whether every
    side's memory stayed flat — grew by at most one bucket from the smallest size to the largest."""
    def mib(v):
        return "-" if v is None else f"{v / MiB:.0f}"

    rows = []
    by_path: dict[str, list] = {}
    for res in results:
        if res.get("kind") == "size":
            by_path.setdefault(res["path"], []).append(res)
    for path, entries in by_path.items():
        growth = memory_growth(entries)
        biggest = max(entries, key=lambda e: e["bytes"])
        for e in entries:
            cells = [mib((e.get(side) or {}).get(fig)) for side, fig in MEMORY_FIGURES]
            note = ""
            if e is biggest and growth:
                worst = max(growth.items(), key=lambda kv: kv[1])
                flat = worst[1] <= e["bucket_bytes"]
                note = (f"flat within one bucket ({e['bucket_bytes'] / MiB:.0f} MiB) from {min(x['bytes'] for x in entries) / GiB:.2f} "
                        f"GiB: {'yes' if flat else 'no'}; most growth {worst[1] / MiB:+.0f} MiB "
                        f"({worst[0][0].split('_')[0]} {FIGURE_NAMES[worst[0][1]]})")
            rows.append([path, f"{e['bytes'] / GiB:.2f}", *cells, note])
        for e in (r for r in results if r.get("kind") == "per_tensor" and r["path"] == path):
            m = e["many"]
            rows.append([path, f"{m['bytes'] / GiB:.4f}", *[mib((m.get(side) or {}).get(fig)) for side, fig in MEMORY_FIGURES],
                         f"{m['tensors']} tensors of {e['tensor_bytes'] // 1024} KiB"])
    return rows


def main(argv: Optional[list] = None) -> int:
    ap = CommandParser(prog="unisleep bench --transfer", description=plain(__doc__))
    ap.add_argument("--sizes", default="1,8", help="update sizes in GiB, comma-separated (default 1,8); each a whole "
                    "number of --chunk-mib tensors (rounded down), at least one")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    ap.add_argument("--bucket-mib", default="auto",
                    help="bucket size in MiB, or 'auto' (the default): the library's default for the path "
                         "(sized from free memory, up to 1 GiB); "
                         "figures recorded before 2026-12-01 without this option ran with 512")
    ap.add_argument("--chunk-mib", type=int, default=256, help="tensor size in MiB in the synthetic update (default 256)")
    ap.add_argument("--repeat", type=int, default=2, help="timed updates per size after one warm-up (default 2)")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-tensor keyed digests")
    ap.add_argument("--keep-buffers", action="store_true",
                    help=("keep the bucket memory between updates (default: made per update and given back at its end, "
                          "as WeightSender does on an accelerator; on the host platform WeightSender keeps it unless told)"))
    ap.add_argument("--staged", action="store_true",
                    help="the receiver holds every verified bucket until the whole update is good, then applies it "
                         "(WeightReceiver(staged=True): memory grows with the model); default: each verified bucket is "
                         "applied as it comes (staged=False)")
    ap.add_argument("--tensors", type=int, default=0,
                    help="also measure the cost per tensor: an update of this many tensors of --chunk-kib KiB beside "
                         "the same bytes in few tensors, in the same processes (e.g. --tensors 2000 --chunk-kib 4); "
                         "default 0: not measured")
    ap.add_argument("--chunk-kib", type=int, default=4, help="tensor size in KiB of the --tensors update (default 4)")
    ap.add_argument("--platform", default=None, help="platform for the device paths (default: detected)")
    add_output_options(ap, "transfer")
    args = parse_args(ap, list(argv if argv is not None else []))

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        ap.error(f"unknown path(s) {bad}; choose from {PATHS}")
    if args.chunk_mib < 1:
        ap.error(f"--chunk-mib must be >= 1, got {args.chunk_mib}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.tensors < 0:
        ap.error(f"--tensors must be >= 0, got {args.tensors}")
    if args.chunk_kib < 1:
        ap.error(f"--chunk-kib must be >= 1, got {args.chunk_kib}")
    chunk = args.chunk_mib * MiB
    if args.tensors and args.tensors * args.chunk_kib * 1024 > 4 * GiB:
        ap.error(f"--tensors {args.tensors} of --chunk-kib {args.chunk_kib} is more than 4 GiB; the per-tensor "
                 "update is meant to be small (e.g. --tensors 2000 --chunk-kib 4)")
    try:
        sizes = parse_sizes(args.sizes, chunk)
    except ValueError as e:
        ap.error(str(e))
    if args.bucket_mib != "auto" and not (args.bucket_mib.isdigit() and int(args.bucket_mib) > 0):
        ap.error(f"--bucket-mib takes a positive number of MiB or 'auto', got {args.bucket_mib!r}")
    bucket = None if args.bucket_mib == "auto" else int(args.bucket_mib) * MiB
    need, free = host_path_need(chunk, bucket, max(sizes) if args.staged else 0), host_available_bytes()
    if any(p in HOST_PATHS for p in paths) and free and free < need:
        ap.exit(2, f"unisleep bench: the host paths need about {need / GiB:.1f} GiB of host memory at once (the "
                   f"source tensor, 2 send and 2 receive buffers of a bucket, two interpreters"
                   f"{', and with --staged the whole update on the receiver' if args.staged else '; the update streams, so its size adds nothing'}) and {free / GiB:.1f} GiB is available (MemAvailable). Pass a smaller "
                   f"--bucket-mib or --chunk-mib{', smaller --sizes' if args.staged else ''}, or --paths without the host paths.\n")
    try:
        json_path = output_path(args, "transfer")
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
               "verify": not args.no_verify, "allreduce_bytes": 1 * GiB, "keep_buffers": args.keep_buffers,
               "staged": args.staged, "tensors": args.tensors, "tensor_bytes": args.chunk_kib * 1024}
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
        received = out[1]["results"]
        for i, r in enumerate(out[0]["results"]):
            r = {**r, "receiver_memory": received[i]["receiver_memory"] if i < len(received) else None,
                 "all_receiver_memory": received[i]["all_receiver_memory"] if i < len(received) else []}
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
            results.append({"path": path, "kind": "size", "backend": out[0]["backend"], "colocated": out[0]["colocated"],
                            "verify": not args.no_verify, "keep_buffers": args.keep_buffers, "staged": out[1]["staged"], **r})
        if out[0].get("per_tensor"):
            res = per_tensor_result(out[0]["per_tensor"], out[1].get("per_tensor") or {})
            many, few = res["many"], res["few"]
            note = (f"{many['tensors']} tensors of {args.chunk_kib} KiB: {many['seconds'] * 1e3:.1f} ms; the same bytes in "
                    f"{few['tensors']} tensor{'' if few['tensors'] == 1 else 's'}: {few['seconds'] * 1e3:.1f} ms; "
                    f"{res['per_tensor_s'] * 1e6:.0f} us per tensor beyond the byte time")
            if path in HOST_PATHS:
                note += f" (goal <= 50 us: {'met' if res['per_tensor_s'] <= 50e-6 else 'not met'})"
            rows.append([path, f"{many['bytes'] / GiB:.4f}", many["seconds"], many["bytes"] / many["seconds"] / GiB,
                         many["bytes"] / many["seconds"] / 1e9, note])
            results.append({"path": path, "kind": "per_tensor", "backend": out[0]["backend"],
                            "verify": not args.no_verify, "staged": out[1]["staged"], **res})
    clear = {res["bytes"]: res["seconds"] for res in results if res.get("path") == "gloo-plain" and res.get("kind") == "size"}
    for row, res in zip(rows, results):  # what encryption costs, beside the plain path in the same call
        if res.get("path") == "gloo" and res.get("kind") == "size" and res.get("bytes") in clear:
            cost = res["seconds"] / clear[res["bytes"]] - 1
            res["cipher_cost"] = cost
            goal = f" (goal <= 10 % at 1 GiB: {'met' if cost <= 0.10 else 'not met'})" if res["bytes"] == GiB else ""
            row[5] += f"; encryption {cost * 100:+.1f} % against gloo-plain{goal}"
    if busbw:
        for row, res in zip(rows, results):
            if res.get("path") == "device-coll" and res.get("kind") == "size":
                frac = res["bytes"] / res["seconds"] / busbw
                res["fraction_of_allreduce_busbw"] = frac
                row[5] += f"; {frac * 100:.0f}% of all-reduce busbw (goal >= 80%)"
    print_table(f"weight transfer ({plat.name}; bucket {args.bucket_mib}{'' if bucket is None else ' MiB'}; "
                f"digests {'off' if args.no_verify else 'on'}; bucket memory "
                f"{'kept between updates' if args.keep_buffers else 'made per update'})",
                ["path", "GiB", "seconds", "GiB/s", "GB/s", "note"], rows)
    mem = memory_rows(results)
    if mem:
        print_table(f"memory per update: the peak above each process's level before it, MiB (host: resident memory; "
                    f"buffers: the side's buffer_bytes(); device: the allocator's peak; receiver "
                    f"{'staged' if args.staged else 'streaming'})",
                    ["path", "GiB", "sender host", "buffers", "device", "receiver host", "buffers", "device", "note"], mem)
    write_json(json_path, "transfer", results, ["--transfer"] + list(argv if argv is not None else []))
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main(sys.argv[1:]))
