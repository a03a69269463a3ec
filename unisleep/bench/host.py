"""``unisleep bench`` (host): sleep/wake throughput of the host backend beside its limits,
all measured in the same run on the same bytes and the same filesystem.

=============================  =====================================================  ===========
ours                           limit                                                  goal
=============================  =====================================================  ===========
level-1 sleep (backup+free)    write the same bytes to a file in the spill directory  >= 80 %
wake from level 1 (restore)    read that file back into fresh memory                  >= 90 %
level-2 sleep (free only)      kernel: munmap + close of a touched memfd, same size   <= 5 ms
wake from level 2 (zeroed)     kernel: memfd_create + fallocate + mmap, same size     >= 80 %
-                              plain memcpy of the same size, for scale               -
=============================  =====================================================  ===========

Each cycle runs every "ours" next to its limit, alternating which goes first, so that drift on
a shared machine cancels; the table shows the median over the cycles of each cycle's ratio, and
their range.  Progress goes to stderr.  ``--check`` makes a missed goal a non-zero exit (for CI);
a goal that the kernel alone misses in the same run (level 2 with 4 KiB shmem pages) is labelled
"unreachable here" and does not count.  A ``--size`` that does not fit in the
memory available (``MemAvailable``) or in the spill directory's free space is refused before
anything is allocated.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from ..backup import host_available_bytes
from ..cli import CommandParser, can_create_in, nearest_existing, parse_args, plain
from ..errors import InvalidArgumentError, SpillDirError, UnisleepError
from ..units import human_bytes
from .common import add_output_options, output_path, print_table, progress, write_json

GOAL_RATIO = 0.8
#: the verified wake (every spill piece checked against its XXH3 checksum) against the plain read
GOAL_WAKE1_RATIO = 0.9
GOAL_L2_SLEEP_S = 0.005
#: cycles by default: on a shared machine one cycle's ratio can be half or double the next's (the
#: disk's writeback); the median of 7 moves much less than that of 3
DEFAULT_CYCLES = 7
#: peak memory per byte of --size: the tag, its reference copy, and the fresh buffer the wake's
#: limit reads into (at the start, the tag and the pattern that fills it)
MEMORY_FACTOR = 3
#: peak spill-directory space per byte of --size: the level-1 backup and the limit's file
SPILL_FACTOR = 2


def parse_size(text: str) -> int:
    """``512M``, ``1G``, ``1GiB``, ``64MB``, ``4096`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m and re.fullmatch(r"\s*-.*", str(text)):
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r} (e.g. 512M, 1G)")
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 1G, 1073741824)")
    mult = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    n = int(float(m.group(1)) * mult)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _free_bytes(path: str) -> tuple[str, int]:
    """(the directory measured, its free bytes): ``path`` or, if it does not exist yet, the
    nearest existing folder above it (where it would be created)."""
    p = os.path.abspath(path)
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize


def _size_hint(n: int) -> str:
    """A --size value no larger than ``n`` (e.g. "1536M")."""
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div:
            return f"{n // div}{unit}"
    return str(max(n, 1))


def check_room(size: int, spill_dir: Optional[str]) -> str:
    """Refuse a ``size`` that cannot fit before anything is allocated: the benchmark holds about
    MEMORY_FACTOR x size of memory and writes SPILL_FACTOR x size into the spill directory (on a
    RAM filesystem that is memory too).  Returns the spill directory; raises
    :class:`InvalidArgumentError` naming the room there is and a size that fits, and
    :class:`SpillDirError` for a directory that cannot be made or written (a file in the way, a
    read-only filesystem) or that another user could swap.  Nothing is created."""
    from ..backends.host.spill_dir import RAM_FILESYSTEMS, check_spill_parent, default_spill_parent, filesystem_type

    parent = spill_dir or default_spill_parent()
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise SpillDirError(f"--spill-dir {parent} is a file, not a directory; pass a directory.")
    near = nearest_existing(parent)
    if not os.path.isdir(near):
        raise SpillDirError(f"cannot create spill_dir {parent!r}: {near} is a file. Pass "
                            "--spill-dir (or set UNISLEEP_SPILL_DIR) to a writable directory on a disk with room for "
                            "the weights.")
    where, free = _free_bytes(parent)
    why = can_create_in(where)
    if why:  # what the lifecycle's spill store would say, before anything is allocated
        raise SpillDirError(f"cannot {'write in' if where == os.path.abspath(parent) else 'create'} spill_dir "
                            f"{parent!r}: {why} ({where}). Pass --spill-dir (or set UNISLEEP_SPILL_DIR) to a writable "
                            "directory on a disk with room for the weights.")
    check_spill_parent(where, shown=parent)  # no other user can swap it (the lifecycle checks it too)
    avail = host_available_bytes()
    in_ram = filesystem_type(where) in RAM_FILESYSTEMS
    per = MEMORY_FACTOR + (SPILL_FACTOR if in_ram else 0)
    need_mem = per * size
    # the size suggested fits both the memory and the spill directory, whichever refuses first
    fit_disk = free // SPILL_FACTOR
    fit = min(avail // per, fit_disk) if avail else fit_disk
    disk_note = (f" (the spill directory {where} has room for {_size_hint(fit_disk)} only; "
                 "--spill-dir on a filesystem with more room allows more)") if fit == fit_disk else ""
    if avail and need_mem > avail:
        raise InvalidArgumentError(
            f"--size {human_bytes(size)} does not fit in memory: the benchmark holds about {per} x size = "
            f"{human_bytes(need_mem)} ({'the tag, a reference copy, a fresh read buffer' if not in_ram else 'those plus its spill files, on a RAM filesystem'}) "
            f"and {human_bytes(avail)} is available (MemAvailable in /proc/meminfo). "
            f"Pass --size {_size_hint(fit)} or less{disk_note}.")
    need_disk = SPILL_FACTOR * size
    if need_disk > free:
        raise InvalidArgumentError(
            f"--size {human_bytes(size)} does not fit in the spill directory {parent}: the benchmark writes about "
            f"{SPILL_FACTOR} x size = {human_bytes(need_disk)} there (the level-1 backup and the limit's file) and "
            f"{where} has {human_bytes(free)} free. Pass --size {_size_hint(fit)} or less, or "
            "--spill-dir on a filesystem with more room.")
    return parent


def missed_goals(res: dict) -> list[str]:
    """The operations whose goal the run missed (the table's "NO" rows; a goal out of reach on
    this machine is not one)."""
    return [r["operation"] for r in res["rows"] if r["met"] is False]


def _write_file(path: str, src_ptr: int, n: int) -> float:
    """The level-1 sleep's limit: the same pwrite loop into a new file, timed from open to close."""
    mv = memoryview((ctypes.c_char * n).from_address(src_ptr)).cast("B")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        done = 0
        while done < n:
            done += os.pwrite(fd, mv[done:], done)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _read_file_fresh(path: str, n: int) -> float:
    """The wake's limit: read the file into freshly allocated (never touched) memory."""
    t0 = time.perf_counter()
    buf = mmap.mmap(-1, n)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < n:
            got = os.preadv(fd, [mv[done:]], done)
            if got <= 0:
                raise OSError(f"{path} ended after {done} of {n} bytes")
            done += got
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    mv.release()
    buf.close()
    return dt


def _kernel_release(n: int) -> float:
    """Level-2 sleep's floor: what the kernel takes to unmap and free a touched memfd of n bytes."""
    from ..backends.host import libc

    fd = os.memfd_create("unisleep-bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    os.posix_fallocate(fd, 0, n)
    va = libc.mmap(0, n, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_SHARED, fd, 0)
    ctypes.memset(va, 1, n)  # touched through the mapping, like memory that was in use
    t0 = time.perf_counter()
    libc.munmap(va, n)
    os.close(fd)
    return time.perf_counter() - t0


def _kernel_create(n: int) -> float:
    """Level-2 wake's floor: the same kernel calls our host driver makes, without unisleep."""
    from ..backends.host import libc

    reserve = libc.mmap(0, n, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE)
    t0 = time.perf_counter()
    fd = os.memfd_create("unisleep-bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    os.posix_fallocate(fd, 0, n)
    libc.mmap(reserve, n, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_SHARED | libc.MAP_FIXED, fd, 0)
    dt = time.perf_counter() - t0
    libc.munmap(reserve, n)
    os.close(fd)
    return dt


def _pair(first_ours: bool, ours: Callable[[], float], limit: Callable[[], float]) -> tuple[float, float]:
    if first_ours:
        a = ours()
        return a, limit()
    b = limit()
    return ours(), b


def run(size: int, cycles: int, spill_dir: Optional[str]) -> dict:
    import torch

    from ..backends.host.spill_dir import default_spill_parent, filesystem_type
    from ..lifecycle import MemoryLifecycle

    parent = spill_dir or default_spill_parent()
    if not os.path.isdir(parent):
        progress(f"creating the spill directory {parent}")
    os.makedirs(parent, exist_ok=True)
    limit_dir = tempfile.mkdtemp(prefix="unisleep-bench-limit-", dir=parent)
    limit_file = os.path.join(limit_dir, "limit.bin")
    samples: dict[str, list[float]] = {k: [] for k in (
        "sleep1", "write", "wake1", "read", "memcpy", "sleep2", "kernel_release", "wake2", "kernel_create")}
    lc = MemoryLifecycle("host", spill_dir=parent)
    try:
        progress(f"host bench: {human_bytes(size)} x {cycles} cycles, spill dir {parent} ({filesystem_type(parent)})")
        w = lc.empty((size,), torch.uint8, tag="weights")
        pattern = torch.arange(size // 8, dtype=torch.int64)
        pattern.mul_(0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF).bitwise_xor_(0x5DEECE66D)
        w[: size // 8 * 8].view(torch.int64).copy_(pattern)
        del pattern
        ref = w.clone()  # the same bytes in ordinary memory: the limits' source, the memcpy target
        ref_ptr = ref.data_ptr()

        host_mem: dict = {}

        def ours_sleep1() -> float:
            t0 = time.perf_counter()
            lc.sleep(1)
            dt = time.perf_counter() - t0
            host_mem.setdefault("after_sleep", lc.backup_resident_bytes())
            return dt

        def ours_wake() -> float:
            t0 = time.perf_counter()
            lc.wake_up()
            dt = time.perf_counter() - t0
            host_mem.setdefault("after_wake", lc.backup_resident_bytes())
            return dt

        def ours_sleep2() -> float:
            t0 = time.perf_counter()
            lc.sleep(2)
            return time.perf_counter() - t0

        for c in range(cycles):
            first = c % 2 == 0
            progress(f"cycle {c + 1}/{cycles}: level 1 ({'ours' if first else 'limit'} first)")
            # os.sync() before each timed write: dirty pages left by the previous one would
            # otherwise throttle whichever runs second
            if first:
                os.sync()
                s1 = ours_sleep1()
                os.sync()
                wr = _write_file(limit_file, ref_ptr, size)
                wk = ours_wake()
                rd = _read_file_fresh(limit_file, size)
            else:
                os.sync()
                wr = _write_file(limit_file, ref_ptr, size)
                os.sync()
                s1 = ours_sleep1()
                rd = _read_file_fresh(limit_file, size)
                wk = ours_wake()
            os.unlink(limit_file)
            if not torch.equal(w, ref):
                raise RuntimeError("level-1 wake did not restore the bytes exactly")
            samples["sleep1"].append(s1)
            samples["write"].append(wr)
            samples["wake1"].append(wk)
            samples["read"].append(rd)

            t0 = time.perf_counter()
            w.copy_(ref)  # also touches every page, as memory in use would be
            samples["memcpy"].append(time.perf_counter() - t0)

            progress(f"cycle {c + 1}/{cycles}: level 2")
            s2, kr = _pair(first, ours_sleep2, lambda: _kernel_release(size))
            samples["sleep2"].append(s2)
            samples["kernel_release"].append(kr)
            w2, kc = _pair(not first, ours_wake, lambda: _kernel_create(size))
            samples["wake2"].append(w2)
            samples["kernel_create"].append(kc)
            if w[:: max(1, size // 4096)].count_nonzero().item():
                raise RuntimeError("level-2 wake did not come back zeroed")
            w.copy_(ref)
    finally:
        lc.close()
        shutil.rmtree(limit_dir, ignore_errors=True)

    rows = judge(size, samples)
    return {"size_bytes": size, "cycles": cycles, "spill_dir": parent, "filesystem": filesystem_type(parent),
            "rows": rows, "samples_s": samples, "medians_s": {k: statistics.median(v) for k, v in samples.items()},
            "host_memory": host_mem, "host_backups": lc.host_backups}


def shmem_huge_pages() -> Optional[str]:
    """The kernel's setting for huge pages in shmem (memfd) memory, e.g. "never"; None if unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            m = re.search(r"\[(\w+)\]", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


def judge(size: int, samples: dict[str, list[float]]) -> list[dict]:
    """The table's rows from the per-cycle samples.  Each ratio is ours against its limit within
    one cycle (the two ran back to back), so drift between cycles cancels; a row shows the median
    over the cycles and their range, and its verdict is the median's.  A goal that the limit
    itself misses in the same run — the kernel alone is slower than the goal — cannot be met on
    this machine: it is labelled so (``met`` None, ``unreachable`` saying why), and is not a miss."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    gbps = {k: size / v / 1e9 for k, v in med.items()}

    def ratios(limit: str, ours: str) -> list[float]:
        return [lim / o for lim, o in zip(samples[limit], samples[ours])]

    def row(operation, ours, limit, label, goal, ratio_goal=None, time_goal=None, with_gbps=True):
        rs = ratios(limit, ours)
        r = {"operation": operation, "ours_gbps": gbps[ours] if with_gbps else None, "ours_ms": med[ours] * 1e3,
             "limit": label, "limit_gbps": gbps[limit] if with_gbps else None, "limit_ms": med[limit] * 1e3,
             "ratio": statistics.median(rs), "ratio_range": [min(rs), max(rs)],
             "ours_ms_range": [min(samples[ours]) * 1e3, max(samples[ours]) * 1e3], "goal": goal}
        if ratio_goal is not None:
            r["met"] = r["ratio"] >= ratio_goal
        else:
            r["met"] = med[ours] <= time_goal
            if med[limit] > time_goal:  # the kernel alone misses it: out of reach here, whatever unisleep does
                pages = shmem_huge_pages()
                r["met"] = None
                r["unreachable"] = (
                    f"the kernel alone takes {med[limit] * 1e3:.1f} ms (median) for the same {human_bytes(size)}"
                    + (f" (shmem huge pages: {pages}; with 2 MiB shmem pages, an administrator's setting, the "
                       "kernel's cost drops by the page-size ratio)" if pages else ""))
        return r

    return [
        row("level-1 sleep (backup + free)", "sleep1", "write", "write same bytes to a file in spill dir",
            f">= {GOAL_RATIO:.0%}", ratio_goal=GOAL_RATIO),
        row("wake from level 1 (restore)", "wake1", "read", "read the file into fresh memory",
            f">= {GOAL_WAKE1_RATIO:.0%}", ratio_goal=GOAL_WAKE1_RATIO),
        row("level-2 sleep (free only)", "sleep2", "kernel_release", "kernel: munmap + close touched memfd",
            f"<= {GOAL_L2_SLEEP_S * 1e3:g} ms", time_goal=GOAL_L2_SLEEP_S, with_gbps=False),
        row("wake from level 2 (zeroed)", "wake2", "kernel_create", "kernel: memfd + fallocate + mmap",
            f">= {GOAL_RATIO:.0%}", ratio_goal=GOAL_RATIO, with_gbps=False),
        {"operation": "memcpy (for scale)", "ours_gbps": None, "ours_ms": None, "limit": "torch copy_ between buffers",
         "limit_gbps": gbps["memcpy"], "limit_ms": med["memcpy"] * 1e3, "ratio": None, "goal": "-", "met": None},
    ]


def _table(res: dict) -> None:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = []
    for r in res["rows"]:
        ours = "-" if r["ours_ms"] is None else (
            f"{num(r['ours_gbps'], '.2f')} GB/s ({r['ours_ms']:.1f} ms)" if r["ours_gbps"] else f"{r['ours_ms']:.1f} ms")
        lim = f"{num(r['limit_gbps'], '.2f')} GB/s ({r['limit_ms']:.1f} ms)" if r["limit_gbps"] else f"{r['limit_ms']:.1f} ms"
        met = "unreachable here" if r.get("unreachable") else "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.0%}"
        if r.get("ratio_range") and res["cycles"] > 1:
            ratio += f" ({r['ratio_range'][0]:.0%}-{r['ratio_range'][1]:.0%})"
        rows.append([r["operation"], ours, r["limit"], lim, ratio, r["goal"], met])
    print_table(
        f"unisleep host sleep/wake, {human_bytes(res['size_bytes'])}, median of {res['cycles']} cycles "
        f"(ours/limit: the median of each cycle's ratio, and their range), "
        f"spill dir {res['spill_dir']} ({res['filesystem']})",
        ["operation", "ours", "limit (same run)", "limit", "ours/limit, median of cycles", "goal", "met"],
        rows,
    )
    for r in res["rows"]:
        if r.get("unreachable"):
            print(f"{r['operation']}: the goal ({r['goal']}) is out of reach on this machine: {r['unreachable']}. "
                  "Not counted as missed by --check.")
    hm = res.get("host_memory") or {}
    for when in ("after_sleep", "after_wake"):
        r = hm.get(when)
        if r:
            print(f"backup store {when.replace('_', ' the level-1 ') if when == 'after_sleep' else 'after the wake'}: "
                  f"pinned {human_bytes(r['pinned'])}, pageable {human_bytes(r['pageable'])}, on disk "
                  f"{human_bytes(r['disk'])} ({human_bytes(r['held'])} of backups; host_backups={res['host_backups']})")


def build_parser() -> CommandParser:
    ap = CommandParser(prog="unisleep bench", description=plain(__doc__))
    ap.add_argument("--backend", default="host", help="host (this benchmark); another backend name runs the "
                    "device benchmark")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"),
                    help="bytes per tag, e.g. 512M, 1G (default 1G); refused at once if it cannot fit")
    ap.add_argument("--cycles", type=int, default=DEFAULT_CYCLES,
                    help=f"sleep/wake cycles; the table shows medians and ranges (default {DEFAULT_CYCLES})")
    ap.add_argument("--spill-dir", default=None, help="where level-1 backups go (default: unisleep's default)")
    add_output_options(ap, "host")
    ap.add_argument("--check", action="store_true", help="exit 1 when the table shows a missed goal (for CI)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = parse_args(ap, argv)
    if args.backend != "host":
        ap.error(f"this is the host benchmark; --backend {args.backend} is served by unisleep.bench.device")
    if args.cycles < 1:
        ap.error("--cycles must be >= 1")
    try:  # everything it will write, before anything is allocated
        path = output_path(args, "host")
        spill_dir = check_room(args.size, args.spill_dir)
    except UnisleepError as e:
        print(f"unisleep bench: {e}", file=sys.stderr)
        return 2
    res = run(args.size, args.cycles, spill_dir)
    missed = missed_goals(res)
    res["missed"] = missed
    _table(res)
    write_json(path, "host", res, argv)
    if missed:
        print(f"goal missed: {'; '.join(missed)}" + ("" if args.check else " (--check makes this exit 1)"))
        if args.check:
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
