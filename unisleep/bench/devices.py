"""``unisleep bench --devices all|N|LIST``: every device of a node sleeps and wakes at the same
instant, one process per device as engines run, beside the limits measured in the same run.

Steps, in order (each process is a :mod:`.devices_worker`; nothing pickled, JSON lines only):

1. the host's memory bandwidth (:mod:`.host_bandwidth`: a multi-threaded memcpy on each NUMA node
   alone, then on every node at once), before any device process starts;
2. one process per device starts;
3. each device's copy into its backup store **alone** (page-locked host memory on an
   accelerator), one device after the other;
4. every process makes its lifecycle: ``--weights`` GiB tagged "weights", one untimed sleep and
   wake, and says where its backup lives (the store's NUMA node and the node of its pages);
5. each device's level-1 sleep and wake alone, ``--cycles`` times, one device after the other;
6. for each count n of ``--counts`` (default 1, 2, 4, … up to every device): the first n
   devices sleep at the same instant (a barrier: the coordinator names one ``time.monotonic``
   instant, a clock every process of the host shares), then wake at the same instant,
   ``--cycles`` times; the weights change before each sleep (the copy must run) and every wake
   is checked byte-exact against a reference copy on its device.

A count's aggregate GB/s is the bytes every device copied over the time from the first start to
the last end.  Its limit is min(the sum of those devices' copies alone, the host's DRAM traffic
with every node copying at once); goal: at least 90 % of it.  ``--check``: exit 1 on a missed
goal.  Every wait ends: a process that exits, reports an error or does not answer a step within
``--timeout`` seconds stops the run with :class:`~unisleep.errors.DeviceProcessError` naming it,
its step and the time waited, after the other processes are stopped (SIGTERM, then SIGKILL
after 5 s).  On the host backend (one device: host memory) ``--devices N`` starts N processes
that share it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..cli import CommandParser, children_leave_ctrl_c_to_us, parse_args, plain
from ..errors import DeviceProcessError, InvalidArgumentError, UnisleepError
from .common import RESULT_PREFIX, add_output_options, output_path, print_table, progress, write_json

GiB = 1 << 30
#: aggregate GB/s against min(sum of the devices' copies alone, host DRAM traffic)
GOAL_FRACTION = 0.9
#: seconds from the barrier's message to the instant every process starts
GO_LEAD_S = 0.05
#: seconds a stopped process gets after SIGTERM, then again after SIGKILL
STOP_GRACE_S = 5.0
DEFAULT_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------- arguments
def parse_devices(spec: str, plat) -> list[tuple[str, int]]:
    """(label, device index) per process for ``--devices spec`` on ``plat``: ``all``, a count N
    (the first N devices) or a list of indices (``0,2,3``).  On a backend whose device is host
    memory, N processes share its one device 0.  Raises :class:`InvalidArgumentError`."""
    spec = str(spec).strip()
    indices = [d.index for d in plat.devices] or [0]
    fix = (f"Pass --devices all, a count from 1 to {len(indices)} or a list of indices such as "
           f"{','.join(map(str, indices[:2]))}" if plat.is_accelerator else
           "Pass --devices all (one process), a count N (N processes sharing host memory) or 0,0,…")
    if spec == "all":
        chosen = indices
    elif spec.isdigit():
        n = int(spec)
        if n < 1 or (plat.is_accelerator and n > len(indices)):
            raise InvalidArgumentError(f"--devices {spec}: {plat.name} has {len(indices)} device(s) here. {fix}.")
        chosen = indices[:n] if plat.is_accelerator else [0] * n
    else:
        try:
            chosen = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError:
            raise InvalidArgumentError(f"--devices {spec!r} is not all, a count or a list of indices. {fix}.") from None
        bad = [d for d in chosen if d not in indices]
        if not chosen or bad:
            raise InvalidArgumentError(f"--devices {spec}: no device {bad} on {plat.name} (its devices: "
                                       f"{indices}). {fix}.")
        if plat.is_accelerator and len(set(chosen)) != len(chosen):
            raise InvalidArgumentError(f"--devices {spec} names a device twice: one process per device. {fix}.")
    if not plat.is_accelerator:
        return [(f"process {k} (host memory)", 0) for k in range(len(chosen))]
    return [(f"device {d}", d) for d in chosen]


def default_counts(n: int) -> list[int]:
    """1, 2, 4, … and n itself."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def parse_counts(text: Optional[str], n: int) -> list[int]:
    if not text:
        return default_counts(n)
    try:
        counts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise InvalidArgumentError(f"--counts {text!r}: a list of device counts such as 1,2,{n}") from None
    if not counts or counts[0] < 1 or counts[-1] > n:
        raise InvalidArgumentError(f"--counts {text}: each count must be from 1 to {n} (the processes started)")
    return counts


