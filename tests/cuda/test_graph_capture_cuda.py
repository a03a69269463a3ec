"""Graph captures in a process where unisleep works behind the caller, on an NVIDIA GPU.

A capture in torch's default *global* mode is invalidated by an unsafe driver call from any
thread; before the capture gate (unisleep/graph_capture.py) the backup arena's growth, started
behind the model load, page-locked host memory (``cuMemHostRegister``) while vLLM captured its
graphs, and the process aborted.  Each case forces that race deterministically, in its own
process (an invalidated capture aborts it): the background work is started *inside* the capture
and given time to run before the capture ends.  The loop over fresh processes at vLLM's sizes is
``tools/vllm_contract/capture_loop.py`` (docs/cuda.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CXX_TRACE = ("terminate called", "frame #", "INTERNAL ASSERT", "pure virtual", "Traceback", "Exception ignored",
             "CUDA error")

MLP = """
import time, torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
def mlp():
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16)
                                 for _ in range(4)])
def warm(model, x):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
"""


def _run(body: str, timeout: int = 300) -> subprocess.CompletedProcess:
    code = MLP + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def _clean(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "OK" in p.stdout, p.stdout[-2000:]
    found = [s for s in CXX_TRACE if s in p.stderr]
    assert not found, f"{found} in stderr:\n{p.stderr[-4000:]}"


def test_arena_growth_started_inside_a_capture_waits_for_it_to_end():
    """The arena's growth begins inside a global-mode capture into a lifecycle pool; the capture
    stays open while the grower would page-lock several segments.  Before the gate: the capture
    was invalidated (capture_end failed, the process aborted)."""
    p = _run("""
        from unisleep import MemoryLifecycle
        lc = MemoryLifecycle("cuda")
        with lc.pool("weights"):
            model = mlp()
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, pool=lc.driver.graph_pool(lc, "cudagraph")):
            y = model(x)
            lc.prepare_backup(4 << 30, background=True)  # 4 segments of 1 GiB, ~25 ms each
            time.sleep(1.0)
            inside = lc.backup_store.capacity
            y = model(y)
        lc.backup_store.wait_prepared()
        assert inside == 0, f"{inside} bytes page-locked during the capture"
        assert lc.backup_store.capacity >= 4 << 30
        with torch.no_grad():
            g.replay()
            assert torch.equal(y, model(model(x)))
            lc.sleep(1); lc.wake_up()
            g.replay()
            assert torch.equal(y, model(model(x)))
        print("OK")
    """)
    _clean(p)


def test_vllm_allocator_capture_right_after_the_weights_load():
    """vLLM's order: weights under use_memory_pool("weights") (which starts the arena's
    preparation behind the load; the KV cache's pool waits for it), KV cache, warm-up, capture in
    cudagraph_pool() at once, with a second large preparation started inside the capture (which
    waits for the capture to end)."""
    p = _run("""
        from unisleep.vllm_worker.allocator import UnisleepAllocator
        alloc = UnisleepAllocator()
        with alloc.use_memory_pool(tag="weights"):
            w = torch.randint(0, 256, (6 << 30,), dtype=torch.uint8, device=dev)
            model = mlp()
        with alloc.use_memory_pool(tag="kv_cache"):
            kv = torch.zeros(2 << 30, dtype=torch.uint8, device=dev)
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), alloc.cudagraph_pool() as pool, torch.cuda.graph(g, pool=pool):
            y = model(x)
            alloc.lifecycle.prepare_backup(12 << 30, background=True)
            time.sleep(1.0)
            y = model(y)
        with torch.no_grad():
            g.replay()
            assert torch.equal(y, model(model(x)))
            head = w[:1 << 20].clone()
            alloc.sleep(offload_tags=("weights",))
            alloc.wake_up(None)
            g.replay()
            assert torch.equal(y, model(model(x))) and torch.equal(w[:1 << 20], head)
        print("OK")
    """)
    _clean(p)


def test_releases_behind_a_sleep_never_run_inside_a_capture():
    """release_behind: a capture begun right after a level-2 sleep returns first waits for the
    queued releases (each slowed here), and none runs while it is underway."""
    p = _run("""
        from unisleep import MemoryLifecycle, graph_capture
        lc = MemoryLifecycle("cuda", release_behind=True)
        kvs = [lc.empty((1 << 30,), torch.uint8, tag="kv_cache") for _ in range(4)]
        model = mlp()
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        seen = []
        lc.driver.hooks.release = lambda h: (time.sleep(0.1), seen.append(graph_capture.underway()))
        lc.sleep(2)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            y = model(x)
        lc.driver.hooks.release = None
        assert seen and not any(seen), seen
        with torch.no_grad():
            g.replay()
            assert torch.equal(y, model(x))
        lc.wake_up()
        print("OK")
    """)
    _clean(p)


def test_a_lifecycle_made_inside_a_capture_defers_its_warm_up():
    """The pool's first use can come inside a capture (a region entered in a captured forward):
    the driver's kernel warm-ups and copy-stream set-up, which launch and synchronise, wait for
    the first sleep instead of invalidating the capture."""
    p = _run("""
        from unisleep import MemoryLifecycle
        model = mlp()
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            y = model(x)
            lc = MemoryLifecycle("cuda")
        with torch.no_grad():
            g.replay()
            assert torch.equal(y, model(x))
        w = lc.empty((1 << 20,), torch.uint8, tag="weights"); w.fill_(7)
        lc.sleep(1); lc.wake_up()
        assert int(w.sum()) == 7 << 20
        print("OK")
    """)
    _clean(p)


SETUPS_AT_EXIT = {
    # pools, a graph pool, an arena, cycles, everything left as it is at exit
    "pools-graph-cycles-asleep": """
        from unisleep import MemoryLifecycle
        lc = MemoryLifecycle("cuda")
        with lc.pool("weights"):
            model = mlp()
        with lc.pool("kv_cache"):
            kv = torch.zeros(1 << 28, dtype=torch.uint8, device=dev)
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, pool=lc.driver.graph_pool(lc, "cudagraph")):
            y = model(x)
        for level in (1, 1, 2, 1):
            lc.sleep(level); lc.wake_up()
            with torch.no_grad():
                g.replay()
        lc.sleep(1)
        print("OK")
    """,
    "vllm-allocator-awake-release-behind": """
        import os
        os.environ["UNISLEEP_RELEASE_BEHIND"] = "1"
        from unisleep.vllm_worker.allocator import UnisleepAllocator
        alloc = UnisleepAllocator()
        with alloc.use_memory_pool(tag="weights"):
            model = mlp()
        with alloc.use_memory_pool(tag="kv_cache"):
            kv = torch.zeros(1 << 28, dtype=torch.uint8, device=dev)
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        warm(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), alloc.cudagraph_pool() as pool, torch.cuda.graph(g, pool=pool):
            y = model(x)
        for _ in range(3):
            alloc.sleep(offload_tags=("weights",)); alloc.wake_up(None)
        alloc.sleep(offload_tags=())  # level 2, releases behind the return still queued at exit
        print("OK")
    """,
}


@pytest.mark.parametrize("setup", sorted(SETUPS_AT_EXIT))
def test_exit_after_sleep_wake_cycles_is_clean(setup):
    """No abort and no C++ trace at exit, whatever is left: pools (torch's) go before their
    allocators, the driver's releases finish, the arena is unregistered."""
    _clean(_run(SETUPS_AT_EXIT[setup]))
