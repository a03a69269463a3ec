"""ROCm backend against the SIMULATED HIP library (tests/sim/fake_hip.py) — no ROCm hardware.

What these prove: the ctypes binding marshals HIP's prototypes and structs correctly for a
library that checks them, the driver obeys HIP's virtual-memory contracts (whole-handle maps
at offset 0, SetAccess after every map, whole-mapping unmaps, release/unmap refcounts), and
each known ROCm trap is handled — by reproducing the trap in the simulator and showing the
driver's workaround defeats it.  What they cannot prove: that real ROCm behaves like the
simulator.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from sim.fake_hip import FakeHip
from unisleep import MemoryLifecycle
from unisleep.errors import PlatformError, UnisleepError, UnsupportedError
from unisleep.backends.rocm import AddressMovedError, FileLimitError, RocmDriver
from unisleep.backends.rocm import config as rocm_config
from unisleep.backends.rocm.hip import HipError

GRAN = 64 << 10
MiB = 1 << 20
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def make(lib=None, **kw):
    lib = lib or FakeHip(granularity=GRAN, total_bytes=64 * MiB)
    kw.setdefault("chunk_bytes", 1 * MiB)
    kw.setdefault("env", {})
    return lib, RocmDriver(lib=lib, tensor_device="cpu", **kw)


@pytest.fixture(params=["simulated"])
def simulated(request):
    lib, drv = make()
    lc = MemoryLifecycle(drv)
    yield lib, drv, lc
    lc.close()
    assert not lib.dev.internal_errors
    lib.close()


def fill(lc, tag, nbytes, seed):
    t = lc.empty(nbytes, torch.uint8, tag=tag)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t, t.clone()


# Level 1/2, wake by tag, discard, read_backup, progressive wake and the undo of a failed sleep
# run over every backend, this one included, in tests/contract/test_driver_contract.py.


def test_rocm_sim_wake_zeroes_only_what_it_does_not_restore():
    """The zeroing decision (vLLM PR #52478 removed its allocator-wide wake memset and zeroes only
    the views read before written; unisleep promises zeros in a discarded tag): a wholly
    discarded region is zeroed, after its chunks are mapped and granted, one hipMemset per
    chunk; a region restored in part from its backup (preserved parameters at level 2) is zeroed
    only in the gaps — the preserved bytes are written once, by their copy.  The SIMULATED
    library hands out stale 0xA5 pages, so a byte left unzeroed shows."""
    lib, drv = make(chunk_bytes=GRAN)
    with MemoryLifecycle(drv) as lc:
        kv = lc.empty(5 * GRAN + 1, torch.uint8, tag="kv_cache")
        kv.fill_(3)
        lc.discard(["kv_cache"])
        lib.dev.log.clear()
        lc.wake_up(["kv_cache"])
        sets = [e for e in lib.dev.log if e[0] == "hipMemset"]
        assert [e[3] for e in sets] == [GRAN] * 6 and int(kv.count_nonzero()) == 0
        first_set = lib.dev.log.index(sets[0])
        assert all(e[0] != "hipMemMap" for e in lib.dev.log[first_set:])  # zeroing after every map

        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(4)])  # 64 KiB each
        lc.adopt(m)
        keep = m[2].weight.detach().clone()
        lc.preserve("2.weight")
        lc.sleep(level=2)
        lib.dev.log.clear()
        lc.wake_up(["weights"])
        zeroed = sum(e[3] for e in lib.dev.log if e[0] == "hipMemset")
        region = lc._state.at(min(p.data_ptr() for p in m.parameters())).region
        assert zeroed == region.size - keep.numel() * keep.element_size()  # not the preserved bytes
        assert torch.equal(m[2].weight, keep)
        assert all(int(m[i].weight.count_nonzero()) == 0 for i in (0, 1, 3))
    lib.close()


def test_rocm_sim_zero_is_an_explicit_synchronised_step():
    lib, drv = make()
    with MemoryLifecycle(drv) as lc:
        t = lc.empty(1 * MiB, torch.uint8, tag="kv_cache")
        t.fill_(9)
        drv.zero(t.data_ptr(), t.numel())
        assert int(t.count_nonzero()) == 0  # memset is deferred in the simulator until a sync
        names = [e[0] for e in lib.dev.log]
        last_set = max(i for i, n in enumerate(names) if n == "hipMemset")
        assert "hipDeviceSynchronize" in names[last_set + 1 :]
    lib.close()


def test_rocm_sim_chunking_one_handle_per_chunk_offset_zero():
    lib, drv = make(chunk_bytes=None, env={rocm_config.CHUNK_ENV: "1"})
    assert drv.config.chunk_bytes == 1 * MiB
    with MemoryLifecycle(drv) as lc:
        t = lc.empty(5 * MiB + 1, torch.uint8, tag="weights")
        maps = [e for e in lib.dev.log if e[0] == "hipMemMap"]
        assert len(maps) == 6 == lib.dev.calls["hipMemCreate"]
        assert all(e[3] == 0 for e in maps)  # offset argument
        assert sorted(e[2] for e in maps) == [64 << 10] + [MiB] * 5  # 5 MiB + 1 byte -> 5 x 1 MiB + 64 KiB
        sets = [e for e in lib.dev.log if e[0] == "hipMemSetAccess"]
        assert len(sets) == 1 and sets[0][1] == t.data_ptr() and sets[0][2] == 5 * MiB + GRAN
        lc.sleep(level=2)
        assert lib.dev.calls["hipMemUnmap"] == 6 == lib.dev.calls["hipMemRelease"]
        lc.wake_up()
        assert len([e for e in lib.dev.log if e[0] == "hipMemSetAccess"]) == 2  # again after remap
    lib.close()


# VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE as vLLM's C++ reads it (strtoull base 0, MiB; nothing parsed,
# a range error, 0 or a byte overflow -> 256): value -> (MiB, vLLM falls back)
VLLM_READS = {
    None: (256, False),
    "96": (96, False), "384": (384, False), "1000": (1000, False), "64": (64, False),
    "0x400": (1024, False), "064": (52, False), "64MB": (64, False), "1_024": (1, False),
    " 128": (128, False), "+32": (32, False), "1.5": (1, False),
    "0": (256, True), "-1": (256, True), "abc": (256, True), "": (256, True), "0o100": (256, True),
    "99999999999999999999999": (256, True), str(1 << 44): (256, True), str((1 << 44) - 1): ((1 << 44) - 1, False),
}


@pytest.mark.parametrize("value", list(VLLM_READS), ids=repr)
def test_rocm_chunk_size_env_is_read_like_vllm(value, caplog):
    mib, falls_back = VLLM_READS[value]
    env = {} if value is None else {rocm_config.CHUNK_ENV: value}
    with caplog.at_level("WARNING", logger="unisleep.rocm"):
        assert rocm_config.chunk_bytes_from_env(env) == mib * MiB
    warned = [r.getMessage() for r in caplog.records if rocm_config.CHUNK_ENV in r.getMessage()]
    fallback = [m for m in warned if "default" in m]
    assert bool(fallback) == falls_back, warned  # a warning exactly where vLLM silently falls back
    odd = not falls_back and value is not None and mib & (mib - 1) != 0
    # a size vLLM takes but its guide advises against (not a power of 2): taken, and said
    assert bool([m for m in warned if "power of 2" in m]) == odd, warned
    problem = rocm_config.chunk_env_problem(env)
    if falls_back:
        assert "ignored by vLLM" in problem
    elif value is not None and value.strip() != str(mib):
        assert f"reads as {mib} MiB" in problem  # octal, trailing characters...: said by the doctor
    elif odd:
        assert "recommends a power of 2" in problem
    else:
        assert problem is None


@pytest.mark.parametrize("size_mib,chunk_mib,gran", [(10, 3, 2 << 20), (1000, 96, 2 << 20), (7, 1000, 2 << 20),
                                                    (384, 384, 2 << 20), (5, 1, 64 << 10), (9, 4, 4 << 20)])
def test_rocm_chunks_are_vllms_chunks(size_mib, chunk_mib, gran):
    """The same value gives the same chunks as vLLM's ``my_malloc``: the chunk is rounded up to
    the granularity, ceil(size / chunk) chunks, the last one the remainder."""
    from unisleep.region import chunk_sizes, round_up

    aligned = round_up(size_mib * MiB, gran)
    chunk = round_up(chunk_mib * MiB, gran)
    n = (aligned + chunk - 1) // chunk
    vllm = [min(aligned - i * chunk, chunk) for i in range(n)]
    assert chunk_sizes(aligned, chunk_mib * MiB, gran) == vllm


def test_rocm_sim_any_chunk_size_maps_like_vllm():
    lib = FakeHip(granularity=2 * MiB, total_bytes=64 * MiB)
    _, drv = make(lib, chunk_bytes=None, env={rocm_config.CHUNK_ENV: "3"})
    with MemoryLifecycle(drv) as lc:
        lc.empty(10 * MiB, torch.uint8, tag="weights")
        assert [e[2] for e in lib.dev.log if e[0] == "hipMemCreate"] == [4 * MiB, 4 * MiB, 2 * MiB]
    lib.close()


@pytest.mark.parametrize("version", [60200000, 70200000], ids=["hip-6.2", "hip-7.2"])
def test_rocm_sim_progressive_wake_grants_access_as_the_runtime_allows(version):
    """A progressive wake maps chunk by chunk.  ROCm 7.2 rejects hipMemSetAccess at a non-zero
    offset of a reservation (rocm-systems PR #9360; SIMULATED by the HIP 7.2 profile), ROCr 6.x
    wants the range to start at a mapped handle (the 6.2 profile).  In module order (a later
    chunk first) and in adoption order, every byte comes back, and on 7.2 every grant starts at
    the region's start."""
    lib = FakeHip(granularity=GRAN, total_bytes=64 * MiB, runtime_version=version)
    _, drv = make(lib, chunk_bytes=GRAN)  # one 64 KiB weight per chunk
    lc = MemoryLifecycle(drv)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(6)])
    lc.adopt(m)
    ref = [p.detach().clone() for p in m.parameters()]
    base = min(p.data_ptr() for p in m.parameters())
    for order in ([m[4], m[1]], None):
        lc.sleep(level=1)
        lib.dev.log.clear()
        lc.wake_up(["weights"], progressive=True, order=order)
        lc.wait()
        assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
        grants = [e for e in lib.dev.log if e[0] == "hipMemSetAccess"]
        assert grants and not [e for e in lib.dev.log if e[0] == "error"], lib.dev.log
        if version >= 70200000:
            assert {e[1] for e in grants} == {base}
    if version >= 70200000:  # several workers cannot each grant from the start: refused, nothing changed
        with pytest.raises(UnisleepError, match="progressive_workers=2 .*rocm-systems PR #9360"):
            drv.configure(progressive_workers=2)
        assert drv.config.progressive_workers == 1
    else:
        drv.configure(progressive_workers=2)
    del m
    lc.close()
    assert not lib.dev.internal_errors and not lib.dev.reservations
    lib.close()


