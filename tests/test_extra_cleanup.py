"""Extra cleanup (unisleep/extra_cleanup.py) for real on CPU.

* Two real processes (torch.distributed gloo over 127.0.0.1) each run a host MemoryLifecycle
  with the extra cleanup installed: the registered group is destroyed on sleep (its TCP
  connections are closed: the process's socket count drops back to what it was before the
  group existed), and after a wake a new group gives the right all_reduce sum.
* A registry of graph-capture callables counts calls: recapture happens on wakes that cover
  the KV cache (all tags, or ``["kv_cache"]``), never on a weights-only wake, never on a wake
  that woke nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.errors import InvalidTransitionError
from unisleep.extra_cleanup import ExtraCleanup, extra_cleanup_enabled, install_extra_cleanup

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER = textwrap.dedent(
    """
    import gc, json, os, sys, tempfile
    import torch, torch.distributed as dist
    from unisleep import MemoryLifecycle
    from unisleep.errors import InvalidTransitionError
    from unisleep.extra_cleanup import install_extra_cleanup

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lc = MemoryLifecycle("host", spill_dir=tempfile.mkdtemp())
    w = lc.empty(1 << 20, torch.uint8, tag="weights"); w.fill_(rank + 1)
    kv = lc.empty(1 << 20, torch.uint8, tag="kv_cache")
    def sockets():  # TCP connections this process holds (gloo pairs, store)
        gc.collect()
        n = 0
        for f in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
            except OSError:
                pass
        return n

    calls = {"capture": 0, "release": 0}
    graph = {}
    def capture():
        calls["capture"] += 1
        graph["kv_ptr"] = kv.data_ptr()   # what a captured graph bakes in
    def release():
        calls["release"] += 1
        graph.clear()
    cleanup = install_extra_cleanup(lc, {"sleep_mode_extra_cleanup": True})
    base = sockets()
    tp = cleanup.add_group("tp", ranks=list(range(world)), backend="gloo")
    capture()  # the engine's first capture, before registration
    cleanup.add_graphs("decode", capture=capture, release=release)

    def allreduce(group):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        return t.item()

    out = {"rank": rank, "steps": [], "base_sockets": base}
    def step(name, **kw):
        kw.update(name=name, capture=calls["capture"], release=calls["release"], sockets=sockets())
        out["steps"].append(kw)

    del tp
    step("start", sum=allreduce(cleanup.group("tp")))
    lc.sleep(level=2)
    try:
        cleanup.group("tp"); asleep_access = True
    except InvalidTransitionError:
        asleep_access = False
    step("sleep2", asleep_access=asleep_access, graph_empty=not graph)
    lc.wake_up(["weights"])
    g1 = cleanup.group("tp")
    step("wake_weights", sum=allreduce(g1), graph_empty=not graph)
    del g1
    w.fill_(rank + 1)  # the weight update into woken memory
    lc.wake_up(["kv_cache"])
    step("wake_kv", sum=allreduce(cleanup.group("tp")), kv_ptr_ok=graph.get("kv_ptr") == kv.data_ptr())
    lc.sleep(level=1)
    lc.wake_up()
    step("sleep1_wake_all", sum=allreduce(cleanup.group("tp")), w_ok=bool((w == rank + 1).all()))
    lc.wake_up()   # nothing asleep: no recapture
    step("noop_wake")
    lc.sleep(level=1)
    lc.wake_up(["weights"])
    step("wake_weights_again", sum=allreduce(cleanup.group("tp")))
    lc.wake_up(["kv_cache"])
    step("wake_kv_again")
    lc.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.slow
def test_extra_cleanup_gloo_two_processes_groups_and_recapture():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", str(port)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for res in results:
        s = {st["name"]: st for st in res["steps"]}
        assert s["start"]["sum"] == 3.0 and s["start"]["capture"] == 1
        base = res["base_sockets"]
        assert s["start"]["sockets"] > base  # the group's own connections
        # sleep: graphs released, group destroyed (its connections closed), no access to it
        assert s["sleep2"]["release"] == 1 and s["sleep2"]["graph_empty"]
        assert s["sleep2"]["sockets"] == base and s["sleep2"]["asleep_access"] is False
        # weights-only wake: group back and working, graphs NOT recaptured
        assert s["wake_weights"]["sum"] == 3.0 and s["wake_weights"]["sockets"] > base  # a new group, connected
        assert s["wake_weights"]["capture"] == 1 and s["wake_weights"]["graph_empty"]
        # kv wake: recaptured once, against the same KV address
        assert s["wake_kv"]["capture"] == 2 and s["wake_kv"]["kv_ptr_ok"] and s["wake_kv"]["sum"] == 3.0
        # full wake after a level-1 sleep: recaptured, weights restored, group works
        st = s["sleep1_wake_all"]
        assert st["capture"] == 3 and st["release"] == 2 and st["sum"] == 3.0 and st["w_ok"]
        assert s["noop_wake"]["capture"] == 3
        assert s["wake_weights_again"]["capture"] == 3 and s["wake_weights_again"]["sum"] == 3.0
        assert s["wake_kv_again"]["capture"] == 4 and s["wake_kv_again"]["release"] == 3


def test_extra_cleanup_order_sleep_then_wake(lifecycle):
    """Sleep: release graphs, synchronise, destroy groups; wake: restore groups, then capture."""
    order = []
    groups = iter(range(100))
    cleanup = ExtraCleanup(synchronize=lambda: order.append("sync"))
    cleanup.install(lifecycle)
    lifecycle.empty(4096, torch.uint8, tag="weights")
    lifecycle.empty(4096, torch.uint8, tag="kv_cache")

    def factory(name):
        return lambda: (order.append(f"create {name}"), (name, next(groups)))[1]

    for name in ("dp", "tp"):
        cleanup.add_group(name, factory=factory(name), destroy=lambda h: order.append(f"destroy {h[0]}"))
    cleanup.add_graphs("g", capture=lambda: order.append("capture"), release=lambda: order.append("release"))
    order.clear()
    lifecycle.sleep(level=1)
    assert order == ["release", "sync", "destroy tp", "destroy dp"]
    order.clear()
    lifecycle.wake_up()
    assert order == ["create dp", "create tp", "capture"]  # registration order, then graphs
    with pytest.raises(Exception):
        cleanup.add_group("tp", factory=factory("tp"))  # names are unique


def test_extra_cleanup_is_opt_in(lifecycle):
    assert install_extra_cleanup(lifecycle, None) is None
    assert install_extra_cleanup(lifecycle, {"sleep_mode_extra_cleanup": False}) is None
    assert lifecycle._before_sleep == [] and lifecycle._after_wake == []
    assert extra_cleanup_enabled({"sleep_mode_extra_cleanup": True})
    c = install_extra_cleanup(lifecycle, {"sleep_mode_extra_cleanup": True})
    assert isinstance(c, ExtraCleanup) and len(lifecycle._before_sleep) == 1


def test_extra_cleanup_group_access_while_asleep(lifecycle):
    c = ExtraCleanup(synchronize=lambda: None).install(lifecycle)
    lifecycle.empty(4096, torch.uint8, tag="weights")
    c.add_group("g", factory=lambda: object(), destroy=lambda h: None)
    lifecycle.sleep(level=1)
    with pytest.raises(InvalidTransitionError, match="torn down"):
        c.group("g")
    lifecycle.wake_up(["weights"])
    assert c.group("g") is not None