# ---------------------------------------------------------------------------------- processes
def _exit_text(rc: Optional[int]) -> str:
    if rc is None:
        return "closed its output"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


class Processes:
    """The device processes: start, one step each, bounded waits, stop.  Any failure stops
    every process and raises :class:`DeviceProcessError`."""

    def __init__(self, cmds: list[list[str]], labels: list[str], timeout_s: float):
        self.labels, self.timeout_s = labels, timeout_s
        self.procs: list[subprocess.Popen] = []
        self._buf: dict[int, bytes] = {}
        with children_leave_ctrl_c_to_us():
            for cmd in cmds:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   env=os.environ.copy()))
        for k, p in enumerate(self.procs):
            self._buf[k] = b""
            progress(f"{labels[k]}: pid {p.pid}")

    def name(self, k: int) -> str:
        return f"{self.labels[k]} (pid {self.procs[k].pid})"

    def send(self, ks: Sequence[int], msg: dict, step: str) -> None:
        data = (json.dumps(msg) + "\n").encode()
        for k in ks:
            try:
                self.procs[k].stdin.write(data)
                self.procs[k].stdin.flush()
            except (BrokenPipeError, OSError):
                self._failed(k, step, f"{_exit_text(self._rc(k))} before it was sent the step")

    def _rc(self, k: int) -> Optional[int]:
        try:
            return self.procs[k].wait(2.0)
        except subprocess.TimeoutExpired:
            return None

    def _failed(self, k: int, step: str, what: str, fix: str = "") -> None:
        self.stop()
        raise DeviceProcessError(f"{self.name(k)} {what} during {step}; every other process was stopped "
                                 f"(SIGTERM, then SIGKILL after {STOP_GRACE_S:g} s).{fix}")

    def collect(self, ks: Sequence[int], step: str, timeout_s: Optional[float] = None) -> dict[int, dict]:
        """Each of ``ks``'s answer to ``step``, waited for at most ``timeout_s`` (--timeout)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending, out = set(ks), {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                k = min(pending)
                others = sorted(pending - {k})
                self._failed(k, step, f"did not answer within {timeout_s:g} s"
                             + (f" (nor did {', '.join(self.labels[o] for o in others)})" if others else ""),
                             " If the step is only slow, pass a larger --timeout.")
            fds = {self.procs[k].stdout.fileno(): k for k in pending}
            ready, _, _ = select.select(list(fds), [], [], min(left, 0.5))
            for fd in ready:
                k = fds[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._failed(k, step, _exit_text(self._rc(k)))
                self._buf[k] += chunk
                while b"\n" in self._buf[k] and k in pending:
                    line, _, self._buf[k] = self._buf[k].partition(b"\n")
                    text = line.decode(errors="replace")
                    if not text.startswith(RESULT_PREFIX):
                        print(f"[{self.labels[k]}] {text}", file=sys.stderr, flush=True)
                        continue
                    res = json.loads(text[len(RESULT_PREFIX):])
                    if "error" in res:
                        self._failed(k, step, f"reported {res['error']}")
                    out[k] = res
                    pending.discard(k)
        return out

    def step(self, ks: Sequence[int], msg: dict, step: str) -> dict[int, dict]:
        self.send(ks, msg, step)
        return self.collect(ks, step)

    def close(self) -> None:
        """Ask every process to close (bounded), then stop what is left."""
        try:
            self.step(range(len(self.procs)), {"do": "close"}, "close")
            end = time.monotonic() + STOP_GRACE_S  # they exit by themselves once closed
            for p in self.procs:
                try:
                    p.wait(max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM every process still running, SIGKILL after STOP_GRACE_S, reap them all."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.terminate()
        end = time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in alive:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    progress(f"pid {p.pid} did not end {STOP_GRACE_S:g} s after SIGKILL")
        for p in self.procs:
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except (OSError, BrokenPipeError):
                    pass


# ---------------------------------------------------------------------------------- the run
def _together(procs: Processes, ks: list[int], what: str) -> dict[int, dict]:
    at = time.monotonic() + GO_LEAD_S
    return procs.step(ks, {"do": what, "at": at}, f"{what} of {', '.join(procs.labels[k] for k in ks)}")


def run(args, plan: list[tuple[str, int]], counts: list[int], res: dict) -> dict:
    """The steps of the module docstring; figures go into ``res`` as they come (so a failure
    leaves what was measured)."""
    from . import host_bandwidth

    W = int(args.weights * GiB)
    res["weights_bytes"] = W
    n = len(plan)
    progress(f"host memory bandwidth: memcpy of {args.host_gib:g} GiB on each NUMA node")
    res["host_bandwidth"] = host_bandwidth.measure(int(args.host_gib * GiB), timeout_s=args.timeout)
    labels = [lab for lab, _ in plan]
    idle = args.timeout * (n * (1 + 2 * args.cycles) + 2)
    cmds = []
    for lab, dev in plan:
        cmd = [sys.executable, "-m", "unisleep", "bench", "--backend", args.backend, "--devices", str(dev),
               "--worker", "device", "--label", lab, "--weights", repr(args.weights),
               "--idle-timeout", repr(idle)]
        if args.spill_dir:
            cmd += ["--spill-dir", args.spill_dir]
        cmds.append(cmd)
    procs = Processes(cmds, labels, args.timeout)
    try:
        ready = procs.collect(range(n), "the start")
        res["processes"] = [{"label": lab, "device": dev, "pid": ready[k]["pid"]} for k, (lab, dev) in enumerate(plan)]
        for k in range(n):
            progress(f"{labels[k]}: its copy into the backup store alone")
            res["processes"][k]["limits"] = procs.step([k], {"do": "limits"}, "its copy alone")[k]
        setup = procs.step(range(n), {"do": "setup"}, "the lifecycle's set-up")
        for k in range(n):
            res["processes"][k]["where"] = setup[k]["where"]
            res["processes"][k]["setup_verified"] = setup[k]["verified"]
        res["alone"] = {}
        for k in range(n):
            cyc = []
            for c in range(args.cycles):
                s = _together(procs, [k], "sleep")[k]
                w = _together(procs, [k], "wake")[k]
                cyc.append({"sleep": s, "wake": w})
                progress(f"{labels[k]} alone, cycle {c + 1}/{args.cycles}: sleep {s['seconds']:.4f} s, "
                         f"wake {w['seconds']:.4f} s, verified {w['verified']}")
            res["alone"][str(k)] = cyc
        res["together"] = []
        for m in counts:
            ks = list(range(m))
            entry = {"n": m, "members": ks, "cycles": []}
            res["together"].append(entry)
            for c in range(args.cycles):
                s = _together(procs, ks, "sleep")
                w = _together(procs, ks, "wake")
                entry["cycles"].append({"sleep": {str(k): v for k, v in s.items()},
                                        "wake": {str(k): v for k, v in w.items()}})
                agg = aggregate(s), aggregate(w)
                progress(f"together n={m} cycle {c + 1}/{args.cycles}: sleep {agg[0]['gbps']:.2f} GB/s, "
                         f"wake {agg[1]['gbps']:.2f} GB/s (aggregate), verified {all(v['verified'] for v in w.values())}")
        procs.close()
    except BaseException:
        procs.stop()
        raise
    return res


# ---------------------------------------------------------------------------------- figures
def aggregate(answers: dict) -> dict:
    """One step of several devices: bytes over the time from the first start to the last end,
    and how far apart the starts were."""
    vals = list(answers.values())
    t0, t1 = min(v["t0"] for v in vals), max(v["t1"] for v in vals)
    total = sum(v["bytes"] for v in vals)
    return {"bytes": total, "seconds": t1 - t0, "gbps": total / (t1 - t0) / 1e9 if t1 > t0 else 0.0,
            "start_spread_s": max(v["t0"] for v in vals) - t0}


def _med(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def figures(res: dict) -> dict:
    """Medians over the cycles: each device alone and at each count, the aggregates, their
    limits and whether the goal was met; and whether every wake was byte-exact."""
    procs = res.get("processes", [])
    host = res.get("host_bandwidth", {}).get("all", {}).get("traffic_gbps")
    dev = []
    for k, p in enumerate(procs):
        alone = res.get("alone", {}).get(str(k), [])
        lim = p.get("limits", {})
        dev.append({"label": p["label"], "d2h_gbps": lim.get("d2h_gbps"), "h2d_gbps": lim.get("h2d_gbps"),
                    "sleep_gbps": _med([c["sleep"]["bytes"] / c["sleep"]["seconds"] / 1e9 for c in alone]),
                    "wake_gbps": _med([c["wake"]["bytes"] / c["wake"]["seconds"] / 1e9 for c in alone])})
    by_n = []
    verified = all(p.get("setup_verified") for p in procs) and bool(procs)
    for c in res.get("alone", {}).values():
        verified = verified and all(x["wake"]["verified"] for x in c)
    for entry in res.get("together", []):
        ks = entry["members"]
        row: dict = {"n": entry["n"]}
        for what, lim_key in (("sleep", "d2h_gbps"), ("wake", "h2d_gbps")):
            aggs = [aggregate(c[what]) for c in entry["cycles"]]
            row[f"{what}_gbps"] = _med([a["gbps"] for a in aggs])
            row[f"{what}_spread_ms"] = _med([a["start_spread_s"] * 1e3 for a in aggs])
            row[f"{what}_per_device_gbps"] = {
                str(k): _med([c[what][str(k)]["bytes"] / c[what][str(k)]["seconds"] / 1e9 for c in entry["cycles"]])
                for k in ks}
            alone = [dev[k][lim_key] for k in ks]
            copies = sum(alone) if alone and None not in alone else None
            limit = min(x for x in (copies, host) if x is not None) if (copies or host) else None
            row[f"{what}_limit_gbps"] = limit
            row[f"{what}_limit_is"] = "the host's memory" if limit is not None and limit == host and (
                copies is None or host < copies) else "the devices' copies alone"
            row[f"{what}_fraction"] = None if not limit or row[f"{what}_gbps"] is None else row[f"{what}_gbps"] / limit
        row["met"] = None if row["sleep_fraction"] is None or row["wake_fraction"] is None else (
            row["sleep_fraction"] >= GOAL_FRACTION and row["wake_fraction"] >= GOAL_FRACTION)
        row["verified"] = all(x["verified"] for c in entry["cycles"] for x in c["wake"].values())
        verified = verified and row["verified"]
        by_n.append(row)
    return {"devices": dev, "by_count": by_n, "host_traffic_gbps": host, "verified": verified,
            "missed": [r["n"] for r in by_n if r["met"] is False]}


def _where_text(where: Optional[dict]) -> str:
    if not where:
        return "-"
    if not where.get("supports_numa"):
        return where.get("store", "-")
    pages = where.get("page_nodes") or {}
    shown = ", ".join(f"node {n}: {c}" for n, c in sorted(pages.items())) or "pages not read"
    dn = where.get("device_node")
    return (f"{where.get('store')}, pages {shown} of {where.get('pages_sampled')} sampled; device's node "
            f"{'unknown' if dn is None else dn}" + ("" if where.get("local") is None else
                                             " (local)" if where["local"] else " (NOT local)"))


def print_tables(res: dict, fig: dict, backend: str) -> None:
    procs = res.get("processes", [])
    W = res.get("weights_bytes", 0)
    by_n = fig["by_count"]
    last = by_n[-1] if by_n else None
    rows = []
    for k, d in enumerate(fig["devices"]):
        rows.append([d["label"], d["d2h_gbps"], d["h2d_gbps"], d["sleep_gbps"], d["wake_gbps"],
                     None if last is None else last["sleep_per_device_gbps"].get(str(k)),
                     None if last is None else last["wake_per_device_gbps"].get(str(k))])
    if last is not None:
        ks = range(last["n"])
        sums = [sum(fig["devices"][k][key] or 0 for k in ks) for key in ("d2h_gbps", "h2d_gbps")]
        rows.append([f"{last['n']} at once (aggregate)", sums[0], sums[1], None, None, last["sleep_gbps"],
                     last["wake_gbps"]])
    n_last = last["n"] if last else 0
    print_table(f"level-1 sleep/wake on {backend}, {W / GiB:g} GiB weights per process, GB/s (medians of "
                f"{res.get('cycles')} cycles; 'copy alone': the backup store's own copy, one device at a time)",
                ["process", "copy alone d2h", "copy alone h2d", "sleep alone", "wake alone",
                 f"sleep, {n_last} at once", f"wake, {n_last} at once"], rows)
    print_table("where each backup lives (read while the weights sleep)", ["process", "backup"],
                [[p["label"], _where_text(p.get("where"))] for p in procs])
    hb = res.get("host_bandwidth", {})
    hrows = [[f"node {r['node']}", r["threads"], r["copied_gbps"], r["traffic_gbps"],
              f"{r['pages_on_node']}/{r['pages_sampled']}"] for r in hb.get("nodes", [])]
    if hb.get("all"):
        a = hb["all"]
        hrows.append([f"every node at once ({len(a['nodes'])})", a["threads"], a["copied_gbps"], a["traffic_gbps"], "-"])
    print_table(f"host memory bandwidth, same run: multi-threaded memcpy of {hb.get('size_bytes', 0) / GiB:g} GiB "
                "per node, best of 3 (DRAM traffic = bytes read + written = 2 x copied)",
                ["where", "threads", "copied GB/s", "DRAM traffic GB/s", "pages on the node"], hrows)
    print_table(f"devices sleeping and waking at the same instant: aggregate GB/s against min(sum of their copies "
                f"alone, the host's DRAM traffic); goal >= {GOAL_FRACTION:.0%}",
                ["devices", "sleep", "limit", "fraction", "wake", "limit", "fraction", "start spread ms",
                 "wake limited by", "goal met", "bytes exact"],
                [[r["n"], r["sleep_gbps"], r["sleep_limit_gbps"], r["sleep_fraction"], r["wake_gbps"],
                  r["wake_limit_gbps"], r["wake_fraction"], max(r["sleep_spread_ms"] or 0, r["wake_spread_ms"] or 0),
                  r["wake_limit_is"], "-" if r["met"] is None else "yes" if r["met"] else "NO",
                  "yes" if r["verified"] else "NO"] for r in by_n])


# ---------------------------------------------------------------------------------- the command
def build_parser() -> CommandParser:
    ap = CommandParser(prog="unisleep bench", description=plain(__doc__))
    ap.add_argument("--devices", required=True, help="all, a count N (the first N devices) or a list of indices "
                    "(0,2,3); on the host backend N processes sharing host memory")
    ap.add_argument("--backend", default=None, help="the backend to measure (default: the platform detected here)")
    ap.add_argument("--weights", type=float, default=8.0, help="GiB tagged weights per process (default 8)")
    ap.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per step; the tables show medians "
                    "(default 3)")
    ap.add_argument("--counts", default=None, help="device counts that sleep and wake together, e.g. 1,4,8 "
                    "(default 1, 2, 4, ... and every device)")
    ap.add_argument("--host-gib", type=float, default=2.0, help="GiB per NUMA node for the host memcpy (default 2)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds each step of each process may take (its start, a copy, a sleep, a wake) before "
                         f"the run stops with DeviceProcessError (default {DEFAULT_TIMEOUT_S:g})")
    ap.add_argument("--spill-dir", default=None, help="where the host backend's level-1 backups go")
    ap.add_argument("--check", action="store_true", help="exit 1 when a count misses the goal")
    add_output_options(ap, "<backend>-devices")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--idle-timeout", type=float, default=None, help=argparse.SUPPRESS)
    return ap


def _check_room(plan, plat, args) -> None:
    """Refuse sizes that cannot fit, before anything starts."""
    from ..backup import host_available_bytes
    from ..units import human_bytes

    W = int(args.weights * GiB)
    if plat.is_accelerator:
        free = {d.index: d.free_bytes for d in plat.devices}
        for lab, dev in plan:
            if free.get(dev) is not None and 2 * W > free[dev]:
                raise InvalidArgumentError(
                    f"--weights {args.weights:g}: {lab} has {human_bytes(free[dev])} free and a process holds 2 x "
                    f"weights (the tag and its reference copy) = {human_bytes(2 * W)}. Pass a smaller --weights.")
        need = len(plan) * W  # the backups
    else:
        need = len(plan) * 3 * W  # each process: the tag, its reference copy, its backup (memory on a RAM disk)
    avail = host_available_bytes()
    if avail and need > avail:
        raise InvalidArgumentError(
            f"--weights {args.weights:g} x {len(plan)} process(es): about {human_bytes(need)} of host memory is needed "
            f"and {human_bytes(avail)} is available. Pass a smaller --weights or fewer --devices.")
    from .. import numa

    hb = 2 * int(args.host_gib * GiB) * len(numa.online_nodes())
    if avail and hb > avail:
        raise InvalidArgumentError(f"--host-gib {args.host_gib:g}: the memcpy holds {human_bytes(hb)} and "
                                   f"{human_bytes(avail)} is available. Pass a smaller --host-gib.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = parse_args(ap, argv)
    if args.worker:
        from .devices_worker import serve

        return serve(args.backend, int(args.devices), args.label or f"device {args.devices}",
                     int(args.weights * GiB), args.spill_dir, args.idle_timeout or DEFAULT_TIMEOUT_S)
    from .cli import platform_with_devices

    for name, v in (("--weights", args.weights), ("--host-gib", args.host_gib), ("--timeout", args.timeout)):
        if not v > 0 or v == float("inf"):
            ap.error(f"{name} must be a positive number, got {v:g}")
    if args.cycles < 1:
        ap.error(f"--cycles must be >= 1, got {args.cycles}")
    try:
        plat = platform_with_devices(args.backend, "--backend")
        args.backend = plat.name
        plan = parse_devices(args.devices, plat)
        counts = parse_counts(args.counts, len(plan))
        path = output_path(args, f"{plat.name}-devices")
        _check_room(plan, plat, args)
    except UnisleepError as e:
        print(f"unisleep bench: {e}", file=sys.stderr)
        return 2
    res: dict = {"backend": plat.name, "cycles": args.cycles, "counts": counts, "timeout_s": args.timeout,
                 "plan": [{"label": lab, "device": d} for lab, d in plan]}
    try:
        run(args, plan, counts, res)
    except DeviceProcessError as e:
        res["error"] = f"DeviceProcessError: {e}"
        write_json(path, f"devices-{plat.name}", res, argv)
        print(f"unisleep bench: DeviceProcessError: {e}", file=sys.stderr)
        return 1
    fig = figures(res)
    res["figures"] = fig
    print_tables(res, fig, plat.name)
    print(f"bytes exact on every process after every wake: {'yes' if fig['verified'] else 'NO'}")
    write_json(path, f"devices-{plat.name}", res, argv)
    if not fig["verified"]:
        return 1
    if fig["missed"]:
        print(f"goal missed at {', '.join(map(str, fig['missed']))} device(s) at once"
              + ("" if args.check else " (--check makes this exit 1)"))
        if args.check:
            return 1
    return 0