def test_rocm_sim_every_call_runs_on_the_drivers_device_whatever_the_thread():
    """HIP's current device is per thread (device 0 until set) and CLR allocates and checks
    copies against it (SIMULATED by FakeHip: hipMemCreate lands on the current device, hipMemcpy
    and hipMemset refuse memory the current device holds no access to).  A driver of device 1
    driven from other threads — a background sleep, a progressive wake, the release thread —
    and from a thread whose current device another driver changed: every byte comes back, all
    memory is device 1's."""
    import threading

    lib = FakeHip(granularity=GRAN, total_bytes=64 * MiB, device_count=2)
    _, drv = make(lib, device=1)
    _, drv0 = make(lib, device=0)
    lc = MemoryLifecycle(drv)
    lc.driver.configure(release_behind=True)
    w, w0 = fill(lc, "weights", 3 * MiB, 21)
    kv, _ = fill(lc, "kv_cache", 1 * MiB, 22)
    lc.sleep(level=1, background=True)
    lc.wait()
    lc.wake_up(progressive=True)
    lc.wait()
    assert torch.equal(w, w0) and int(kv.count_nonzero()) == 0
    drv0.reserve(GRAN)  # this thread's current device is now 0
    lc.sleep(level=1)
    t = threading.Thread(target=lc.wake_up)
    t.start()
    t.join(60)
    assert torch.equal(w, w0)
    assert {p.device for p in lib.dev.phys.values() if not p.freed} == {1}
    assert not [e for e in lib.dev.log if e[0] == "error"], [e for e in lib.dev.log if e[0] == "error"][:3]
    del w, w0, kv
    lc.close()
    assert not lib.dev.internal_errors
    lib.close()


