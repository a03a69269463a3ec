"""Beside unisleep in ``unisleep bench --backend NAME``: the other libraries run on the same
workload (torch_memory_saver: ``hook_mode="torch"``, ``retain_cpu_backup=True``, pinned
backups, when it is installed), and the copy-bound limits measured in the same run with the
backend's own backup store."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

from unisleep.bench.common import GENERATION_PAUSE_S, TRAINER_TURN_S


def available_peers() -> list[str]:
    return ["torch_memory_saver"] if importlib.util.find_spec("torch_memory_saver") else []


def _device_module(platform: str):
    """(torch device module, torch device type) of ``platform``."""
    import torch

    from unisleep.platform import detect_platform

    kind = detect_platform(platform).torch_device_type
    return torch.get_device_module(kind), kind


def _timer(devmod):
    def t(fn):
        devmod.synchronize()
        t0 = time.perf_counter()
        fn()
        devmod.synchronize()
        return time.perf_counter() - t0

    return t


def run_peer(name: str, platform: str, device: int, weights_gib: float, kv_gib: float, cycles: int) -> dict:
    if name != "torch_memory_saver":
        raise ValueError(name)
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    devmod, kind = _device_module(platform)
    _t = _timer(devmod)
    tms.hook_mode = "torch"
    devmod.set_device(device)
    tms.retain_cpu_backup = True
    W, K = int(weights_gib * 2**30), int(kv_gib * 2**30)
    out: dict = {"impl": name}
    with tms.region(tag="weights", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        w = torch.empty(W, dtype=torch.uint8, device=kind)
    with tms.region(tag="kv_cache"):
        kv = torch.empty(K, dtype=torch.uint8, device=kind)
    w.view(torch.int32).random_()
    ref = w.clone()
    out["first_sleep_s"] = _t(lambda: tms.pause())
    out["first_wake_s"] = _t(lambda: tms.resume())
    ok = bool(torch.equal(w, ref))
    sleeps, wakes = [], []
    for _ in range(cycles):
        w[:4096].add_(1)
        ref[:4096].add_(1)
        sleeps.append(_t(lambda: tms.pause()))
        wakes.append(_t(lambda: tms.resume()))
        ok = ok and bool(torch.equal(w, ref))
    out["steady_sleep_s"], out["steady_wake_s"] = statistics.median(sleeps), statistics.median(wakes)
    un, unw = [], []
    for _ in range(max(2, cycles // 2)):
        time.sleep(GENERATION_PAUSE_S)  # as unisleep's workload (unisleep.bench.device)
        un.append(_t(lambda: tms.pause()))
        unw.append(_t(lambda: tms.resume()))
    out["unchanged_sleep_s"], out["unchanged_wake_s"] = statistics.median(un), statistics.median(unw)
    turn = []
    for _ in range(2):  # as unisleep's workload: the trainer's turn between the sleep and the wake
        w[:4096].add_(1)
        ref[:4096].add_(1)
        time.sleep(GENERATION_PAUSE_S)
        tms.pause()
        time.sleep(TRAINER_TURN_S)
        turn.append(_t(lambda: tms.resume()))
    out["turn_wake_s"] = statistics.median(turn)
    out["verified"] = ok and bool(torch.equal(w, ref))
    print(f"[peer] level-1 done: {out}", file=sys.stderr, flush=True)
    # (tensors are not freed: torch_memory_saver aborts on frees outside a region)
    # level 2: no backups anywhere (the tensors stay referenced: see above)
    with tms.region(tag="l2w"):
        w2 = torch.empty(W, dtype=torch.uint8, device=kind)
    with tms.region(tag="l2kv"):
        kv2 = torch.empty(K, dtype=torch.uint8, device=kind)
    s, a, b = [], [], []
    for _ in range(3):
        time.sleep(GENERATION_PAUSE_S)
        s.append(_t(lambda: (tms.pause("l2w"), tms.pause("l2kv"))))
        a.append(_t(lambda: tms.resume("l2w")))
        b.append(_t(lambda: tms.resume("l2kv")))
    out["l2_sleep_s"], out["l2_wake_weights_s"], out["l2_wake_kv_s"] = map(statistics.median, (s, a, b))
    a, b = [], []
    for _ in range(2):
        time.sleep(GENERATION_PAUSE_S)
        tms.pause("l2w"), tms.pause("l2kv")
        time.sleep(TRAINER_TURN_S)
        a.append(_t(lambda: tms.resume("l2w")))
        b.append(_t(lambda: tms.resume("l2kv")))
    out["turn_l2_wake_weights_s"], out["turn_l2_wake_kv_s"] = statistics.median(a), statistics.median(b)
    out["l2_note"] = "no zeroing on resume"
    return out


def measure_limits(platform: str, device: int, nbytes: int, spill_dir=None) -> dict:
    """Device<->host copy speed through the backup store of ``platform``'s driver (page-locked
    host memory where the backend has it; the spill files in ``spill_dir`` on the host backend),
    in the same process, and (for scale, on an accelerator) how long torch's own pinned
    allocation takes.  The device memory and the store are given back before it returns."""
    import torch

    from unisleep.platform import load_driver

    driver = load_driver(platform, device=device)
    _t = _timer(torch.get_device_module(driver.torch_device.type))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=driver.torch_device)
    dev.fill_(7)
    store = driver.new_backup_store(None, spill_dir)
    t0 = time.perf_counter()
    store.prepare(nbytes, background=False)
    register_s = time.perf_counter() - t0
    d2h, h2d = [], []
    for _ in range(3):
        d2h.append(_t(lambda: (store.save((0, 0), dev), store.flush())))
        h2d.append(_t(lambda: (store.load((0, 0), dev), store.flush())))
    where = store.where
    store.close()
    kind = driver.torch_device.type
    del dev
    driver.close()
    out = {
        "bytes": nbytes,
        "d2h_gbps": nbytes / min(d2h) / 1e9,
        "h2d_gbps": nbytes / min(h2d) / 1e9,
        "register_s": register_s,
        "where": where,
        "notes": f"{where}: {nbytes / 2**30:.2g} GiB prepared in {register_s:.2f} s",
    }
    if kind != "cpu":  # torch's pinned allocator needs an accelerator
        torch.get_device_module(kind).empty_cache()
        t0 = time.perf_counter()
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        out["pin_memory_alloc_s_per_gib"] = time.perf_counter() - t0
        del pinned
        out["notes"] += f"; torch.empty(pin_memory=True) took {out['pin_memory_alloc_s_per_gib']:.2f} s per GiB"
    return out
