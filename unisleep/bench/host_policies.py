"""``unisleep bench --backend NAME`` (also alone: ``--host-policies``): the two host-backup
policies side by side, and copies from NUMA-near and NUMA-far host memory.

Each policy (``MemoryLifecycle(host_backups="keep" | "release")``) runs in its own process on
the same workload as the main benchmark (``--weights`` GiB backed up, ``--kv`` GiB discarded):
the first sleep (nothing pinned yet), the first wake, ``--cycles`` steady sleep/wake cycles with
the weights changed each time (the copy must run), and one sleep of unchanged weights; after
every wake the store's host memory is read (:meth:`~unisleep.MemoryLifecycle.backup_resident_bytes`:
pinned + pageable + disk).  Goal for ``"release"``: at most 5 % of the backed-up bytes held
after a wake.  Bytes are verified after every wake.

NUMA: the backup store's segments are placed on the GPU's node and on each other node in turn
(``numa_node=``), and a device→host and a host→device copy of ``--numa-gib`` GiB are timed from
each; where the host has one node the row says so (and only the near copy is measured).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from .common import GENERATION_PAUSE_S, progress

GiB = 1 << 30
POLICIES = ("keep", "release")
#: what a wake may leave in host memory under ``host_backups="release"``, as a fraction of the
#: bytes the sleep backed up
GOAL_RELEASED_FRACTION = 0.05


def _host(lc) -> int:
    r = lc.backup_resident_bytes()
    return r["pinned"] + r["pageable"] + r["disk"]


def run_policy(platform: str, device: int, weights_gib: float, kv_gib: float, cycles: int, policy: str) -> dict:
    """One policy's figures (seconds, bytes), in this process."""
    import torch

    from unisleep import MemoryLifecycle

    W, K = int(weights_gib * GiB), int(kv_gib * GiB)
    lc = MemoryLifecycle(platform, device=device, host_backups=policy)
    sync = lc.driver.synchronize

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    out: dict = {"impl": f"host_backups={policy}", "policy": policy, "backed_up_bytes": W}
    try:
        w = lc.empty((W,), torch.uint8, tag="weights")
        kv = lc.empty((K,), torch.uint8, tag="kv_cache")
        w.view(torch.int32).random_() if W % 4 == 0 else w.random_(0, 255)
        kv.fill_(1)
        ref = w.clone()
        ok = True
        out["first_sleep_s"] = timed(lambda: lc.sleep(1))
        out["host_after_sleep_bytes"] = _host(lc)
        out["first_wake_s"] = timed(lambda: lc.wake_up())
        out["host_after_first_wake_bytes"] = _host(lc)
        ok = ok and bool(torch.equal(w, ref))
        sleeps, wakes, after = [], [], []
        for i in range(cycles):
            w[:4096].add_(1)
            ref[:4096].add_(1)
            time.sleep(GENERATION_PAUSE_S)
            sleeps.append(timed(lambda: lc.sleep(1)))
            wakes.append(timed(lambda: lc.wake_up()))
            after.append(_host(lc))
            ok = ok and bool(torch.equal(w, ref)) and not bool(kv.view(torch.uint8)[:: max(1, K // 4096)].any())
            progress(f"host_backups={policy} cycle {i + 1}/{cycles}: sleep {sleeps[-1]:.3f}s wake {wakes[-1]:.3f}s, "
                     f"host after the wake {after[-1] / GiB:.2f} GiB")
        out["steady_sleep_s"], out["steady_wake_s"] = statistics.median(sleeps), statistics.median(wakes)
        out["host_after_wake_bytes"] = max(after) if after else out["host_after_first_wake_bytes"]
        time.sleep(GENERATION_PAUSE_S)
        out["unchanged_sleep_s"] = timed(lambda: lc.sleep(1))
        out["unchanged_copied_bytes"] = lc.last_report.bytes_copied
        lc.wake_up()
        ok = ok and bool(torch.equal(w, ref))
        out["host_after_wake_fraction"] = out["host_after_wake_bytes"] / W if W else 0.0
        out["verified"] = ok
        del w, kv, ref
    finally:
        lc.close()
    return out


def measure_numa(platform: str, device: int, nbytes: int) -> dict:
    """Device<->host copies from backup memory placed on each NUMA node (the store's
    ``numa_node``), GB/s; ``{"why": ...}`` only, where the backend's store has no placement."""
    import torch

    from unisleep import numa
    from unisleep.platform import load_driver

    driver = load_driver(platform, device=device)
    try:
        probe = driver.new_backup_store(None, None)
        if not probe.supports_numa:
            probe.close()
            return {"why": f"the {platform} backend's backup store has no NUMA placement", "nodes": numa.online_nodes()}
        near = probe.device_numa_node()
        probe.close()
        nodes = numa.online_nodes()
        out: dict = {"nodes": nodes, "device_node": near, "bytes": nbytes, "calls": numa.how(), "rows": []}
        if len(nodes) < 2:
            out["why"] = f"one NUMA node ({nodes[0]}): every host byte is near; nothing to compare"
        elif near is None:
            out["why"] = "the GPU's NUMA node is not known (sysfs numa_node reads -1): the nodes are measured as they are"
        targets = [near if near is not None else nodes[0]] + [n for n in nodes if n != near][: 3 if len(nodes) > 1 else 0]
        sync = getattr(torch, driver.torch_device.type).synchronize
        dev = torch.empty(nbytes, dtype=torch.uint8, device=driver.torch_device)
        dev.fill_(3)
        for node in targets:
            store = driver.new_backup_store(None, None)
            store.numa_node = node
            try:
                store.prepare(nbytes, background=False)
                d2h, h2d = [], []
                for _ in range(3):
                    sync()
                    t0 = time.perf_counter()
                    store.save((0, 0), dev)
                    store.flush()
                    d2h.append(time.perf_counter() - t0)
                    sync()
                    t0 = time.perf_counter()
                    store.load((0, 0), dev)
                    store.flush()
                    sync()
                    h2d.append(time.perf_counter() - t0)
                placed = store.page_nodes()
                out["rows"].append({"node": node, "near": node == near, "d2h_gbps": nbytes / min(d2h) / 1e9,
                                    "h2d_gbps": nbytes / min(h2d) / 1e9,
                                    "pages_on_node": sum(1 for p in placed if p == node), "pages_sampled": len(placed)})
                progress(f"NUMA node {node}{' (near)' if node == near else ''}: d2h {out['rows'][-1]['d2h_gbps']:.1f} "
                         f"GB/s, h2d {out['rows'][-1]['h2d_gbps']:.1f} GB/s")
            finally:
                store.close()
        return out
    finally:
        driver.close()


def policy_rows(results: dict) -> list:
    """The side-by-side table: figure, then each policy's value (seconds; host memory in GiB and
    as a fraction of the backed-up bytes), and whether ``"release"`` met its goal."""
    keep, rel = results.get("keep", {}), results.get("release", {})

    def g(r, k, scale=1.0) -> Optional[float]:
        v = r.get(k)
        return None if v is None else v / scale

    rows = [
        ["first sleep (nothing pinned yet)", g(keep, "first_sleep_s"), g(rel, "first_sleep_s")],
        ["first wake", g(keep, "first_wake_s"), g(rel, "first_wake_s")],
        ["steady level-1 sleep", g(keep, "steady_sleep_s"), g(rel, "steady_sleep_s")],
        ["steady wake", g(keep, "steady_wake_s"), g(rel, "steady_wake_s")],
        ["level-1 sleep, unchanged weights", g(keep, "unchanged_sleep_s"), g(rel, "unchanged_sleep_s")],
        ["host memory after sleep (GiB)", g(keep, "host_after_sleep_bytes", GiB), g(rel, "host_after_sleep_bytes", GiB)],
        ["host memory after wake (GiB)", g(keep, "host_after_wake_bytes", GiB), g(rel, "host_after_wake_bytes", GiB)],
        ["host memory after wake / backed up", g(keep, "host_after_wake_fraction"), g(rel, "host_after_wake_fraction")],
    ]
    frac = rel.get("host_after_wake_fraction")
    met = None if frac is None else frac <= GOAL_RELEASED_FRACTION
    return rows, met


def numa_rows(res: dict) -> list:
    return [[r["node"], "near" if r["near"] else "far", r["d2h_gbps"], r["h2d_gbps"],
             f"{r['pages_on_node']}/{r['pages_sampled']}"] for r in res.get("rows", [])]
