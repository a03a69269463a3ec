"""Host memory of the CUDA backend's backups on an NVIDIA GPU (marker ``cuda``): the pinned arena
gives its segments back after a wake under ``host_backups="release"`` (and keeps them, with the
unchanged-weights skip, under ``"keep"``); the torch_memory_saver facade frees a CPU backup at
resume as tms does unless retained, and writes ``set_disk_backup_dir`` backups as files directly
in that directory; the arena's pages lie on the GPU's NUMA node where the host has several; the
host-room check refuses a backup beyond the memory the host has."""

from __future__ import annotations

import os

import pytest
import torch

from unisleep import MemoryLifecycle, numa
from unisleep.compat.torch_memory_saver import TorchMemorySaver
from unisleep.errors import HostBudgetError, HostMemoryError
from unisleep.hostmem import _status_bytes, process_status

pytestmark = pytest.mark.cuda
MiB, GiB = 1 << 20, 1 << 30


def _host(lc) -> int:
    r = lc.backup_resident_bytes()
    return r["pinned"] + r["pageable"] + r["disk"]


@pytest.mark.parametrize("policy", ["keep", "release"])
def test_the_arena_keeps_or_gives_back_its_segments_after_a_wake(policy):
    lc = MemoryLifecycle("cuda", host_backups=policy)
    try:
        w = lc.empty((2 * GiB,), torch.uint8, tag="weights")
        kv = lc.empty((GiB,), torch.uint8, tag="kv_cache")
        w.view(torch.int32).random_()
        kv.fill_(1)
        ref = w.clone()
        lc.sleep(1)
        assert lc.backup_resident_bytes()["pinned"] >= 2 * GiB
        lc.wake_up()
        assert torch.equal(w, ref) and int(kv.max()) == 0
        after = lc.backup_resident_bytes()
        lc.sleep(1)  # unchanged weights
        copied = lc.last_report.bytes_copied
        lc.wake_up()
        assert torch.equal(w, ref)
        if policy == "keep":
            assert after["pinned"] >= 2 * GiB and after["held"] == 2 * GiB
            assert copied == 0  # the retained backup is proven equal: nothing copied
            assert lc.release_host_backups() >= 2 * GiB  # given back on request
            assert _host(lc) == 0
        else:
            assert _host(lc) <= 0.05 * 2 * GiB, lc.backup_resident_bytes()
            assert after == {"pinned": 0, "pageable": 0, "disk": 0, "held": 0}
            assert copied == 2 * GiB
        del w, kv, ref
    finally:
        lc.close()


def test_a_kv_only_wake_keeps_the_weights_backup_until_they_wake():
    lc = MemoryLifecycle("cuda", host_backups="release")
    try:
        w = lc.empty((GiB,), torch.uint8, tag="weights")
        lc.empty((GiB,), torch.uint8, tag="kv_cache")
        w.fill_(7)
        lc.sleep(1)
        lc.wake_up(["kv_cache"])
        assert lc.backup_resident_bytes()["pinned"] >= GiB  # the weights still sleep in it
        lc.wake_up(["weights"])
        assert _host(lc) == 0 and int(w.min()) == 7
        del w
    finally:
        lc.close()


def test_the_facade_frees_a_cpu_backup_at_resume_unless_retained(monkeypatch):
    """tms: a CPU backup is freed at resume unless TMS_RETAIN_CPU_BACKUP / retain_cpu_backup."""
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP", raising=False)
    s = TorchMemorySaver()
    try:
        with s.region(tag="weights", enable_cpu_backup=True):
            w = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda")
        ref = w.clone()
        (lc,) = s.lifecycles()
        s.pause("weights")
        assert lc.backup_resident_bytes()["pinned"] >= GiB
        s.resume("weights")
        assert torch.equal(w, ref)
        assert _host(lc) <= 0.05 * GiB and s.get_cpu_backup(w) is None
        s.retain_cpu_backup = True
        s.pause("weights")
        s.resume("weights")
        assert lc.backup_resident_bytes()["pinned"] >= GiB
        assert torch.equal(s.get_cpu_backup(w), ref.cpu())  # retained: readable after resume
        s.retain_cpu_backup = False
        s.pause("weights")
        s.resume("weights")
        assert _host(lc) <= 0.05 * GiB
        del w, ref
    finally:
        torch.cuda.synchronize()
        s.close()


