"""Ascend backend against the SIMULATED ACL library (tests/sim/fake_acl.py) — no Ascend hardware.

Proves the ctypes binding passes ACL's argument orders (granularity output last, unmap and
release without a size, ``destMax`` as a byte capacity, ``{id, type}`` locations) to a library
that checks them; the full MemoryLifecycle scenarios run in the contract suite
(tests/contract), over this backend and every other.  The torch_npu ``pool(tag)`` route is not exercised (no torch_npu).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sim.fake_acl import (ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_CONTEXT_NULL, ACL_ERROR_RT_MEMORY_FREE,
                          ACL_ERROR_RT_PARAM_INVALID, FakeAcl)
from sim.fake_torch_npu import SimTorchNpu
from unisleep import MemoryLifecycle
from unisleep.backends.ascend import AscendDriver
from unisleep.errors import UnsupportedError

GRAN = 2 << 20  # ACL_HBM_MEM_HUGE granularity
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
MiB = 1 << 20


def make(**kw):
    lib = FakeAcl(granularity=GRAN, total_bytes=kw.pop("total", 64 * MiB))
    return lib, AscendDriver(lib=lib, tensor_device="cpu", **kw)


@pytest.fixture(params=["simulated"])
def simulated(request):
    lib, drv = make()
    lc = MemoryLifecycle(drv)
    yield lib, drv, lc
    lc.close()
    assert not lib.dev.internal_errors
    assert not lib.dev.reservations and lib.dev.used_bytes == 0
    lib.close()


def fill(lc, tag, nbytes, seed):
    t = lc.empty(nbytes, torch.uint8, tag=tag)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t, t.clone()


# Level 1/2, wake by tag, discard, read_backup, progressive wake and the undo of a failed sleep
# run over every backend, this one included, in tests/contract/test_driver_contract.py.


def test_ascend_sim_argument_orders(simulated):
    lib, drv, lc = simulated
    w, _ = fill(lc, "weights", 2 * MiB, 5)
    lc.sleep(level=1)
    lc.wake_up()
    log = lib.dev.log
    cps = [e for e in log if e[0] == "aclrtMemcpy"]
    assert {e[5] for e in cps} == {1, 2}  # HOST_TO_DEVICE and DEVICE_TO_HOST
    assert all(e[2] == e[4] == 2 * MiB for e in cps)  # destMax is the destination capacity
    unmaps = [e for e in log if e[0] == "aclrtUnmapMem"]
    assert unmaps and all(len(e) == 2 for e in unmaps)  # pointer only
    gran = [e for e in log if e[0] == "aclrtMemGetAllocationGranularity"][0]
    assert gran[2] == 0  # (prop, MINIMUM, &out)
    sets = [e for e in log if e[0] == "aclrtMemset"]
    assert all(e[2] == e[4] for e in sets)  # (ptr, maxCount, value, count)
    assert "aclrtSynchronizeDevice" in [e[0] for e in log[log.index(sets[-1]) :]]


def test_ascend_sim_every_call_holds_the_devices_context_whatever_the_thread():
    """ACL contexts are per thread (SIMULATED by FakeAcl: a call from a thread with no context
    fails with ACL_ERROR_RT_CONTEXT_NULL, one on another device's memory is refused).  A
    background sleep, a progressive wake, the release thread and two drivers of two devices
    taking turns on one thread: every call runs in the right device's context."""
    import threading

    lib = FakeAcl(granularity=GRAN, total_bytes=64 * MiB, device_count=2)
    drv = AscendDriver(lib=lib, tensor_device="cpu", device=1)
    drv0 = AscendDriver(lib=lib, tensor_device="cpu", device=0)
    lc, lc0 = MemoryLifecycle(drv), MemoryLifecycle(drv0)
    drv.configure(release_behind=True)
    w, w0 = fill(lc, "weights", 4 * MiB, 31)
    v, v0 = fill(lc0, "weights", 2 * MiB, 32)
    lc.sleep(level=1, background=True)
    lc.wait()
    lc.wake_up(progressive=True)
    lc.wait()
    for _ in range(2):  # the two drivers in turn on this thread
        lc0.sleep(level=1)
        lc.sleep(level=1)
        lc0.wake_up()
        lc.wake_up()
    t = threading.Thread(target=lambda: (lc.sleep(level=1), lc.wake_up()))
    t.start()
    t.join(60)
    assert torch.equal(w, w0) and torch.equal(v, v0)
    # (aclrtGetDevice answering "no context" on a new thread is the question, not a failure)
    errors = [e for e in lib.dev.log if e[0] == "error" and e[1:3] != ("aclrtGetDevice", ACL_ERROR_RT_CONTEXT_NULL)]
    assert not errors, errors[:3]
    del w, w0, v, v0
    lc.close()
    lc0.close()
    assert not lib.dev.internal_errors and lib.dev.used_bytes == 0
    lib.close()


def test_ascend_sim_a_device_set_behind_unisleeps_back_is_seen():
    """torch_npu's ``torch.npu.set_device(i)`` calls ``aclrtSetDevice(i)`` on the calling thread
    (SIMULATED here by calling the simulated library directly, as torch_npu would): the next
    unisleep call on that thread must run in its own device's context again, not trust what it
    bound last (ACL_ERROR_RT_PARAM_INVALID from the simulator otherwise: device 1's context
    touching device 0's memory)."""
    lib = FakeAcl(granularity=GRAN, total_bytes=64 * MiB, device_count=2)
    drv = AscendDriver(lib=lib, tensor_device="cpu", device=0)
    lc = MemoryLifecycle(drv)
    w, w0 = fill(lc, "weights", 4 * MiB, 41)
    for _ in range(2):
        assert lib.aclrtSetDevice(1) == 0  # "torch.npu.set_device(1)" behind unisleep's back
        lc.sleep(level=1)
        assert lib.aclrtSetDevice(1) == 0
        lc.wake_up()
    assert torch.equal(w, w0)
    errors = [e for e in lib.dev.log if e[0] == "error" and e[1:3] != ("aclrtGetDevice", ACL_ERROR_RT_CONTEXT_NULL)]
    assert not errors, errors[:3]
    calls = [e[0] for e in lib.dev.log]
    assert calls.count("aclrtSetDevice") < calls.count("aclrtGetDevice")  # asked first, set only when needed
    del w, w0
    lc.close()
    assert not lib.dev.internal_errors and lib.dev.used_bytes == 0
    lib.close()


def test_ascend_sim_simulator_is_strict():
    lib, drv = make()
    api = drv.api
    va = drv.reserve(2 * GRAN)
    p = ctypes.c_void_p()
    assert api.aclrtReserveMemAddress(ctypes.byref(p), GRAN, GRAN, None, 0) == ACL_ERROR_RT_PARAM_INVALID
    h = drv.create(GRAN)
    assert api.aclrtMapMem(va, 2 * GRAN, 0, h.ptr, 0) == ACL_ERROR_INVALID_PARAM  # size != physical
    drv.map(va, GRAN, h)
    assert api.aclrtFreePhysical(h.ptr) == ACL_ERROR_RT_MEMORY_FREE  # still mapped
    assert api.aclrtReleaseMemAddress(va) == ACL_ERROR_RT_PARAM_INVALID  # still mapped
    host = ctypes.create_string_buffer(16)
    assert api.aclrtMemcpy(ctypes.addressof(host), 16, va, 32, 2) == ACL_ERROR_INVALID_PARAM  # count > destMax
    assert api.aclrtMemcpy(va, GRAN, ctypes.addressof(host), 16, 2) == ACL_ERROR_RT_PARAM_INVALID  # wrong kind
    drv.unmap(va, GRAN)
    drv.release(h)
    drv.free_address(va, 2 * GRAN)
    assert lib.dev.used_bytes == 0 and not lib.dev.reservations and not lib.dev.internal_errors
    lib.close()


def test_ascend_sim_oom_is_reported_with_acl_code():
    from unisleep.backends.ascend.acl import AclError
    from unisleep.errors import UnisleepError

    lib, drv = make(total=4 * MiB)
    with MemoryLifecycle(drv) as lc:
        with pytest.raises(UnisleepError):  # the lifecycle's room check, before any ACL call
            lc.empty(6 * MiB, torch.uint8, tag="weights")
        assert lib.dev.used_bytes == 0 and not lib.dev.reservations and "aclrtMallocPhysical" not in lib.dev.calls
    # the driver itself, asked for more than the device has: ACL's code, named
    with pytest.raises(AclError, match="aclrtMallocPhysical failed with ACL_ERROR_RT_MEMORY_ALLOCATION"):
        drv.create(6 * MiB)
    assert lib.dev.used_bytes == 0
    lib.close()


def test_ascend_sim_pool_routes_allocations_into_the_tag_on_the_right_device(monkeypatch):
    """The pool's callbacks, called through C as torch_npu would: a segment becomes a region of
    the tag (it sleeps and wakes with it), the callback's device argument is honoured (another
    device is refused with NULL, nothing placed), and torch's free gives the memory back."""
    from unisleep.backends.ascend.pool import npu_mem_pool

    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    lib, drv = make()
    npu = SimTorchNpu()
    with MemoryLifecycle(drv) as lc:
        with npu_mem_pool(drv, lc, "kv_cache", npu=npu):
            va = npu.alloc(3 * MiB, 0, None)
            assert va and lc.tags == ["kv_cache"] and lc.allocated_bytes("kv_cache") == 4 * MiB
            assert npu.alloc(1 * MiB, 1, None) is None  # device 1 asked of a device-0 pool: refused
            assert lc.allocated_bytes() == 4 * MiB and lib.dev.used_bytes == 4 * MiB
        assert [e[0] for e in npu.events] == ["MemPool", "enter pool", "exit pool"]  # no settings touched
        lc.sleep(level=2)
        assert lib.dev.used_bytes == 0
        lc.wake_up()
        assert lib.dev.used_bytes == 4 * MiB
        npu.free(va, 3 * MiB, 0, None)
        assert lc.allocated_bytes() == 0 and lib.dev.used_bytes == 0
    assert not lib.dev.reservations and not lib.dev.internal_errors
    lib.close()


def test_ascend_sim_pool_turns_expandable_segments_off_inside_only(monkeypatch):
    """vllm-ascend sets PYTORCH_NPU_ALLOC_CONF=expandable_segments:True unless vLLM runs with sleep
    mode (and builds strings like page_size:1g,expandable_segments:True): the pool switches them
    off while it is active and back on afterwards, sending torch_npu 2.10.0.post4's
    _set_allocator_settings only the one key it accepts (SIMULATED torch_npu: any other key is
    "unsupported setting"; the user's whole string, as sent before, raised there)."""
    from unisleep.backends.ascend.pool import npu_mem_pool

    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "page_size:1g,expandable_segments:True")
    lib, drv = make()
    npu = SimTorchNpu()
    with MemoryLifecycle(drv) as lc:
        with npu_mem_pool(drv, lc, "weights", npu=npu):
            assert npu.settings["expandable_segments"] == "False"
            assert npu.alloc(2 * MiB, 0, None)
        assert npu.events[1:] == [("settings", "expandable_segments:False"), ("enter pool",),
                                  ("exit pool",), ("settings", "expandable_segments:True")]
        assert npu.settings == {"page_size": "1g", "expandable_segments": "True"}  # the user's, intact
        # a torch_npu that cannot switch them off at run time: refused before anything is placed
        with pytest.raises(UnsupportedError, match="expandable.*remove expandable_segments:True"):
            with npu_mem_pool(drv, lc, "kv_cache", npu=SimTorchNpu(settings=False)):
                pass
        assert lc.tags == ["weights"]
    lib.close()


