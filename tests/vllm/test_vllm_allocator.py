"""UnisleepAllocator (vLLM's MemAllocator on a MemoryLifecycle) over the host backend, in the
order vLLM's GPU worker calls it.

On host memory ``use_memory_pool`` cannot route torch's CPU allocator, so the tensors are put into
each tag by the lifecycle's own means (``lifecycle.empty(..., tag=...)``) inside the matching
``use_memory_pool`` context; everything else — sleep levels, selective wake, discard, usage — is
the real lifecycle on real memfd memory (``resident_bytes`` reads the kernel's block counts).
The CUDA path (pool routing, graph pool, vLLM's own CuMemAllocator beside it) is
tests/cuda/test_vllm_contract.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.vllm_worker.allocator import DEFERRABLE_TAGS, UnisleepAllocator
from unisleep.vllm_worker.sleep_backend import UnisleepSleepBackend, offload_tags_for
from unisleep.errors import InvalidArgumentError, UnsupportedError

from _vllm_common import needs_feature, require_vllm

MiB = 1 << 20


@pytest.fixture
def alloc(tmp_path):
    lc = MemoryLifecycle("host", spill_dir=str(tmp_path))
    a = UnisleepAllocator(lc)
    yield a
    a.close()


def _load(a, tag, n, fill):
    """What the worker does: allocate inside use_memory_pool(tag) (on host through the lifecycle)."""
    with a.use_memory_pool(tag):
        tag = tag or "default"
        assert a.current_tag == tag
        t = a.lifecycle.empty((n,), torch.uint8, tag=a.current_tag)
        t.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8) + fill)
    assert a.current_tag == "default"
    return t


def _worker(a):
    """The GPU worker's order: weights (usage must be 0 first), KV cache, runtime, workspace."""
    assert a.get_current_usage() == 0
    w = _load(a, "weights", 4 * MiB, 1)
    kv = _load(a, "kv_cache", 8 * MiB, 2)
    rt = _load(a, "runtime", 1 * MiB, 3)
    ws = _load(a, "workspace", 1 * MiB, 4)
    return w, kv, rt, ws


def _expect(n, fill):
    return torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8) + fill


def test_level1_offloads_weights_and_runtime_discards_the_rest(alloc):
    w, kv, rt, ws = _worker(alloc)
    assert alloc.get_current_usage() >= 14 * MiB
    backend = UnisleepSleepBackend(alloc)
    backend.suspend(1)
    st = alloc.lifecycle.state()
    assert st == {"weights": "offloaded", "kv_cache": "discarded", "runtime": "offloaded",
                  "workspace": "discarded"}
    assert alloc.resident_bytes() == 0  # every byte released (memfd blocks)
    # usage counts asleep allocations too (vLLM sums every handle)
    assert alloc.get_current_usage() >= 14 * MiB
    # selective wake: weights + every non-deferrable tag; kv_cache stays asleep
    backend.resume(["weights"])
    st = alloc.lifecycle.state()
    assert st["weights"] == st["runtime"] == st["workspace"] == "awake"
    assert st["kv_cache"] == "discarded" and backend.level == 1
    assert torch.equal(w, _expect(4 * MiB, 1)) and torch.equal(rt, _expect(MiB, 3))
    assert alloc.resident_bytes("kv_cache") == 0
    backend.resume(["kv_cache"])
    assert not alloc.lifecycle.is_sleeping and backend.level is None
    assert int(kv.abs().sum()) == 0  # discarded bytes come back as zeros on the lifecycle
    assert backend.last_report["op"] == "wake" and "lifecycle" in backend.last_report


def test_level2_discards_weights_and_offloads_runtime(alloc):
    w, kv, rt, ws = _worker(alloc)
    backend = UnisleepSleepBackend(alloc)
    backend.suspend(2)
    assert alloc.lifecycle.state() == {"weights": "discarded", "kv_cache": "discarded",
                                       "runtime": "offloaded", "workspace": "discarded"}
    backend.resume(None)
    assert int(w.sum()) == 0  # weights must be reloaded after a level-2 sleep
    assert torch.equal(rt, _expect(MiB, 3))  # runtime survives every level


def test_wake_with_only_kv_cache_restores_runtime_but_not_weights(alloc):
    w, kv, rt, ws = _worker(alloc)
    alloc.sleep(offload_tags=offload_tags_for(1))
    alloc.wake_up(["kv_cache"])
    st = alloc.lifecycle.state()
    assert st["weights"] == "offloaded" and st["kv_cache"] == st["runtime"] == "awake"
    alloc.wake_up(["weights"])
    assert torch.equal(w, _expect(4 * MiB, 1))