@pytest.mark.parametrize("workaround", [False, True], ids=["simulated-bug-without-workaround", "simulated-with-workaround"])
def test_rocm_sim_memory_kept_while_reserved(workaround):
    """ROCm/ROCm#6021: unmap+release frees nothing while the address stays reserved."""
    lib = FakeHip(granularity=GRAN, total_bytes=10 * MiB)
    _, drv = make(lib, rereserve_on_sleep=workaround)
    lc = MemoryLifecycle(drv)
    w, w0 = fill(lc, "weights", 6 * MiB, 6)
    va = w.data_ptr()
    lc.sleep(level=1)
    free, total = drv.memory_info()
    if not workaround:
        assert total - free == 6 * MiB and lib.dev.live_fds == 6  # the bug, reproduced
        fill(lc, "other", 2 * MiB, 1)  # fits beside it...
        with pytest.raises(UnisleepError, match="hipErrorOutOfMemory"):
            lc.wake_up()  # ...but the wake needs 6 MiB more: OOM although "free"
    else:
        assert free == total and lib.dev.live_fds == 0
        log = [e for e in lib.dev.log if e[0] in ("hipMemAddressFree", "hipMemAddressReserve")]
        assert log[-2][:3] == ("hipMemAddressFree", va, 6 * MiB)
        assert log[-1][0] == "hipMemAddressReserve" and log[-1][4] == va  # re-reserved at the same address
        fill(lc, "other", 2 * MiB, 1)
        lc.wake_up()
        assert torch.equal(w, w0) and w.data_ptr() == va
    del w, w0
    lc.close()
    assert not lib.dev.internal_errors and not lib.dev.reservations
    lib.close()