def test_ascend_sim_pool_refuses_settings_a_toggle_would_reset(monkeypatch):
    """Every _set_allocator_settings call resets roundup_power2_divisions (and max_split_size_mb,
    garbage_collection_threshold) in torch_npu 2.10.0.post4 (SIMULATED): switching expandable
    segments off would silently drop the user's setting, so the pool is refused first, naming
    the setting, and nothing is sent or placed."""
    from unisleep.backends.ascend.pool import npu_mem_pool

    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "roundup_power2_divisions:4,expandable_segments:True")
    lib, drv = make()
    npu = SimTorchNpu()
    with MemoryLifecycle(drv) as lc:
        with pytest.raises(UnsupportedError, match="resets roundup_power2_divisions.*Nothing was changed"):
            with npu_mem_pool(drv, lc, "kv_cache", npu=npu):
                pass
        assert npu.events == [] and npu.settings["roundup_power2_divisions"] == "4" and lc.tags == []
    lib.close()


def test_ascend_sim_nested_pools_keep_their_tags(monkeypatch):
    """vllm-ascend enters use_allocation_tag("sleep_persistent") inside the KV cache's pool.  In
    torch_npu (SIMULATED: cached blocks come from the pool begun first, new segments from the
    innermost pool's allocator) two active pools mix tags; unisleep keeps one active per thread,
    so a block the KV-cache pool caches is never handed to sleep_persistent, and after the inner
    pool the KV cache's pool is active again."""
    from unisleep.backends.ascend.pool import npu_mem_pool

    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    lib, drv = make()
    npu = SimTorchNpu()
    with MemoryLifecycle(drv) as lc:
        def tag_of(ptr):
            return lc._state.at(ptr).tag
        with npu_mem_pool(drv, lc, "kv_cache", npu=npu):
            kv = npu.allocate(2 * MiB)
            npu.free_block(kv, 2 * MiB)  # cached by the KV cache's pool
            with npu_mem_pool(drv, lc, "sleep_persistent", npu=npu):
                p = npu.allocate(1 * MiB)
            kv2 = npu.allocate(1 * MiB)
        assert p and tag_of(p) == "sleep_persistent", "a KV-cache block was handed to sleep_persistent"
        assert kv2 == kv and tag_of(kv2) == "kv_cache"
        assert lc.allocated_bytes("sleep_persistent") == 2 * MiB and lc.allocated_bytes("kv_cache") == 2 * MiB
    lib.close()


