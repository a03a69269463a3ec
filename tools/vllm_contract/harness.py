#!/usr/bin/env python3
"""vLLM's sleep-mode contract on a GPU: the ``unisleep`` backend and vLLM's own ``cumem`` backend,
driven through vLLM's real code (extracted by ``fetch.py``) in the GPU worker's order, same run.

    python tools/vllm_contract/fetch.py                                  # once, on a CPU machine
    PYTHONPATH=. python3 tools/vllm_contract/harness.py --weights-gib 8 --kv-gib 16 --json out.json
    PYTHONPATH=. python3 tools/vllm_contract/harness.py --vllm-pkg 0.24.0 ...   # vllm_pkg-0.24.0/

``--vllm-pkg DIR`` (or ``VLLM_CONTRACT_PKG``; a bare version names ``vllm_pkg-<version>/`` beside
this file; default ``vllm_pkg/``) picks the extracted vLLM.  Each config takes the route a user
has on that version (:class:`Contract`, read from the extracted modules):

* ``cumem``: vLLM's ``CuMemBackend`` from ``SleepModeBackendFactory`` (0.25+); on 0.24, which has
  no backends, :class:`WorkerCalls` (a stand-in written here) makes the GPU worker's own calls on
  ``get_mem_allocator_instance()``;
* ``unisleep``: unisleep's allocator under the same driver: the ``unisleep`` backend where
  ``--sleep-mode-backend`` exists (0.33+), else vLLM's ``cumem`` backend (0.25-0.32) or the
  worker's calls (0.24) driving it, as ``UNISLEEP_VLLM_ALLOCATOR=1`` makes it;
* ``unisleep-backend`` (not in the default list): the ``unisleep`` backend from the factory on
  0.25-0.32 too, where no flag selects it.

What a version lacks is said in the output (``contract.notes`` in the JSON) and left out of the
run: the ``runtime`` tag (without vLLM's deferrable-tag wake, 0.33, a runtime tag would never
wake; the runtime buffer stays outside sleep mode, as in that vLLM), graph-capture pool routing
(``compilation/cudagraph_pool``, 0.33: the graph is captured in torch's own pool, outside sleep
mode), ``discard`` (the allocator's from 0.28, the backend's from 0.33).

Per backend (vLLM's ``get_mem_allocator_instance()`` answers — the unisleep plugin makes it our
allocator):

1. weights under ``use_memory_pool("weights")`` (``get_current_usage() == 0`` first, like the
   worker), KV cache under ``"kv_cache"``, a runtime buffer under ``"runtime"``, and a CUDA graph
   captured through vLLM's ``compilation/cudagraph_pool.capture_pool`` (the ``cudagraph`` pool)
   reading the weights and the runtime buffer;
2. first sleep (level 1), ``resume(["weights"])`` then ``resume(["kv_cache"])``;
3. steady level-1 cycles (one byte of every weight tensor changed before each sleep, as after a
   training step), then unchanged cycles, then a level-2 sleep (weights reloaded after the wake),
   then ``discard(("kv_cache",))``;

checking each time: weights bytes exact against a reference copy, runtime bytes exact, graph
replay exact against eager, the memory freed by ``cuMemGetInfo`` (``torch.cuda.mem_get_info``).
Prints a table and writes JSON.  Exit 1 when a check fails.

For ``unisleep`` it also breaks the first level-1 sleep down beside the first steady one (the
lifecycle's and the CUDA driver's per-phase traces, ``unisleep.driver.add_trace_sink``): what the
backup arena held when the sleep began and whether it was still growing (the copies then wait for
its segments: "queue copies"), the copies, the digests, the releases; and what the allocator
prepared while the engine started (``UnisleepAllocator.backup_room``: bytes, seconds the start
waited for it).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PKG = os.path.join(HERE, "vllm_pkg")
PKG_ENV = "VLLM_CONTRACT_PKG"
PKG = DEFAULT_PKG  # the tree in use, set by _setup
GiB = 1 << 30


def resolve_pkg(value: str | None = None) -> str:
    """The extracted tree: ``value`` (a folder, or a version naming ``vllm_pkg-<version>/`` beside
    this file), else ``$VLLM_CONTRACT_PKG``, else ``vllm_pkg/``."""
    value = value or os.environ.get(PKG_ENV) or DEFAULT_PKG
    if not os.path.isdir(value) and os.path.isdir(os.path.join(HERE, f"vllm_pkg-{value}")):
        value = os.path.join(HERE, f"vllm_pkg-{value}")
    return os.path.abspath(value)


def put_on_path(pkg: str | None = None) -> str:
    """Put the extracted tree first on ``sys.path`` (no GPU needed); returns it."""
    global PKG
    PKG = resolve_pkg(pkg)
    if not os.path.isdir(os.path.join(PKG, "vllm", "device_allocator")):
        ver = os.path.basename(PKG).partition("-")[2]
        raise SystemExit(f"{PKG} is missing: run `python tools/vllm_contract/fetch.py"
                         f"{' --version ' + ver if ver else ''}` first (on a machine with a package registry)")
    os.environ[PKG_ENV] = PKG  # children (capture_loop) take the same tree
    if PKG not in sys.path:
        sys.path.insert(0, PKG)
    return PKG


def version() -> str:
    with open(os.path.join(PKG, "VERSION")) as f:
        return f.read().strip()


def manifest() -> list[str]:
    path = os.path.join(PKG, "MANIFEST")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


class WorkerCalls:
    """Stand-in, written here, for vLLM 0.24's GPU worker, which has no sleep-mode backend: its
    ``Worker.sleep(level)`` calls ``get_mem_allocator_instance().sleep(offload_tags=("weights",)
    if level == 1 else tuple())`` and ``Worker.wake_up(tags)`` calls ``.wake_up(tags)``
    (``vllm/v1/worker/gpu_worker.py``, which cannot be imported without the whole engine).  It
    makes exactly those calls on vLLM's real ``get_mem_allocator_instance``; no discard (0.24's
    allocator has none)."""

    def suspend(self, level: int = 1) -> None:
        from vllm.device_allocator import get_mem_allocator_instance

        get_mem_allocator_instance().sleep(offload_tags=("weights",) if level == 1 else tuple())

    def resume(self, tags=None) -> None:
        from vllm.device_allocator import get_mem_allocator_instance

        get_mem_allocator_instance().wake_up(tags)


def _importable(name: str) -> bool:
    import importlib

    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


class Contract:
    """What the extracted vLLM offers, read from its own modules (import them first: ``_setup``)."""

    def __init__(self):
        import vllm.device_allocator as da
        from vllm.device_allocator.cumem import CuMemAllocator

        from unisleep.vllm_worker.versions import has_feature

        self.version = version()
        self.factory = _importable("vllm.device_allocator.sleep_mode_backend")
        self.flag = has_feature(self.version, "sleep_backend_flag")  # --sleep-mode-backend (CLI, not in these files)
        self.graph_pool = _importable("vllm.compilation.cudagraph_pool") and hasattr(CuMemAllocator, "cudagraph_pool")
        self.runtime_pool = hasattr(da, "DEFERRABLE_TAGS")
        self.allocator_discard = hasattr(CuMemAllocator, "discard")
        self.backend_discard = False
        if self.factory:
            from vllm.device_allocator.sleep_mode_backend import CuMemBackend

            self.backend_discard = hasattr(CuMemBackend, "discard")
        self.release_pools = hasattr(CuMemAllocator, "release_pools")
        self.notes: list[str] = []
        v = f"vLLM {self.version}"
        if not self.factory:
            self.notes.append(f"{v} has no SleepModeBackendFactory (0.25+): both configs drive the allocator "
                              "with the GPU worker's own calls (WorkerCalls, a stand-in)")
        elif not self.flag:
            self.notes.append(f"{v} has no --sleep-mode-backend flag (0.33+): 'unisleep' is vLLM's cumem backend "
                              "over unisleep's allocator (UNISLEEP_VLLM_ALLOCATOR=1); 'unisleep-backend' "
                              "selects unisleep's backend from the factory all the same")
        if not self.runtime_pool:
            self.notes.append(f"{v}: no 'runtime' tag (wake_up(tags) wakes only the tags named; deferrable "
                              "tags are not in this version): the runtime buffer stays outside sleep mode, as in this vLLM")
        if not self.graph_pool:
            self.notes.append(f"{v}: no graph-capture pool routing (compilation/cudagraph_pool, "
                              "CuMemAllocator.cudagraph_pool): the graph is captured in torch's own pool, outside sleep mode")
        if not self.allocator_discard:
            self.notes.append(f"{v}: no CuMemAllocator.discard (0.28+): the discard step is not run")
        elif not self.backend_discard:
            self.notes.append(f"{v}: no CuMemBackend.discard: the discard step calls the allocator's")
        if not self.release_pools:
            self.notes.append(f"{v}: no CuMemAllocator.release_pools: cumem's cleanup only drops the tensors")

    def route(self, name: str):
        """(the backend object, what drives which allocator) for config ``name``."""
        if name not in ("cumem", "unisleep", "unisleep-backend"):
            raise SystemExit(f"unknown config {name!r}: cumem, unisleep or unisleep-backend")
        if name == "unisleep-backend" and not self.factory:
            raise RuntimeError(f"vLLM {self.version} has no SleepModeBackendFactory: no unisleep backend to select")
        if not self.factory:
            return WorkerCalls(), "the GPU worker's calls (WorkerCalls stand-in)"
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

        which = "unisleep" if name == "unisleep-backend" or (name == "unisleep" and self.flag) else "cumem"
        backend = SleepModeBackendFactory.create_backend(SimpleNamespace(sleep_mode_backend=which))
        return backend, f"SleepModeBackendFactory {which!r}"

    def as_dict(self) -> dict:
        return {"version": self.version, "tree": os.path.basename(PKG), "sleep_mode_backend_factory": self.factory,
                "sleep_mode_backend_flag": self.flag, "graph_pool_routing": self.graph_pool,
                "runtime_tag": self.runtime_pool, "allocator_discard": self.allocator_discard,
                "backend_discard": self.backend_discard, "release_pools": self.release_pools,
                "notes": self.notes, "manifest": manifest()}


def _setup(pkg: str | None = None):
    put_on_path(pkg)
    import torch

    torch.cuda.init()
    # vLLM's cuMem extension is linked against libnvrtc (as well as torch's libraries)
    for pat in ("nvidia/cu13/lib/libnvrtc.so.13*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*",
                "nvidia/*/lib/libnvrtc.so.*"):
        for sp in sys.path:
            hits = sorted(glob.glob(os.path.join(sp, pat)))
            if hits:
                ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
                return
    print("note: no libnvrtc found in the nvidia wheels; the cuMem extension may not load")


def _sync():
    import torch

    torch.cuda.synchronize()


def _free():
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class Run:
    def __init__(self, name, args):
        self.name, self.args = name, args
        self.checks: list[tuple[str, bool, str]] = []
        self.t: dict[str, list[float]] = {}
        self.mem: dict[str, int] = {}
        self.breakdown: dict[str, dict] = {}  # unisleep: the first and first steady sleep, phase by phase

    def check(self, what, ok, detail=""):
        self.checks.append((what, bool(ok), detail))
        if not ok:
            print(f"  FAIL [{self.name}] {what} {detail}")

    def time(self, key, fn):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        dt = time.perf_counter() - t0
        self.t.setdefault(key, []).append(dt)
        return dt


def run_backend(name: str, args, contract: "Contract") -> Run:
    import torch
    from vllm.device_allocator import get_mem_allocator_instance

    from unisleep.vllm_worker import plugin as vllm_plugin

    r = Run(name, args)
    uni = name.startswith("unisleep")
    behind = uni and args.release_behind
    if behind:  # MemoryLifecycle(release_behind=True) in the allocator's lifecycle
        os.environ["UNISLEEP_RELEASE_BEHIND"] = "1"
    vllm_plugin.select_allocator(uni)
    backend, r.route = contract.route(name)
    alloc = get_mem_allocator_instance()
    r.check("allocator", (type(alloc).__name__ == "UnisleepAllocator") == uni, type(alloc).__name__)
    r.allocator = type(alloc).__name__
    r.backend = type(backend).__name__
    print(f"  {name}: {r.route} -> {r.backend} over {r.allocator}", flush=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1234)
    W, K = int(args.weights_gib * GiB), int(args.kv_gib * GiB)
    nw, nk = args.weight_tensors, args.kv_tensors
    free0 = _free()

    # 1. load -----------------------------------------------------------------------------
    t_load = time.perf_counter()
    r.check("usage 0 before weights", alloc.get_current_usage() == 0, str(alloc.get_current_usage()))
    with alloc.use_memory_pool(tag="weights"):
        weights = [torch.randint(0, 256, (W // nw,), dtype=torch.uint8, device=dev, generator=gen)
                   for _ in range(nw)]
    ref = [w.clone() for w in weights]  # outside every pool
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = [torch.empty((K // nk,), dtype=torch.uint8, device=dev) for _ in range(nk)]
        for k in kv:
            k.fill_(7)
    n = 1 << 20
    import contextlib

    with (alloc.use_memory_pool(tag="runtime") if contract.runtime_pool else contextlib.nullcontext()):
        rt = torch.randint(0, 256, (args.runtime_mib << 20,), dtype=torch.uint8, device=dev, generator=gen)
        x = torch.zeros((n,), dtype=torch.int32, device=dev)
    rt_ref = rt.clone()
    graph = torch.cuda.CUDAGraph()
    vcfg = SimpleNamespace(use_cumem_cudagraph_pool=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch asks
        _ = x * 3 + weights[0][:n].to(torch.int32) + rt[:n].to(torch.int32)
    torch.cuda.current_stream().wait_stream(side)
    if contract.graph_pool:
        from vllm.compilation.cudagraph_pool import capture_pool
    else:  # this vLLM captures in torch's own pool
        capture_pool = lambda pool, cfg: contextlib.nullcontext(pool)  # noqa: E731
    with capture_pool(None, vcfg) as pool:
        with torch.cuda.graph(graph, pool=pool):
            y = x * 3 + weights[0][:n].to(torch.int32) + rt[:n].to(torch.int32)
    _sync()
    r.t["load"] = [time.perf_counter() - t_load]  # unisleep: with the wait for the backup room before the KV cache
    loaded = free0 - _free()
    r.mem["loaded_bytes"] = loaded
    r.mem["usage_bytes"] = alloc.get_current_usage()

    def replay_ok(tag):
        x.copy_(torch.randint(0, 1 << 20, (n,), dtype=torch.int32, device=dev, generator=gen))
        graph.replay()
        want = x * 3 + weights[0][:n].to(torch.int32) + rt[:n].to(torch.int32)
        r.check(f"graph replay exact ({tag})", torch.equal(y, want))

    def weights_ok(tag):
        r.check(f"weights exact ({tag})", all(torch.equal(a, b) for a, b in zip(weights, ref)))
        r.check(f"runtime exact ({tag})", torch.equal(rt, rt_ref))

    replay_ok("loaded")

    def sleep(level, key):
        before = _free()
        if uni and key in ("first_sleep", "steady_sleep") and key not in r.breakdown:
            traced(key, lambda: r.time(key, lambda: backend.suspend(level)))
        else:
            r.time(key, lambda: backend.suspend(level))
        freed = _free() - before
        want = K + (W if level >= 1 else 0)
        if behind:  # the memory comes back behind the return: how long after it (polled)
            t0 = time.perf_counter()
            while freed < 0.98 * want and time.perf_counter() - t0 < 1.0:
                freed = _free() - before
            r.t.setdefault(key + "_back", []).append(time.perf_counter() - t0)
        r.mem.setdefault(f"{key}_freed_bytes", freed)
        r.check(f"{key}: memory freed >= weights+kv ({freed / GiB:.2f} GiB)", freed >= 0.98 * want,
                f"{freed} < {want}")
        return freed

    def wake(key):
        r.time(key + "_weights", lambda: backend.resume(["weights"]))
        replay_ok(key + " after weights")  # runtime + graph pool came back with the weights
        r.time(key + "_kv", lambda: backend.resume(["kv_cache"]))
        r.t.setdefault(key, []).append(r.t[key + "_weights"][-1] + r.t[key + "_kv"][-1])

    def traced(key, run):
        """Run a sleep with the lifecycle's and the driver's traces collected: its breakdown."""
        from unisleep.driver import add_trace_sink, remove_trace_sink

        lc = alloc.lifecycle
        store = lc.backup_store
        recs: list = []
        before = {"arena_bytes": getattr(store, "capacity", None), "held_bytes": store.held_bytes,
                  "backup_room": dict(getattr(alloc, "backup_room", None) or {})}
        add_trace_sink(recs.append)
        try:
            run()
        finally:
            remove_trace_sink(recs.append)
        r.breakdown[key] = {"seconds": r.t[key][-1], "before": before,
                            "traces": [{**t, "phases": [[p, s] for p, s in t["phases"]]} for t in recs]}

    # 2. first sleep ----------------------------------------------------------------------
    if args.settle_s:
        time.sleep(args.settle_s)  # the worker profiles and captures between load and first sleep
    sleep(1, "first_sleep")
    wake("first_wake")
    weights_ok("first wake")
    for k in kv:  # the KV cache is usable again (contents undefined on vLLM, zero on unisleep)
        k.fill_(9)
    r.check("kv usable after wake", int(kv[-1][:16].sum()) == 9 * 16)

    # 3. steady (weights changed) ---------------------------------------------------------
    for i in range(args.cycles):
        for a, b in zip(weights, ref):
            a[i * 4097 % a.numel()] += 1
            b[i * 4097 % b.numel()] += 1
        sleep(1, "steady_sleep")
        wake("steady_wake")
        weights_ok(f"steady {i}")
    for i in range(args.cycles):
        sleep(1, "unchanged_sleep")
        wake("unchanged_wake")
        weights_ok(f"unchanged {i}")

    # level 2 -----------------------------------------------------------------------------
    sleep(2, "l2_sleep")
    r.time("l2_wake_weights", lambda: backend.resume(["weights"]))
    with torch.no_grad():
        for a, b in zip(weights, ref):  # the worker reloads the weights after a level-2 wake
            a.copy_(b)
    r.time("l2_wake_kv", lambda: backend.resume(["kv_cache"]))
    weights_ok("after level 2 + reload")
    replay_ok("after level 2")

    # discard (vLLM 0.28+: the allocator's; 0.33+: the backend's) ------------------------
    discard = getattr(backend, "discard", None) or (getattr(alloc, "discard", None) if contract.allocator_discard else None)
    if discard is not None:
        before = _free()
        r.time("discard_kv", lambda: discard(("kv_cache",)))
        freed = _free() - before
        if behind:
            t0 = time.perf_counter()
            while freed < 0.98 * K and time.perf_counter() - t0 < 1.0:
                freed = _free() - before
            r.t.setdefault("discard_kv_back", []).append(time.perf_counter() - t0)
        r.mem["discard_freed_bytes"] = freed
        r.check(f"discard kv_cache freed ({freed / GiB:.2f} GiB)", freed >= 0.98 * K, f"{freed} < {K}")
        backend.resume(["kv_cache"])
        weights_ok("after discard")
        replay_ok("after discard")

    # cleanup -----------------------------------------------------------------------------
    del graph, y, weights, kv, rt, x, ref, rt_ref
    gc.collect()
    if uni:
        from unisleep.vllm_worker.allocator import UnisleepAllocator

        UnisleepAllocator.reset_instance()
    elif contract.release_pools:
        alloc.release_pools()
    gc.collect()
    torch.cuda.empty_cache()
    vllm_plugin.select_allocator(None)
    r.mem["left_after_cleanup_bytes"] = free0 - _free()
    return r


def summarize(runs, args, contract: "Contract | None" = None) -> dict:
    import torch

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()}), torch {torch.__version__}",
        "vllm": version(),
        "contract": contract.as_dict() if contract is not None else None,
        "command": " ".join(sys.argv),
        "weights_gib": args.weights_gib, "kv_gib": args.kv_gib, "cycles": args.cycles,
        "backends": {},
    }
    for r in runs:
        t = {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}
             for k, v in r.t.items()}
        out["backends"][r.name] = {
            "allocator": getattr(r, "allocator", None), "backend": getattr(r, "backend", None),
            "route": getattr(r, "route", None),
            "times_s": t, "memory": r.mem, "breakdown": r.breakdown,
            "checks": [{"what": w, "ok": ok, "detail": d} for w, ok, d in r.checks],
            "passed": all(ok for _, ok, _ in r.checks),
        }
    return out


def table(out) -> str:
    rows = [("load (weights, KV cache, runtime, graph capture)", "load"),
            ("first sleep (L1)", "first_sleep"), ("first wake (weights+kv)", "first_wake"),
            ("steady L1 sleep", "steady_sleep"), ("steady L1 wake", "steady_wake"),
            ("unchanged L1 sleep", "unchanged_sleep"), ("unchanged L1 wake", "unchanged_wake"),
            ("L2 sleep", "l2_sleep"), ("L2 wake weights", "l2_wake_weights"),
            ("discard kv_cache", "discard_kv"),
            ("unchanged L1: memory back after the return", "unchanged_sleep_back"),
            ("L2: memory back after the return", "l2_sleep_back"),
            ("discard: memory back after the return", "discard_kv_back")]
    names = list(out["backends"])
    lines = ["| step (median s) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in rows:
        cells = []
        for nm in names:
            t = out["backends"][nm]["times_s"].get(key)
            cells.append(f"{t['median']:.4f}" if t else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: the breakdown's rows: (label, the trace and phase it is read from)
BREAKDOWN = [
    ("vLLM backend + allocator, outside the lifecycle", None),
    ("plan + check of retained digests", ("sleep", "plan + unchanged check")),
    ("reserve the backup's room", ("sleep", "reserve")),
    ("queue the copies (waits for the arena's growth)", ("suspend", "queue copies")),
    ("queue the digests", ("suspend", "queue digests")),
    ("release the discarded tags (KV cache)", ("suspend", "release discarded")),
    ("copies complete, their chunks released", ("suspend", "release copied chunks")),
    ("read the digests", ("suspend", "read digests")),
    ("release the rest", ("suspend", "release the rest")),
    ("bookkeeping", ("sleep", "bookkeeping")),
]


def breakdown_table(b: dict) -> str:
    """The unisleep run's first and first steady sleep, phase by phase (ms), and what the backup
    arena held when each began."""
    keys = [k for k in ("first_sleep", "steady_sleep") if k in b]
    if not keys:
        return ""

    def phase(k, what, ph):
        tr = next((t for t in b[k]["traces"] if t["what"] == what), None)
        if tr is None:
            return None
        return sum(s for p, s in tr["phases"] if p == ph)

    lines = ["| unisleep sleep, phase (ms) | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for label, src in BREAKDOWN:
        cells = []
        for k in keys:
            if src is None:
                sl = next((t for t in b[k]["traces"] if t["what"] == "sleep"), None)
                v = None if sl is None else b[k]["seconds"] - sl["seconds"]
            else:
                v = phase(k, *src)
            cells.append("-" if v is None else f"{v * 1e3:.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **whole sleep** | " + " | ".join(f"**{b[k]['seconds'] * 1e3:.1f}**" for k in keys) + " |")
    for k in keys:
        sus = next((t for t in b[k]["traces"] if t["what"] == "suspend"), {})
        room = b[k]["before"]["backup_room"]
        prepared = (f"prepared while the engine started: {room['bytes'] / GiB:.2f} GiB, the start waited "
                    f"{room['wait_s'] * 1e3:.0f} ms for it" + (f" (error: {room['error']})" if room.get("error") else "")
                    if room else "nothing prepared (not unisleep's allocator)")
        lines.append(f"{k.replace('_', ' ')}: {sus.get('copy_bytes', 0) / GiB:.2f} GiB to copy; the arena held "
                     f"{(sus.get('arena_bytes') or 0) / GiB:.2f} GiB ({(sus.get('arena_held_bytes') or 0) / GiB:.2f} GiB "
                     f"of backups) and was {'still growing' if sus.get('arena_growing') else 'not growing'}; {prepared}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights-gib", type=float, default=8.0)
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--weight-tensors", type=int, default=32)
    ap.add_argument("--kv-tensors", type=int, default=16)
    ap.add_argument("--runtime-mib", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="idle seconds between load and the first sleep (vLLM profiles there)")
    ap.add_argument("--backends", default="cumem,unisleep",
                    help="configs, comma-separated: cumem, unisleep, unisleep-backend (see the module docstring)")
    ap.add_argument("--vllm-pkg", help=f"the extracted vLLM: a folder, or a version for vllm_pkg-VERSION/ "
                                       f"(default: ${PKG_ENV}, else vllm_pkg/)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--release-behind", action="store_true",
                    help="unisleep releases a sleep's memory behind its return (UNISLEEP_RELEASE_BEHIND=1); "
                         "the freed-memory checks wait for it (at most 1 s) and the table shows how long it took")
    args = ap.parse_args()
    _setup(args.vllm_pkg)
    from unisleep.vllm_worker import plugin as vllm_plugin

    print("plugin:", vllm_plugin.register())
    contract = Contract()
    print(f"vLLM {contract.version} ({PKG})")
    for note in contract.notes:
        print("note:", note)
    runs = []
    for name in args.backends.split(","):
        print(f"== {name}", flush=True)
        try:
            runs.append(run_backend(name, args, contract))
        except Exception as e:  # report the backend that could not run, keep the other
            import traceback

            traceback.print_exc()
            r = Run(name, args)
            r.check("ran", False, f"{type(e).__name__}: {e}")
            runs.append(r)
    out = summarize(runs, args, contract)
    print(table(out))
    if "unisleep" in out["backends"]:
        bt = breakdown_table(out["backends"]["unisleep"].get("breakdown") or {})
        if bt:
            print(bt)
    for nm, b in out["backends"].items():
        print(nm, "passed" if b["passed"] else "FAILED", json.dumps(b["memory"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(b["passed"] for b in out["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