def test_rocm_sim_rereserve_refuses_a_moved_address(monkeypatch):
    """The race the probe cannot rule out: another allocation takes a region's freed address."""
    from unisleep.backends import _native
    from unisleep.backends.host import libc

    monkeypatch.setattr(_native, "_FALLBACKS", [])  # this process's record, restored afterwards
    lib, drv = make()
    lc = MemoryLifecycle(drv)
    w, _ = fill(lc, "weights", 1 * MiB, 7)
    taken = []

    def intruder(va, size):  # another allocation lands on the freed range (the region, not the probe)
        if size == 1 * MiB:
            taken.append(libc.mmap(va, size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | 0x100000))

    lib.dev.intruder = intruder
    with pytest.raises(UnisleepError, match=f"AddressMovedError: re-reserving .* at {hex(w.data_ptr())}"):
        lc.sleep(level=1)
    assert lc.state()["weights"] == "lost"  # never "awake" over a range someone else holds
    lib.dev.intruder = None
    assert taken and taken[0] == w.data_ptr()
    assert not lib.dev.reservation_of(w.data_ptr())  # the moved reservation was given back, not used
    assert drv.kept_reason and hex(w.data_ptr()) in drv.kept_reason  # later sleeps keep reservations
    with pytest.raises(AddressMovedError, match="someone else"):  # never mapped into the taken range
        drv.map(w.data_ptr(), 1 * MiB, drv.create(1 * MiB))
    libc.munmap(taken[0], 1 * MiB)
    lib.close()


@pytest.mark.slow
def test_rocm_sim_close_after_a_moved_address_never_frees_it():
    """After AddressMovedError the region's range is someone else's: closing the lifecycle must
    not hipMemAddressFree it — the 6.2-era HIP runtime dereferences a null pointer there (the
    SIMULATED library ends the process with SIGABRT).  Run in a child process for that reason."""
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {TESTS!r})
        from sim.fake_hip import FakeHip
        from unisleep import MemoryLifecycle
        from unisleep.backends.host import libc
        from unisleep.backends.rocm import RocmDriver
        from unisleep.errors import UnisleepError
        lib = FakeHip(granularity={GRAN}, total_bytes=64 << 20)
        lc = MemoryLifecycle(RocmDriver(lib=lib, tensor_device="cpu", chunk_bytes=1 << 20, env={{}}))
        w = lc.empty(1 << 20, torch.uint8, tag="weights")
        taken = []
        def intruder(va, size):
            if size == 1 << 20:
                taken.append(libc.mmap(va, size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | 0x100000))
        lib.dev.intruder = intruder
        try:
            lc.sleep(level=1)
        except UnisleepError as e:
            print("moved:", "AddressMovedError" in str(e))
        lib.dev.intruder = None
        del w
        lc.close()
        print("closed; range still the intruder's:", bool(taken) and libc.munmap(taken[0], 1 << 20) is None)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.split("\n")[:2] == ["moved: True", "closed; range still the intruder's: True"], out.stdout


def test_rocm_sim_runtime_that_moves_reservations_keeps_them_visibly(monkeypatch):
    """A runtime that does not re-reserve a freed address in place (simulated): the probe sees it
    before any region is freed; sleep keeps the reservations, and says so everywhere."""
    from unisleep.backends import _native
    from unisleep.backends._native import fallback_warnings
    from unisleep.doctor import collect

    monkeypatch.setattr(_native, "_FALLBACKS", [])  # this process's record, restored afterwards
    lib = FakeHip(granularity=GRAN, total_bytes=16 * MiB, ignore_address_hint=True)
    _, drv = make(lib)
    lc = MemoryLifecycle(drv)
    w, w0 = fill(lc, "weights", 2 * MiB, 8)
    kv, _ = fill(lc, "kv_cache", 1 * MiB, 9)
    addrs = (w.data_ptr(), kv.data_ptr())
    frees = lib.dev.calls.get("hipMemAddressFree", 0)
    lc.sleep(level=1)
    assert lib.dev.calls.get("hipMemAddressFree", 0) == frees + 2  # the probe's two, never a region's
    assert "returned" in drv.kept_reason
    assert drv.last_sleep_kept == {"bytes": 3 * MiB, "regions": 2, "reason": drv.kept_reason}
    assert lib.dev.used_bytes == 3 * MiB  # memory not returned (this ROCm holds it while reserved)...
    assert lc.last_report.bytes_released == 0  # ...and the report does not claim it was
    assert any("3.00 MiB in 2 region(s) not returned" in n for n in lc.last_report.notes), lc.last_report.notes
    assert "not returned to the device" in str(lc.last_report)
    assert any(drv.kept_reason in m for m in fallback_warnings())
    assert any(drv.kept_reason in m for m in collect()["warnings"])  # unisleep doctor, same process
    lc.wake_up()
    assert torch.equal(w, w0) and int(kv.count_nonzero()) == 0 and (w.data_ptr(), kv.data_ptr()) == addrs
    del w, kv
    lc.close()
    assert not lib.dev.reservations and lib.dev.used_bytes == 0 and not lib.dev.internal_errors
    lib.close()