@pytest.mark.slow
def test_ascend_npu_views_use_torch_npus_storage_constructor():
    """On an NPU device the view's storage must come from torch_npu's own constructor (an
    NPUStorageImpl). Run in a child process: a SIMULATED torch_npu whose constructor stops the
    call once reached, with torch's PrivateUse1 device named "npu" as torch_npu names it."""
    code = textwrap.dedent(f"""
        import sys, types, torch
        sys.path.insert(0, {TESTS!r})
        torch.utils.rename_privateuse1_backend("npu")
        class Reached(Exception):
            pass
        def construct(va, device, nbytes):
            raise Reached(f"{{va:#x}} {{device}} {{nbytes}}")
        sys.modules["torch_npu"] = types.SimpleNamespace(
            _C=types.SimpleNamespace(_construct_storage_from_data_pointer=construct), __version__="simulated")
        from sim.fake_acl import FakeAcl
        from unisleep.backends.ascend import AscendDriver
        drv = AscendDriver(lib=FakeAcl(granularity=2 << 20), tensor_device="npu:0")
        try:
            drv.view(0x7f0000200000, 4096)
            print("view made without torch_npu's constructor")
        except Reached as e:
            print("torch_npu constructor:", e)
        except Exception as e:
            print("other:", type(e).__name__, e)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "torch_npu constructor: 0x7f0000200000 npu:0 4096", out.stdout


def _torch_npu_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(_torch_npu_importable(), reason="torch_npu is installed: the refusal without it cannot be shown")
def test_ascend_sim_pool_without_torch_npu_says_what_to_install(monkeypatch):
    lib, drv = make()
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    with MemoryLifecycle(drv) as lc:
        with pytest.raises(UnsupportedError, match="torch_npu"):
            with lc.pool("kv_cache"):
                pass
    lib.close()


def test_ascend_sim_doctor_warnings(monkeypatch):
    from unisleep.platform import Platform, environment_warnings

    npu = Platform("ascend", "simulated")
    for v in ("VLLM_ASCEND_ENABLE_NZ", "HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE", "PYTORCH_NPU_ALLOC_CONF"):
        monkeypatch.delenv(v, raising=False)
    text = " ".join(environment_warnings(npu))
    assert "VLLM_ASCEND_ENABLE_NZ" in text and "HCCL_HOST_SOCKET_PORT_RANGE" in text
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    monkeypatch.setenv("HCCL_HOST_SOCKET_PORT_RANGE", "60000-60050")
    monkeypatch.setenv("HCCL_NPU_SOCKET_PORT_RANGE", "61000-61050")
    assert environment_warnings(npu) == []
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    assert any("expandable" in w for w in environment_warnings(npu))


def _cann_include():
    """The CANN headers' include folder (the one holding ``acl/acl_rt.h``), if any."""
    import os

    cands = [os.environ.get("UNISLEEP_ACL_INCLUDE")]
    for root in (os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
                 "/usr/local/Ascend/ascend-toolkit/latest"):
        if root:
            cands.append(os.path.join(root, "include"))
    for c in cands:
        if c and os.path.exists(os.path.join(c, "acl", "acl_rt.h")):
            return c
    return None


def _needs_compilers():
    import shutil

    if shutil.which("cc") is None or shutil.which("c++") is None:
        pytest.skip("needs a C and a C++ compiler: apt-get install gcc g++")


@pytest.mark.slow
def test_acl_bindings_match_the_checked_in_cann_table(tmp_path):
    """CPU CI's check of the ACL bindings: the probes compile against a header generated from
    tests/sim/acl_rt_table.json (what the bindings use from CANN 9.1.0's acl_rt.h, with
    parameter names) and compare struct sizes and offsets, every value, and each prototype by
    parameter name and ABI class — a swapped aclrtMemLocation, aclrtMemcpy arguments in
    another order or a narrowed ``reserve`` fail here (tests/test_abi_mutations.py)."""
    from sim import abi_check
    from unisleep.backends.ascend import acl

    _needs_compilers()
    table = abi_check.acl_table()
    assert set(table["functions"]) == set(acl.SIGNATURES)  # every bound function is in the table
    ref = abi_check.acl_reference_from_table(tmp_path, acl.STRUCTS, acl.ENUMS, table)
    assert len(ref["layout"]) > 25
    problems = abi_check.acl_problems(ref, acl.STRUCTS, acl.ENUMS, acl.SIGNATURES)
    assert not problems, ("backends/ascend/acl.py differs from CANN " + table["cann"] + "'s acl_rt.h (the "
                          "checked-in table):\n  " + "\n  ".join(problems))


@pytest.mark.skipif(_cann_include() is None, reason="needs the CANN toolkit headers (acl/acl_rt.h): install CANN "
                    "and source set_env.sh, or set UNISLEEP_ACL_INCLUDE to the folder holding acl/")
def test_acl_bindings_and_the_table_match_the_cann_headers(tmp_path):
    """Where CANN's headers are installed (the Ascend runner; or UNISLEEP_ACL_INCLUDE): the
    bindings against the real header, and the checked-in table against it too, so the table
    CPU CI relies on cannot drift from CANN unseen."""
    from sim import abi_check
    from unisleep.backends.ascend import acl

    _needs_compilers()
    real = abi_check.acl_reference_from_header(tmp_path, _cann_include(), acl.STRUCTS, acl.ENUMS, acl.PARAM_NAMES)
    problems = abi_check.acl_problems(real, acl.STRUCTS, acl.ENUMS, acl.SIGNATURES)
    assert not problems, "backends/ascend/acl.py differs from the CANN headers:\n  " + "\n  ".join(problems)
    table = abi_check.acl_reference_from_table(tmp_path, acl.STRUCTS, acl.ENUMS)
    drift = _diff_refs(table, real)
    assert not drift, "tests/sim/acl_rt_table.json differs from the installed CANN headers:\n  " + "\n  ".join(drift)


def _diff_refs(a: dict, b: dict) -> list[str]:
    from sim import abi_probe

    return abi_probe.diff(a["layout"], b["layout"]) + abi_probe.diff(a["prototypes"], b["prototypes"])


def _ascend_present() -> bool:
    from unisleep.platform import detect_platform

    try:
        return detect_platform().name == "ascend"
    except Exception:
        return False


@pytest.mark.ascend
@pytest.mark.skipif(not _ascend_present(), reason="needs an Ascend NPU with torch_npu (.github/workflows/ascend.yml runs it on an Atlas A2 runner)")
def test_ascend_hardware_lifecycle():
    """NOT RUN in this project so far: the same scenario on a real Ascend NPU."""
    lc = MemoryLifecycle("ascend")
    try:
        dev = lc.torch_device
        w = lc.empty((64 * MiB,), torch.uint8, tag="weights")
        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8).to(dev))
        w0 = w.cpu()
        kv = lc.empty((256 * MiB,), torch.uint8, tag="kv_cache")
        kv.fill_(9)
        ptrs = (w.data_ptr(), kv.data_ptr())
        free_awake, _ = lc.driver.memory_info()
        lc.sleep(level=1)
        free_asleep, _ = lc.driver.memory_info()
        assert free_asleep - free_awake >= 0.9 * lc.allocated_bytes()
        lc.wake_up(["weights"])
        assert torch.equal(w.cpu(), w0)
        lc.wake_up(["kv_cache"])
        assert int(kv.count_nonzero()) == 0 and (w.data_ptr(), kv.data_ptr()) == ptrs
    finally:
        lc.close()
