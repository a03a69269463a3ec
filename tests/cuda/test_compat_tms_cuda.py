"""unisleep.compat.torch_memory_saver on an NVIDIA GPU (marker ``cuda``): the behaviour of
tests/test_compat_tms.py with torch's own allocations (``torch.empty``/``torch.full`` inside a
region, as tms users write it), memory really freed (``torch.cuda.mem_get_info``), retained
backups, ``expandable_segments``, and CUDA graphs captured through ``cuda_graph`` replaying exactly
after pause/resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from unisleep.compat.torch_memory_saver import TorchMemorySaver
from unisleep.errors import InsufficientMemoryError, InvalidTransitionError

pytestmark = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def tms(monkeypatch):
    monkeypatch.delenv("UNISLEEP_PLATFORM", raising=False)
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP", raising=False)
    monkeypatch.delenv("UNISLEEP_TMS_PREPARE_BACKUP", raising=False)
    s = TorchMemorySaver()
    yield s
    torch.cuda.synchronize()
    s.close()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_region_routes_torch_allocations_and_pause_frees_them(tms):
    with tms.region(tag="kv_cache"):
        kv = torch.full((GiB,), 100, dtype=torch.uint8, device="cuda")
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randint(0, 256, (GiB // 2,), dtype=torch.uint8, device="cuda")
    ref = w.clone()
    ptrs = (kv.data_ptr(), w.data_ptr())
    assert tms.resident_bytes("kv_cache") >= GiB and tms.resident_bytes("weights") >= GiB // 2
    before = _free()
    tms.pause()
    assert _free() - before >= 1.4 * GiB  # the driver sees the memory back
    assert tms.resident_bytes() == 0 and tms.state() == {"kv_cache": "paused", "weights": "paused"}
    tms.resume()
    assert (kv.data_ptr(), w.data_ptr()) == ptrs
    assert torch.equal(w, ref) and int(kv.max()) == 0
    del kv, w, ref


def test_tags_pause_one_and_all(tms):
    with tms.region(tag="type1"):
        t1 = torch.full((256 * MiB,), 1, dtype=torch.uint8, device="cuda")
    with tms.region(tag="type2", enable_cpu_backup=True):
        t2 = torch.full((256 * MiB,), 2, dtype=torch.uint8, device="cuda")
    tms.pause("type1")
    assert tms.resident_bytes("type1") == 0 and int(t2.min()) == 2
    with pytest.raises(InvalidTransitionError):
        tms.pause("type1")
    with pytest.raises(InvalidTransitionError):
        tms.resume("type2")
    tms.pause("type2")
    tms.resume("type2")
    tms.resume("type1")
    assert int(t2.min()) == 2 and int(t1.max()) == 0
    for _ in range(2):
        tms.pause()
        tms.resume()
    assert int(t2.min()) == 2 == int(t2.max())
    del t1, t2


def test_get_cpu_backup_paused_and_retained(tms):
    with tms.region(enable_cpu_backup=True):
        x = torch.randn((10, 20, 30), device="cuda")
    want = x.cpu()
    tms.pause()
    got = tms.get_cpu_backup(x)
    assert got.device.type == "cpu" and got.shape == x.shape and torch.equal(got, want)
    tms.resume()
    assert tms.get_cpu_backup(x) is None  # no retention: only while paused (tms README)
    tms.retain_cpu_backup = True
    tms.pause()
    tms.resume()
    kept = tms.get_cpu_backup(x, zero_copy=True)  # CUDA keeps the backup after resume
    assert kept is not None and torch.equal(kept, want)
    del x


def _host_pointer_is_pinned(cdll, ptr: int) -> bool:
    import ctypes

    get_flags = cdll.cudaHostGetFlags  # the runtime's function, reached through the native library as in tms
    get_flags.argtypes, get_flags.restype = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p], ctypes.c_int
    status = get_flags(ctypes.byref(ctypes.c_uint()), ctypes.c_void_p(ptr))
    if status != 0:
        cdll.cudaGetLastError()
    return status == 0


@pytest.mark.parametrize("paused", [False, True])
def test_retained_backup_is_given_back_with_its_allocation(tms, paused):
    """tms frees an allocation's retained CPU backup when the allocation is freed; the facade
    kept the zero-copy host tensor forever (pageable, so the runtime never knew it either)."""
    import gc

    want = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    with tms.region(tag="freed", enable_cpu_backup=True):
        x = want.to("cuda")
    tms.retain_cpu_backup = True
    tms.pause("freed")
    backup = tms.get_cpu_backup(x, zero_copy=True)
    ptr = backup.data_ptr()
    cdll = tms._impl._binary_wrapper.cdll
    assert torch.equal(backup, want) and _host_pointer_is_pinned(cdll, ptr)
    if not paused:
        tms.resume("freed")
        assert tms.get_cpu_backup(x, zero_copy=True).data_ptr() == ptr
    pool = tms._impl._mem_pools.pop(("freed", True, False, "pinned", torch.cuda.current_device()))
    assert ("freed", True, False, "pinned", 0) not in tms._impl._mem_pools
    del backup
    with tms._impl._with_region_config(tag="freed", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert cdll.tms_get_current_tag() == b"freed" and cdll.tms_get_enable_cpu_backup()
        del x, pool
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert not _host_pointer_is_pinned(cdll, ptr)
    assert tms.resident_bytes("freed") == 0


def test_a_tensor_outliving_its_closed_facade_is_freed_later_without_ending_the_process():
    """close() released each pool and then its allocator while torch still held a segment of it
    (a tensor the program kept): the segment's later free called into the destroyed allocator and
    the process ended (SIGSEGV); and it freed the segment's address, which a new pool could take
    while torch still knew the old block there — a later free then ended the process ("invalid
    device pointer").  In a child process: the risky part."""
    code = """
        import gc, torch
        from unisleep.compat.torch_memory_saver import TorchMemorySaver
        tms = TorchMemorySaver()
        with tms.region(tag="kept", enable_cpu_backup=True):
            x = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
        kept = x.data_ptr()
        tms.close()
        other = TorchMemorySaver()  # a new pool must never get the address torch still holds
        with other.region(tag="next"):
            ys = [torch.full((1 << 20,), 5, dtype=torch.uint8, device="cuda") for _ in range(4)]
        print("address taken again:", any(y.data_ptr() == kept for y in ys))
        del x
        gc.collect()
        torch.cuda.empty_cache()
        print("others intact:", all(int(y.min()) == 5 == int(y.max()) for y in ys))
        other.close()
        del ys
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        print("survived")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stdout[-1000:] + proc.stderr[-3000:])
    assert "address taken again: False" in proc.stdout and "others intact: True" in proc.stdout, proc.stdout


def test_disable_keeps_memory_out_of_the_tag(tms):
    with tms.region(tag="trainer", enable_cpu_backup=True):
        w = torch.full((64 * MiB,), 3, dtype=torch.uint8, device="cuda")
        with tms.disable():
            buf = torch.full((64 * MiB,), 9, dtype=torch.uint8, device="cuda")
    r = tms.resident_bytes("trainer")
    assert 64 * MiB <= r < 128 * MiB
    tms.pause()
    assert int(buf.min()) == 9  # ordinary memory: usable while the tag sleeps
    tms.resume()
    assert int(w.min()) == 3
    del w, buf


def test_disk_backup_and_margin(tms, tmp_path):
    tms.set_disk_backup_dir(str(tmp_path / "disk"))
    with tms.region(tag="d", enable_disk_backup=True):
        t = torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8, device="cuda")
    ref = t.clone()
    tms.pause("d")
    assert tms.get_cpu_backup(t) is None  # disk-backed: no CPU copy, as in tms
    tms.resume("d")
    assert torch.equal(t, ref)
    tms.memory_margin_bytes = torch.cuda.mem_get_info()[1]  # more than can ever be free
    with tms.region(tag="m") as r:
        with pytest.raises(InsufficientMemoryError):
            r.empty((MiB,), torch.uint8)
    tms.memory_margin_bytes = 0
    del t, ref


def _graph_case(tms, enable_cpu_backup: bool):
    """tms's test/examples/cuda_graph.py: a KV cache in a region, a graph with a big
    intermediate captured through cuda_graph(tag="graph"); both paused and resumed."""
    with tms.region(tag="kv_cache", enable_cpu_backup=True):
        kv = torch.randn((5, 10_000_000), device="cuda")
    static_in = torch.zeros((5,), device="cuda")
    holder = {}

    def fn():
        ans = (static_in + kv.mean(dim=1)).mean()
        big = torch.ones((250_000_000,), device="cuda") * ans  # 1 GB intermediate in the graph pool
        holder["out"] = big.mean() + big[:7].sum()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, tag="graph", enable_cpu_backup=enable_cpu_backup):
        fn()
    static_in.fill_(100)
    g.replay()
    first = holder["out"].clone()
    graph_bytes = tms.resident_bytes("graph")
    assert graph_bytes >= 900_000_000  # the intermediate lives in the tag
    before, reserved = _free(), torch.cuda.memory_reserved()
    tms.pause("kv_cache")
    tms.pause("graph")
    freed = _free() - before
    assert freed >= graph_bytes + 150_000_000, (
        f"pause freed {freed} B for a graph tag of {graph_bytes} B + a 200 MB KV cache; torch's own "
        f"cache grew by {torch.cuda.memory_reserved() - reserved} B meanwhile")
    assert tms.resident_bytes("graph") == 0
    tms.resume("graph")
    tms.resume("kv_cache")
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(holder["out"], first)  # bit-exact replay after pause/resume
    # a second capture sharing the first one's pool (as SGLang captures batch sizes) shares the tag
    g2 = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g2, pool=g.pool(), tag="graph", enable_cpu_backup=enable_cpu_backup):
        fn()
    g2.replay()
    second = holder["out"].clone()
    tms.pause()
    tms.resume()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(holder["out"], second)
    del g, g2, holder, kv, static_in


def test_cuda_graph_memory_pauses_and_replays_exactly(tms):
    _graph_case(tms, enable_cpu_backup=False)


def test_cuda_graph_with_cpu_backup_replays_exactly(tms):
    _graph_case(tms, enable_cpu_backup=True)


_FREED_CODE = """
    import json, time, torch
    from unisleep.compat.torch_memory_saver import torch_memory_saver as tms
    MiB = 1 << 20

    def free_settled():
        # cuMemGetInfo once the driver has finished returning released memory (it keeps working
        # for a while after cuMemRelease): three equal reads 20 ms apart, at most 2 s
        torch.cuda.synchronize()
        last, same, t0 = torch.cuda.mem_get_info()[0], 0, time.monotonic()
        while same < 3 and time.monotonic() - t0 < 2.0:
            time.sleep(0.02)
            now = torch.cuda.mem_get_info()[0]
            same, last = (same + 1 if now == last else 0), now
        return last

    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randint(0, 256, (256 * MiB,), dtype=torch.uint8, device="cuda")
    ref = w.clone()
    out = {"resident_before": tms.resident_bytes("weights")}
    for cycle in ("first", "second"):
        free0, cache0 = free_settled(), torch.cuda.memory_reserved()
        tms.pause()
        torch.cuda.synchronize()
        at_once = torch.cuda.mem_get_info()[0] - free0
        out[cycle] = {"freed_at_once": at_once, "freed": free_settled() - free0,
                      "torch_cache_growth": torch.cuda.memory_reserved() - cache0,
                      "resident_while_paused": tms.resident_bytes("weights")}
        tms.resume()
        out[cycle]["exact_after_resume"] = bool(torch.equal(w, ref))
    plain = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # outside any region
    seg = [g for g in torch.cuda.memory_snapshot() if g["address"] <= plain.data_ptr() < g["address"] + g["total_size"]]
    out["outside_is_expandable"] = seg[0].get("is_expandable") if seg else None
    print(json.dumps(out))
"""


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:False"])
def test_expandable_segments_are_accepted(conf):
    """Under expandable segments a region's allocations still go to the tag (the pool switches
    them off inside the region only) and a pause gives the region's memory back to the driver.
    The driver's free memory must grow by the whole region, except what the pause itself left
    in torch's own cache (``memory_reserved``, e.g. a digest's scratch), which is accounted
    exactly; a second pause (nothing new cached) must free the whole region by itself.  The
    backup's pinned host room is taken at region exit (``UNISLEEP_TMS_PREPARE_BACKUP=1``), so
    its registration is not counted as the pause's.  The same script without expandable
    segments is the control."""
    # the backup's host room (pinned, registered with the driver) is taken at region exit, so
    # the pauses measured hold nothing but the pause itself
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, UNISLEEP_TMS_PREPARE_BACKUP="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("UNISLEEP_PLATFORM", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FREED_CODE)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(conf, json.dumps(got))  # the figures, in the run's log
    region = 256 * MiB
    assert got["resident_before"] >= region, got  # torch's allocation went into the tag
    for cycle in ("first", "second"):
        c = got[cycle]
        assert c["resident_while_paused"] == 0 and c["exact_after_resume"], got
        assert c["freed"] + max(0, c["torch_cache_growth"]) >= region, got
    assert got["second"]["freed"] >= region, got
    if conf.endswith("True"):
        assert got["outside_is_expandable"] in (True, None), got  # the user's setting is back outside