def test_rocm_sim_hip_5_2_struct_layout_is_chosen_by_runtime_version():
    """HIP 5.2 laid out hipMemAllocationProp differently; the simulator reads the struct with the
    declaration for the version it reports, so a driver passing the other layout would fail."""
    from unisleep.backends.rocm import hip

    lib = FakeHip(granularity=GRAN, total_bytes=16 * MiB, runtime_version=50221153)
    _, drv = make(lib)
    assert drv.api.runtime_version == 50221153 and drv.api.Prop is hip.hipMemAllocationProp_v5_2
    with MemoryLifecycle(drv) as lc:
        w, w0 = fill(lc, "weights", 1 * MiB, 10)
        lc.sleep(level=1)
        lc.wake_up()
        assert torch.equal(w, w0)
    assert not lib.dev.internal_errors and "error" not in [e[0] for e in lib.dev.log]
    lib.close()
    # the control: the >= 5.3 layout handed to a 5.2 runtime is refused by the simulator
    lib = FakeHip(granularity=GRAN, runtime_version=50221153)
    api = hip.HipApi(lib)
    prop = hip.hipMemAllocationProp(type=hip.hipMemAllocationTypePinned)
    prop.location.type = hip.hipMemLocationTypeDevice
    g = ctypes.c_size_t()
    assert api.hipMemGetAllocationGranularity(ctypes.byref(g), ctypes.cast(ctypes.byref(prop), ctypes.POINTER(api.Prop)),
                                              0) == hip.hipErrorInvalidValue
    lib.close()


def test_rocm_sim_no_device_is_a_named_error():
    from unisleep.backends.rocm.hip import HipNoDeviceError

    lib = FakeHip(granularity=GRAN, device_count=0)
    with pytest.raises(HipNoDeviceError, match="sees no AMD GPU.*hipErrorNoDevice.*/dev/kfd"):
        RocmDriver(lib=lib, tensor_device="cpu", env={})
    lib.close()
    lib = FakeHip(granularity=GRAN, device_count=1)
    with pytest.raises(HipNoDeviceError, match="device 3 was asked for.*1 AMD GPU"):
        RocmDriver(3, lib=lib, tensor_device="cpu", env={})
    lib.close()


def test_rocm_sim_reserve_alignment_retry():
    lib = FakeHip(granularity=GRAN, total_bytes=16 * MiB, fail_aligned_reserve=True)
    _, drv = make(lib)
    with MemoryLifecycle(drv) as lc:
        t = lc.empty(1 * MiB, torch.uint8, tag="weights")
        res = [e for e in lib.dev.log if e[0] == "hipMemAddressReserve"]
        assert res[0][3] == GRAN and res[1][3] == 0  # aligned attempt failed, retried with 0
        assert ("error", "hipMemAddressReserve", 2) == lib.dev.log[lib.dev.log.index(res[0]) + 1][:3]
        assert t.data_ptr() % GRAN == 0
    lib.close()
    lib = FakeHip(granularity=GRAN, total_bytes=16 * MiB, fail_aligned_reserve=True, unaligned_fallback=True)
    _, drv = make(lib)
    with pytest.raises(UnisleepError, match="not aligned"):
        drv.reserve(1 * MiB)
    assert not lib.dev.reservations  # the misaligned range was given back
    lib.close()