def test_wake_of_unknown_or_awake_tags_does_nothing(alloc):
    _worker(alloc)
    alloc.wake_up(["weights", "scheduling"])  # nothing asleep: no-op, no error
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up(["nonexistent"])  # still restores the non-deferrable tags, like vLLM
    st = alloc.lifecycle.state()
    assert st["runtime"] == st["workspace"] == "awake"  # non-deferrable: woken
    assert st["weights"] == "offloaded" and st["kv_cache"] == "discarded"
    assert set(DEFERRABLE_TAGS) == {"weights", "kv_cache"}


def test_discard_kv_cache_alone_then_wake(alloc):
    w, kv, rt, ws = _worker(alloc)
    before = alloc.resident_bytes()
    backend = UnisleepSleepBackend(alloc)
    backend.discard(("kv_cache",))
    assert alloc.lifecycle.state()["kv_cache"] == "discarded"
    assert alloc.resident_bytes("kv_cache") == 0
    assert before - alloc.resident_bytes() >= 8 * MiB
    assert torch.equal(w, _expect(4 * MiB, 1))  # nothing else touched
    backend.resume(["kv_cache"])
    assert not alloc.lifecycle.is_sleeping


def test_sleep_over_sleep_keeps_the_existing_policy_and_warns(alloc, caplog):
    w, *_ = _worker(alloc)
    alloc.sleep(offload_tags=offload_tags_for(1))
    with caplog.at_level(logging.WARNING, logger="unisleep.vllm"):
        alloc.sleep(offload_tags=offload_tags_for(2))  # vLLM: warning, policy kept (no raise)
    assert "existing policy was kept" in caplog.text
    assert alloc.lifecycle.state()["weights"] == "offloaded"
    alloc.wake_up(None)
    assert torch.equal(w, _expect(4 * MiB, 1))  # the level-1 backup survived


def test_discard_of_an_offloaded_tag_keeps_its_backup(alloc, caplog):
    w, *_ = _worker(alloc)
    alloc.sleep(offload_tags=("weights", "runtime"))
    with caplog.at_level(logging.WARNING, logger="unisleep.vllm"):
        alloc.discard(("weights",))
    assert "existing policy was kept" in caplog.text
    alloc.wake_up()
    assert torch.equal(w, _expect(4 * MiB, 1))


def test_sleep_defaults_and_tag_forms(alloc):
    d = _load(alloc, None, MiB, 5)  # use_memory_pool(None) = tag "default"
    assert alloc.lifecycle.state() == {"default": "awake"}
    alloc.sleep()  # vLLM: offload_tags None = ("default",)
    assert alloc.lifecycle.state() == {"default": "offloaded"}
    alloc.wake_up()
    assert torch.equal(d, _expect(MiB, 5))
    alloc.sleep("default")  # a str is one tag
    alloc.wake_up()
    alloc.discard("default")
    assert alloc.lifecycle.state() == {"default": "discarded"}
    with pytest.raises(InvalidArgumentError):
        alloc.wake_up("default")  # a bare string is refused with how to write it


def test_backend_level_is_validated(alloc):
    with pytest.raises(InvalidArgumentError):
        UnisleepSleepBackend(alloc).suspend(3)


def test_graph_pool_refused_on_a_backend_without_one(alloc):
    with pytest.raises(UnsupportedError, match="sleep-mode-offload"):
        with alloc.cudagraph_pool():
            pass


def test_get_instance_is_one_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    UnisleepAllocator.reset_instance()
    try:
        a = UnisleepAllocator.get_instance()
        assert UnisleepAllocator.get_instance() is a
        assert a.lifecycle.platform_name == "host"
    finally:
        UnisleepAllocator.reset_instance()
    assert UnisleepAllocator.instance is None