def test_the_facade_writes_disk_backups_directly_in_the_directory(tmp_path):
    d = tmp_path / "tms-disk"
    s = TorchMemorySaver()
    try:
        s.set_disk_backup_dir(str(d))
        with s.region(tag="w", enable_disk_backup=True):
            big = torch.randn(((64 * MiB) // 4 + 12345,), device="cuda")
            small = torch.full((7,), 10, dtype=torch.uint8, device="cuda")
        oracle = big.cpu().clone()
        for _ in range(2):
            s.pause("w")
            files = os.listdir(d)
            assert len(files) >= 2 and all(os.path.isfile(d / f) for f in files)
            assert sum(os.path.getsize(d / f) for f in files) >= big.numel() * 4
            s.resume("w")
            assert torch.equal(big.cpu(), oracle) and small.tolist() == [10] * 7
            assert os.listdir(d) == []
        del big, small
    finally:
        torch.cuda.synchronize()
        s.close()


def test_arena_pages_lie_on_the_gpus_numa_node():
    lc = MemoryLifecycle("cuda")
    try:
        store = lc.backup_store
        p = store.placement()
        nodes = numa.online_nodes()
        if len(nodes) < 2:
            assert p["bind"] is None and p["why"].startswith("one NUMA node")
            pytest.skip(f"one NUMA node on this host ({nodes}): nothing to place")
        gpu = store.device_numa_node()
        if gpu is None:
            pytest.skip("the GPU's NUMA node is not known (sysfs numa_node reads -1)")
        assert p["bind"] == gpu
        lc.prepare_backup(GiB, background=False)
        pages = store.page_nodes()
        assert pages and sum(1 for n in pages if n == gpu) >= 0.9 * len(pages), (gpu, pages)
    finally:
        lc.close()


def test_a_backup_beyond_host_memory_is_refused_before_anything_is_pinned():
    lc = MemoryLifecycle("cuda")
    try:
        w = lc.empty((GiB,), torch.uint8, tag="weights")
        w.fill_(3)
        pinned0 = _status_bytes(process_status(), "VmPin")
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        with pytest.raises(HostMemoryError) as ei:
            lc.backup_store.ensure_fits(2 * total)
        assert isinstance(ei.value, HostBudgetError) and ei.value.needed >= 2 * total
        assert lc.backup_store.capacity == 0 and _status_bytes(process_status(), "VmPin") == pinned0
        lc.sleep(1)  # what fits still works
        lc.wake_up()
        assert int(w.min()) == 3
        del w
    finally:
        lc.close()


def test_registration_is_not_bound_by_the_locked_memory_limit():
    """The arena does not check RLIMIT_MEMLOCK because cuMemHostRegister is not charged to it:
    a child without CAP_IPC_LOCK, under a 64 MiB limit, registers 256 MiB of arena."""
    import json
    import shutil
    import subprocess
    import sys
    import textwrap

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root the child must drop CAP_IPC_LOCK: needs setpriv (util-linux)")
        prefix = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]
    code = textwrap.dedent("""
        import json, resource
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        lim = 64 << 20 if hard == resource.RLIM_INFINITY else min(64 << 20, hard)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (lim, hard))
        from unisleep import MemoryLifecycle
        from unisleep.hostmem import has_ipc_lock
        lc = MemoryLifecycle("cuda")
        out = {"cap": has_ipc_lock(), "limit": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]}
        try:
            lc.prepare_backup(256 << 20, background=False)
            out["registered"] = lc.backup_resident_bytes()["pinned"]
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        lc.close()
        print(json.dumps(out))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["cap"] is False and res["limit"] <= 64 << 20, res
    assert res.get("registered", 0) >= 256 << 20, res