def test_rocm_sim_file_limit_is_raised_when_allowed():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    low = open_now + 80
    if hard != resource.RLIM_INFINITY and hard < low + 200:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} leaves no room for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        lib = FakeHip(granularity=GRAN, total_bytes=64 * MiB)
        _, drv = make(lib, chunk_bytes=GRAN)
        with MemoryLifecycle(drv) as lc:
            lc.empty(200 * GRAN, torch.uint8, tag="kv_cache")  # 200 handles = 200 descriptors
            assert lib.dev.live_fds == 200
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low
        lib.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_rocm_sim_file_limit_refused_with_the_fix():
    code = textwrap.dedent(
        f"""
        import json, os, resource, sys
        sys.path.insert(0, {TESTS!r})
        import torch
        from sim.fake_hip import FakeHip
        from unisleep import MemoryLifecycle
        from unisleep.backends.rocm import RocmDriver, FileLimitError
        n = len(os.listdir("/proc/self/fd")) + 90
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        lib = FakeHip(granularity={GRAN}, total_bytes=64 << 20)
        lc = MemoryLifecycle(RocmDriver(lib=lib, chunk_bytes={GRAN}, tensor_device="cpu", env={{}}))
        try:
            lc.empty(200 * {GRAN}, torch.uint8, tag="kv_cache")
            print(json.dumps({{"ok": True}}))
        except FileLimitError as e:
            print(json.dumps({{"ok": False, "msg": str(e), "left": lib.dev.live_fds, "used": lib.dev.used_bytes}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] is False
    assert "ulimit -n" in res["msg"] and rocm_config.CHUNK_ENV in res["msg"]
    assert res["left"] == 0 and res["used"] == 0  # the partial region was unwound


@pytest.mark.parametrize(
    "env,bad",
    [
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, True),
        ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0, 1"}, False),
        ({"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}, False),
        ({"ROCR_VISIBLE_DEVICES": "2", "HIP_VISIBLE_DEVICES": "1"}, True),
        ({"ROCR_VISIBLE_DEVICES": "4,5", "CUDA_VISIBLE_DEVICES": "3"}, True),
        ({"ROCR_VISIBLE_DEVICES": "4,5"}, False),
    ],
)
def test_rocm_sim_visible_device_variables(env, bad):
    lib = FakeHip(granularity=GRAN)
    if bad:
        with pytest.raises(PlatformError, match="VISIBLE_DEVICES"):
            RocmDriver(lib=lib, tensor_device="cpu", env=env)
    else:
        RocmDriver(lib=lib, tensor_device="cpu", env=env)
    lib.close()


def test_rocm_sim_simulator_is_strict():
    """A lax simulator would prove nothing: misuse returns HIP's error codes."""
    lib, drv = make()
    api = drv.api
    va = drv.reserve(4 * GRAN)
    h = drv.create(2 * GRAN)
    assert api.hipMemMap(va, 2 * GRAN, GRAN, h.ptr, 0) == 1  # offset must be 0
    assert api.hipMemMap(va, GRAN, 0, h.ptr, 0) == 1  # whole handle only
    drv.map(va, 2 * GRAN, h)
    assert api.hipMemset(va, 0, GRAN) == 1  # no access granted yet
    assert api.hipMemUnmap(va, GRAN) == 1  # sub-range unmap
    drv.set_access(va, 2 * GRAN)
    drv.release(h)  # released while mapped: memory stays until unmapped
    assert lib.dev.used_bytes == 2 * GRAN
    drv.unmap(va, 2 * GRAN)
    assert lib.dev.used_bytes == 2 * GRAN  # and, on this ROCm, until the address is freed
    drv.free_address(va, 4 * GRAN)
    assert lib.dev.used_bytes == 0 and lib.dev.live_fds == 0
    assert api.hipMemCreate(ctypes.byref(ctypes.c_void_p()), GRAN + 1, ctypes.byref(drv._prop), 0) == 1
    assert not lib.dev.internal_errors
    lib.close()


def test_rocm_sim_no_library_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("ROCM_PATH", "/nonexistent")
    from unisleep.backends.rocm import hip

    monkeypatch.setattr(hip, "library_candidates", lambda: ["/nonexistent/lib/libamdhip64.so"])
    with pytest.raises(PlatformError, match="libamdhip64"):
        RocmDriver(env={})


@pytest.mark.slow
def test_rocm_sim_lazy_vendor_imports():
    code = (
        "import sys, unisleep, unisleep.backends.host, unisleep.backends.rocm, unisleep.backends.ascend\n"
        "maps = open('/proc/self/maps').read()\n"
        "bad = [m for m in ('torch_npu', 'amdsmi', 'acl') if m in sys.modules]\n"
        "bad += [l for l in ('libamdhip64', 'libascendcl', 'libamd_smi') if l in maps]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_rocm_sim_detection_survives_amdsmi_keyerror(monkeypatch):
    """``import amdsmi`` without libamd_smi.so raises KeyError; detection must go on."""
    import importlib.abc
    import importlib.machinery

    from unisleep import platform as plat

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise KeyError("libamd_smi.so")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            return importlib.machinery.ModuleSpec("amdsmi", Loader()) if name == "amdsmi" else None

    monkeypatch.setattr(sys, "meta_path", [Finder()] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.delenv(plat.ENV_OVERRIDE, raising=False)
    from unisleep.backends.ascend import detect as ascend_detect
    from unisleep.backends.rocm import detect as rocm_detect

    monkeypatch.setattr(rocm_detect, "torch_version", lambda attr: "6.2.41133" if attr == "hip" else None)
    monkeypatch.setattr(ascend_detect, "detect", lambda: None)
    real_exists = os.path.exists
    monkeypatch.setattr(rocm_detect.os.path, "exists", lambda p: True if p == "/dev/kfd" else real_exists(p))
    p = plat.detect_platform()  # a probe that raised would make this "host"
    assert p.name == "rocm" and "HIP 6.2" in p.reason and "/dev/kfd" in p.reason


def test_rocm_sim_doctor_warnings(monkeypatch):
    from unisleep.platform import Platform, environment_warnings

    rocm = Platform("rocm", "simulated")
    for v in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", rocm_config.CHUNK_ENV):
        monkeypatch.delenv(v, raising=False)
    assert any(rocm_config.CHUNK_ENV in w for w in environment_warnings(rocm))
    monkeypatch.setenv(rocm_config.CHUNK_ENV, "64MB")
    assert any("reads as 64 MiB" in w for w in environment_warnings(rocm))
    monkeypatch.setenv(rocm_config.CHUNK_ENV, "0")
    assert any("ignored by vLLM" in w for w in environment_warnings(rocm))
    monkeypatch.setenv(rocm_config.CHUNK_ENV, "128")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    assert environment_warnings(rocm) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert any("disagree" in w for w in environment_warnings(rocm))


def test_chunk_sweep_host_cli(tmp_path, capsys):
    """The tuning tool for the chunk size runs the shared policy on a real driver (host here)."""
    from unisleep.bench import chunk_sweep

    out = tmp_path / "sweep.json"
    rc = chunk_sweep.main(["--platform", "host", "--total", "16MiB", "--chunks", "1,4,one", "--repeat", "1",
                           "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [r["chunks"] for r in rows] == [16, 4, 1]
    assert all(r["map_s"] > 0 and r["unmap_s"] > 0 for r in rows)
    assert "handles" in capsys.readouterr().out


def test_rocm_sim_chunk_sweep_on_simulated_driver():
    from unisleep.bench.chunk_sweep import sweep_one

    lib, drv = make()
    r = sweep_one(drv, 8 * MiB, 1 * MiB, 2)
    assert r["chunks"] == 8 and lib.dev.calls["hipMemCreate"] == 16 and lib.dev.used_bytes == 0
    assert not lib.dev.reservations and not lib.dev.internal_errors
    lib.close()


def _rocm_present() -> bool:
    from unisleep.platform import detect_platform

    try:
        return detect_platform().name == "rocm"
    except Exception:
        return False


@pytest.mark.rocm
@pytest.mark.skipif(not _rocm_present(), reason="needs an AMD GPU with ROCm (.github/workflows/rocm.yml runs it on an MI325X runner)")
def test_rocm_hardware_lifecycle():
    """NOT RUN in this project so far: the same scenario on a real AMD GPU, with the ROCm
    trap checked where it matters — hipMemGetInfo must show the memory returned."""
    lc = MemoryLifecycle("rocm")
    try:
        dev = lc.torch_device
        w = lc.empty((64 * MiB,), torch.uint8, tag="weights")
        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device=dev))
        w0 = w.clone()
        kv = lc.empty((256 * MiB,), torch.uint8, tag="kv_cache")
        kv.fill_(9)
        ptrs = (w.data_ptr(), kv.data_ptr())
        free_awake, _ = lc.driver.memory_info()
        lc.sleep(level=1)
        free_asleep, _ = lc.driver.memory_info()
        assert free_asleep - free_awake >= 0.9 * lc.allocated_bytes()
        lc.wake_up(["weights"])
        assert torch.equal(w, w0)
        lc.wake_up(["kv_cache"])
        assert int(kv.count_nonzero()) == 0 and (w.data_ptr(), kv.data_ptr()) == ptrs
    finally:
        lc.close()


# ---------------------------------------------------------------------------- pool (simulated)
@pytest.mark.slow
def test_rocm_sim_pool_callbacks_put_torch_segments_in_the_tag(simulated):
    """The pool's allocator callbacks (what torch calls for each segment inside ``pool(tag)``)
    on the SIMULATED HIP library: a segment becomes a region of the tag, sleeps and wakes with
    it, and torch's free gives back its memory and its address."""
    from unisleep.backends._pool import TagAllocator

    lib, drv, lc = simulated
    bound = []
    hooks = TagAllocator(drv, lc, "kv_cache", lambda: bound.append(True))
    va = hooks.malloc(3 * MiB + 5)
    assert va and bound and lc.tags == ["kv_cache"]
    assert lc.allocated_bytes("kv_cache") >= 3 * MiB and lib.dev.used_bytes == lc.allocated_bytes()
    assert lib.dev.reservation_of(va) is not None
    lc.sleep(2)
    assert lib.dev.used_bytes == 0 and lc.resident_bytes("kv_cache") == 0
    lc.wake_up()
    assert lib.dev.used_bytes == lc.allocated_bytes("kv_cache")
    lc.sleep(2)
    hooks.free(va)  # torch frees a segment while its tag sleeps: only the address is given back
    assert lib.dev.used_bytes == 0 and lib.dev.reservation_of(va) is None and lc.allocated_bytes() == 0
    hooks.free(va)  # a second free of the same pointer is ignored
    assert hooks.malloc(1 << 40) == 0  # more than the device has: NULL (torch's OOM), nothing registered
    assert lc.allocated_bytes() == 0 and lib.dev.used_bytes == 0 and not lib.dev.reservations


def test_rocm_sim_pool_says_why_it_cannot_route(simulated):
    lib, drv, lc = simulated
    assert drv.capabilities.supports_pool is False  # host-backed simulated memory: torch never hands it out
    with pytest.raises(UnsupportedError, match="simulated HIP library"):
        with lc.pool("kv_cache"):
            pass
    assert not lc.tags and lib.dev.used_bytes == 0


# ---------------------------------------------------------------------------- amdsmi (simulated)
class FakeAmdSmi:
    """A SIMULATED amdsmi module (the real one needs libamd_smi.so and AMD GPUs): four GPUs whose
    handle order (amdsmi's) differs from their HIP order (``hip_id``)."""

    def __init__(self, fail_at=None, enumeration=True):
        self.calls, self.fail_at, self.enumeration = [], fail_at, enumeration
        # (handle, hip_id, uuid, market name)
        self.gpus = [("h0", 2, "GPU-cc", "MI300X c"), ("h1", 0, "GPU-aa", "MI300X a"),
                     ("h2", 3, "GPU-dd", "MI300X d"), ("h3", 1, "GPU-bb", "MI300X b")]

    def _call(self, name):
        self.calls.append(name)
        if name == self.fail_at:
            raise RuntimeError(f"simulated amdsmi failure in {name}")

    def amdsmi_init(self):
        self._call("amdsmi_init")

    def amdsmi_shut_down(self):
        self._call("amdsmi_shut_down")

    def amdsmi_get_processor_handles(self):
        self._call("amdsmi_get_processor_handles")
        return [g[0] for g in self.gpus]

    def _gpu(self, h):
        return next(g for g in self.gpus if g[0] == h)

    def __getattr__(self, name):
        if name == "amdsmi_get_gpu_enumeration_info" and self.enumeration:
            return lambda h: {"hip_id": self._gpu(h)[1], "hip_uuid": self._gpu(h)[2], "drm_card": 0}
        raise AttributeError(name)

    def amdsmi_get_gpu_asic_info(self, h):
        return {"market_name": self._gpu(h)[3]}

    def amdsmi_get_gpu_vram_usage(self, h):
        return {"vram_total": 192 * 1024, "vram_used": 1024}


@pytest.mark.parametrize("env,names", [
    ({}, ["MI300X a", "MI300X b", "MI300X c", "MI300X d"]),
    ({"HIP_VISIBLE_DEVICES": "2,0"}, ["MI300X c", "MI300X a"]),
    ({"ROCR_VISIBLE_DEVICES": "3,1"}, ["MI300X d", "MI300X b"]),
    ({"ROCR_VISIBLE_DEVICES": "3,1,2", "HIP_VISIBLE_DEVICES": "2"}, ["MI300X c"]),
    ({"ROCR_VISIBLE_DEVICES": "GPU-dd,GPU-aa"}, ["MI300X d", "MI300X a"]),
    ({"CUDA_VISIBLE_DEVICES": "1"}, ["MI300X b"]),
])
def test_rocm_amdsmi_devices_are_numbered_as_hip_numbers_them(monkeypatch, env, names):
    from unisleep.backends.rocm import detect as plat

    fake = FakeAmdSmi()
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    for v in rocm_config.VISIBLE_VARS:
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    devs = plat.amdsmi_devices()
    assert [d.name for d in devs] == names and [d.index for d in devs] == list(range(len(names)))
    assert fake.calls[-1] == "amdsmi_shut_down"


@pytest.mark.parametrize("fail_at", ["amdsmi_get_processor_handles", None])
def test_rocm_amdsmi_is_always_shut_down(monkeypatch, fail_at):
    from unisleep.backends.rocm import detect as plat

    fake = FakeAmdSmi(fail_at=fail_at)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    plat.amdsmi_devices()
    assert fake.calls[0] == "amdsmi_init" and fake.calls[-1] == "amdsmi_shut_down"


def test_rocm_amdsmi_without_enumeration_info_is_not_guessed(monkeypatch):
    from unisleep.backends.rocm import detect as plat

    monkeypatch.setitem(sys.modules, "amdsmi", FakeAmdSmi(enumeration=False))
    for v in rocm_config.VISIBLE_VARS:
        monkeypatch.delenv(v, raising=False)
    assert len(plat.amdsmi_devices()) == 4  # nothing hidden: amdsmi's order is all there is
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert plat.amdsmi_devices() == ()  # which one is visible cannot be told: none is claimed


def test_rocm_vllm_allocator_fails_closed_when_the_pool_cannot_route():
    """vLLM with unisleep's allocator on a ROCm driver that cannot route torch's allocations
    (here: the simulated library; on a machine: a torch that is not a ROCm build) is refused when
    vLLM asks for the allocator — never a sleep that frees 0 bytes."""
    from unisleep.vllm_worker import plugin as vllm_plugin
    from unisleep.vllm_worker.allocator import UnisleepAllocator

    lib, drv = make()
    UnisleepAllocator.reset_instance()
    UnisleepAllocator.instance = UnisleepAllocator(MemoryLifecycle(drv))
    try:
        with pytest.raises(UnsupportedError, match="cannot live in unisleep.*simulated HIP library.*"
                           "free nothing.*UNISLEEP_VLLM_ALLOCATOR") as e:
            vllm_plugin._allocator()
        assert type(e.value).__name__ == "PoolRoutingError"
        del e
        assert UnisleepAllocator.instance.lifecycle.allocated_bytes() == 0  # nothing was placed
    finally:
        UnisleepAllocator.reset_instance()
        lib.close()