# ------------------------------------------------------------------ the plugin's wiring
def test_plugin_makes_vllms_allocator_lookup_return_ours(monkeypatch):
    """With the unisleep backend chosen, vLLM's get_mem_allocator_instance() and
    CuMemAllocator.get_instance() return the UnisleepAllocator (on CPU vLLM has none)."""
    require_vllm()
    import vllm.device_allocator as da
    from vllm.device_allocator.cumem import CuMemAllocator

    from unisleep.vllm_worker import plugin as vllm_plugin

    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    vllm_plugin.install_allocator_hooks()
    UnisleepAllocator.reset_instance()
    vllm_plugin.select_allocator(None)
    try:
        with pytest.raises(RuntimeError, match="not available"):
            da.get_mem_allocator_instance()  # undecided -> vLLM's own answer on CPU
        cfg = type("C", (), {"model_config": type("M", (), {"sleep_mode_backend": "cumem"})()})()
        assert vllm_plugin.decide(cfg) is False  # cumem chosen: vLLM's allocator, fixed
        vllm_plugin.select_allocator(None)
        cfg.model_config.sleep_mode_backend = "unisleep"
        assert vllm_plugin.decide(cfg) is True
        cfg.model_config.sleep_mode_backend = "cumem"
        assert vllm_plugin.decide(cfg) is True  # the choice stays fixed for the process
        a = da.get_mem_allocator_instance()
        assert isinstance(a, UnisleepAllocator) and a is CuMemAllocator.get_instance()
        assert UnisleepSleepBackend().allocator() is a
    finally:
        vllm_plugin.select_allocator(None)
        UnisleepAllocator.reset_instance()


def test_plugin_env_switch(monkeypatch):
    from unisleep.vllm_worker import plugin as vllm_plugin

    vllm_plugin.select_allocator(None)
    monkeypatch.setenv(vllm_plugin.ALLOCATOR_ENV, "0")
    cfg = type("C", (), {"model_config": type("M", (), {"sleep_mode_backend": "unisleep"})()})()
    try:
        assert vllm_plugin.decide(cfg) is False  # the environment wins
    finally:
        vllm_plugin.select_allocator(None)


@needs_feature("graph_pool")
def test_graph_pool_property_extended_for_the_unisleep_backend():
    """vLLM keeps graphs out of the sleeping pool unless the backend is cumem; the plugin's
    property says yes for unisleep with the same conditions (here: CPU -> no)."""
    require_vllm()
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import VllmConfig

    from unisleep.vllm_worker import plugin as vllm_plugin

    vllm_plugin.install_allocator_hooks()
    prop = VllmConfig.use_cumem_cudagraph_pool
    assert getattr(prop.fget, "_unisleep", False)

    class MC:
        sleep_mode_backend = "unisleep"
        sleep_mode_offload_cudagraph = True
        enable_sleep_mode = True

    cfg = type("V", (), {"model_config": MC(),
                         "compilation_config": type("CC", (), {"cudagraph_mode": CUDAGraphMode.FULL})()})()
    # the platform is CPU here, so no graph pool: the same answer vLLM gives for cumem on CPU
    assert prop.fget(cfg) is False
    MC.sleep_mode_backend = "cumem"
    assert vllm_plugin.graph_pool_wanted(cfg) is False


