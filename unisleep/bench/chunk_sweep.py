"""``unisleep bench --chunk-sweep``: what the chunked mapping policy costs, by chunk size.

Runs the shared Region/chunk policy (unisleep/region.py) on this platform's driver — host
memfd/mmap here, cuMem on an NVIDIA GPU, HIP on ROCm — and times, for each chunk size:

* **map**: reserve + create one physical handle per chunk + map each + grant access (a wake);
* **unmap**: unmap + release every chunk (a sleep), then the address is freed.

ROCm users tune ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` (MB) with it: larger chunks map faster and
use fewer handles (one file descriptor each), too large ones fail to find contiguous memory.
Examples::

    unisleep bench --chunk-sweep                                # host: 1 GiB
    unisleep bench --chunk-sweep --total 8GiB --json out/chunk_sweep.json   # on a GPU
    unisleep bench --chunk-sweep --chunks 2,64,256,one --repeat 5

Progress goes to stderr; the table to stdout; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from typing import Optional, Sequence

from ..cli import CommandParser, parse_args, plain
from ..errors import UnisleepError
from . import common

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CHUNKS = "2,8,32,64,128,256,1024,one"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": MiB, "mib": MiB, "mb": MiB,
          "g": GiB, "gib": GiB, "gb": GiB}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB, 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_chunks(text: str) -> list[Optional[int]]:
    """MiB values; ``one`` (or 0) = the whole total as one piece."""
    out: list[Optional[int]] = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        if tok in ("one", "0", "whole", "none"):
            out.append(None)
            continue
        try:
            mib = float(tok)
        except ValueError:
            raise argparse.ArgumentTypeError(f"chunk sizes are MiB numbers or 'one', got {tok!r}") from None
        if mib <= 0:
            raise argparse.ArgumentTypeError(f"chunk size must be > 0, got {tok!r}")
        out.append(int(mib * MiB))
    if not out:
        raise argparse.ArgumentTypeError("no chunk sizes given")
    return out


def sweep_one(driver, total: int, chunk: Optional[int], repeat: int) -> dict:
    from ..region import Region

    maps, unmaps, nchunks = [], [], 0
    for _ in range(repeat):
        driver.synchronize()
        t0 = time.perf_counter()
        region = Region.allocate(driver, total, chunk)
        driver.synchronize()
        t1 = time.perf_counter()
        try:
            nchunks = len(region.chunks)
            region.release(driver)
            driver.synchronize()
            t2 = time.perf_counter()
        finally:
            region.free(driver)
        maps.append(t1 - t0)
        unmaps.append(t2 - t1)
    m, u = statistics.median(maps), statistics.median(unmaps)
    size = total if chunk is None else min(chunk, total)
    return {
        "chunk_bytes": None if chunk is None else chunk,
        "chunk_label": "one piece" if chunk is None else f"{chunk / MiB:g} MiB",
        "effective_chunk_bytes": size,
        "chunks": nchunks,
        "map_s": m,
        "unmap_s": u,
        "map_gbps": total / m / 1e9 if m > 0 else None,
        "unmap_gbps": total / u / 1e9 if u > 0 else None,
        "map_us_per_chunk": m / max(nchunks, 1) * 1e6,
        "unmap_us_per_chunk": u / max(nchunks, 1) * 1e6,
        "map_all_s": maps,
        "unmap_all_s": unmaps,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = CommandParser(prog="unisleep bench --chunk-sweep", description=plain(__doc__))
    ap.add_argument("--platform", default=None, help="platform name (default: detected)")
    ap.add_argument("--device", type=int, default=0, help="the device index (default 0)")
    ap.add_argument("--total", type=parse_bytes, default=None,
                    help="bytes mapped per measurement (default 1GiB on host, 8GiB on an accelerator)")
    ap.add_argument("--chunks", type=parse_chunks, default=parse_chunks(DEFAULT_CHUNKS),
                    help=f"chunk sizes in MiB, 'one' = a single piece (default {DEFAULT_CHUNKS})")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per chunk size (median shown)")
    common.add_output_options(ap, "chunk-sweep")
    args = parse_args(ap, list(argv) if argv is not None else sys.argv[1:])
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    try:
        json_path = common.output_path(args, "chunk-sweep")
    except UnisleepError as e:
        ap.exit(2, f"unisleep bench: {e}\n")

    from ..platform import detect_platform
    from ..platform import load_driver

    plat = detect_platform(args.platform)
    driver = load_driver(plat, device=args.device)
    try:
        total = args.total or (GiB if not plat.is_accelerator else 8 * GiB)
        gran = driver.granularity()
        total = (total + gran - 1) // gran * gran
        free, dev_total = driver.memory_info()
        if total > 0.8 * free:
            common.progress(f"{total / GiB:.2f} GiB asked, {free / GiB:.2f} GiB free: use --total smaller")
            return 2
        common.progress(f"{driver.name} driver, device {args.device}: {total / GiB:.2f} GiB per measurement, "
                        f"granularity {gran} B, {args.repeat} repeat(s)")
        results = []
        for chunk in args.chunks:
            label = "one piece" if chunk is None else f"{chunk / MiB:g} MiB"
            common.progress(f"chunk {label} ...")
            try:
                results.append(sweep_one(driver, total, chunk, args.repeat))
            except Exception as e:  # a chunk size the device refuses is a result too
                common.progress(f"chunk {label} failed: {e}")
                results.append({"chunk_bytes": chunk, "chunk_label": label, "error": str(e)})
        rows = []
        for r in results:
            if "error" in r:
                rows.append([r["chunk_label"], None, None, None, None, None, r["error"][:60]])
            else:
                rows.append([r["chunk_label"], r["chunks"], r["map_s"] * 1e3, r["unmap_s"] * 1e3,
                             r["map_us_per_chunk"], r["map_gbps"], ""])
        common.print_table(
            f"chunked mapping on {driver.name} (device {args.device}), {total / GiB:.2f} GiB, median of {args.repeat}",
            ["chunk", "handles", "map ms", "unmap ms", "map us/chunk", "map GB/s", "note"],
            rows,
        )
        common.write_json(json_path, "chunk_sweep", {
            "platform": plat.name, "reason": plat.reason, "driver": driver.name, "device": args.device,
            "total_bytes": total, "granularity": gran, "device_free_bytes": free, "device_total_bytes": dev_total,
            "repeat": args.repeat, "rows": results,
        }, argv=["--chunk-sweep"] + list(argv or []))
        return 0 if all("error" not in r for r in results) else 1
    finally:
        driver.close()