@pytest.mark.slow
def test_post_import_hook_reads_the_workers_config(tmp_path):
    """In a fresh process: the plugin hooks modules imported after it; the worker's
    _maybe_get_memory_pool_context (called for the weights before vLLM sets its current config)
    makes the choice from the worker's own VllmConfig, and vLLM's lookups then return ours."""
    require_vllm()
    import subprocess
    import sys

    code = (
        "import sys, types\n"
        "from unisleep.vllm_worker import plugin as vllm_plugin\n"
        "print(sorted(vllm_plugin.register()))\n"
        "assert 'vllm.device_allocator.cumem' not in sys.modules\n"
        "from vllm.device_allocator.cumem import CuMemAllocator\n"
        "from vllm.v1.worker.gpu_worker import Worker\n"
        "from vllm.device_allocator import get_mem_allocator_instance\n"
        "mc = types.SimpleNamespace(sleep_mode_backend='unisleep', enable_cumem_allocator=True,\n"
        "                           enable_sleep_mode=True)\n"
        "me = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=mc))\n"
        "ctx = Worker._maybe_get_memory_pool_context(me, 'weights')\n"
        "assert vllm_plugin.decide() is True\n"
        "a = get_mem_allocator_instance()\n"
        "assert type(a).__name__ == 'UnisleepAllocator' and CuMemAllocator.get_instance() is a\n"
        "print('OK', type(a).__name__, a.lifecycle.platform_name)\n"
    )
    env = dict(os.environ, UNISLEEP_PLATFORM="host")
    env.pop("UNISLEEP_VLLM_ALLOCATOR", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and "OK UnisleepAllocator host" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


# ------------------------------------------------------------------ vllm-ascend's CaMemAllocator calls
def test_ascend_camem_order_on_the_simulated_acl_library():
    """SIMULATED Ascend (tests/sim/fake_acl.py, no NPU): the calls vllm-ascend's NPUWorker makes
    on CaMemAllocator — sleep(offload_tags=("weights",)) at level 1, sleep(offload_tags=()) at
    level 2, wake_up(tags) waking exactly the tags named — on unisleep's Ascend driver, with the
    extra-cleanup policy (graphs released on sleep, recaptured only once the KV cache wakes).
    Pool routing needs torch_npu, so the tensors enter their tags through the lifecycle."""
    from sim.fake_acl import FakeAcl

    from unisleep.backends.ascend import AscendDriver

    lib = FakeAcl(granularity=2 * MiB, total_bytes=64 * MiB)
    drv = AscendDriver(lib=lib, tensor_device="cpu")
    alloc = UnisleepAllocator(MemoryLifecycle(drv), deferrable_tags=None, extra_cleanup=True)
    try:
        counts = {"capture": 0, "release": 0}
        alloc.extra_cleanup.add_graphs(
            "decode", capture=lambda: counts.__setitem__("capture", counts["capture"] + 1),
            release=lambda: counts.__setitem__("release", counts["release"] + 1))
        lc = alloc.lifecycle
        w = lc.empty((4 * MiB,), torch.uint8, tag="weights")
        w.copy_(_expect(4 * MiB, 1))
        kv = lc.empty((8 * MiB,), torch.uint8, tag="kv_cache")
        kv.fill_(3)
        used = lib.dev.used_bytes
        assert alloc.get_current_usage() == 12 * MiB
        alloc.sleep(offload_tags=("weights",))  # NPUWorker.sleep(level=1)
        free, total = drv.memory_info()
        assert free == total and lib.dev.used_bytes == 0 and counts["release"] == 1
        alloc.wake_up(["weights"])  # exactly the weights (no deferrable rule on Ascend)
        assert lc.state() == {"weights": "awake", "kv_cache": "discarded"}
        assert torch.equal(w, _expect(4 * MiB, 1)) and counts["capture"] == 0
        alloc.wake_up(["kv_cache"])
        assert lib.dev.used_bytes == used and int(kv.count_nonzero()) == 0 and counts["capture"] == 1
        alloc.sleep(offload_tags=())  # NPUWorker.sleep(level=2): everything discarded
        assert lc.state() == {"weights": "discarded", "kv_cache": "discarded"}
        alloc.wake_up(None)
        assert int(w.count_nonzero()) == 0 and counts["capture"] == 2
    finally:
        alloc.close()
        lib.close()


def test_release_host_memory_follows_vllms_rule(alloc, monkeypatch):
    """VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY as vLLM's CuMemBackend reads it (vLLM PR #55206):
    ``bool(int(value))``, default 0; on, a resume that brings back weights the last suspend put
    in host memory gives the backups' host memory back (here
    ``MemoryLifecycle.release_host_backups``, its bytes in ``last_report``), also when a
    level-2 suspend came between (the weights' backup stayed); a KV-only wake, or weights
    discarded by a level-2 sleep, release nothing; a value that is not an integer is refused
    before anything changes."""
    w, kv, rt, ws = _worker(alloc)
    backend = UnisleepSleepBackend(alloc)
    released = []
    real = alloc.lifecycle.release_host_backups
    monkeypatch.setattr(alloc.lifecycle, "release_host_backups", lambda: released.append(1) or real())

    monkeypatch.delenv("VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", raising=False)
    backend.suspend(1)
    backend.resume(None)
    assert released == [] and "host_bytes_released" not in backend.last_report  # off by default

    monkeypatch.setenv("VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", "1")
    backend.suspend(1)
    backend.resume(["kv_cache"])
    assert released == []  # the weights still sleep
    backend.suspend(2)  # over weights still in host memory: they stay there
    backend.resume(["weights"])
    assert released == [1] and backend.last_report["host_bytes_released"] == 0  # spill files: nothing cached
    assert torch.equal(w, _expect(4 * MiB, 1))
    backend.resume(None)
    backend.suspend(2)  # weights discarded: nothing of theirs in host memory
    backend.resume(None)
    assert released == [1]

    monkeypatch.setenv("VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", "0")
    backend.suspend(1)
    backend.resume(None)
    assert released == [1]
    monkeypatch.setenv("VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", "yes")
    backend.suspend(1)
    with pytest.raises(InvalidArgumentError, match="VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY='yes'"):
        backend.resume(None)
    assert alloc.lifecycle.state()["weights"] == "offloaded"  # refused before the wake
