"""unisleep.integrations.sglang against SGLang's released source (sglang==0.5.10.post1, the
version AReaL 1.0.4 pins, installed without dependencies by the Makefile).

SGLang cannot run here: importing its request types pulls in its scheduler, Triton and a CUDA
torchvision.  So its side is read from the installed package's own files (parsed, not imported,
not copied): the keywords ``Engine.update_weights_from_tensor`` /
``update_weights_from_distributed`` take and the fields of ``UpdateWeightsFromDistributedReqInput``.
The adapters are then driven against an engine object that accepts exactly those keywords
(a stand-in for SGLang's Engine, labelled so) and loads what it gets into a real torch module.
"""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest
import torch

from unisleep.errors import EngineError, InvalidArgumentError
from unisleep.integrations.sglang import DistributedUpdate, TensorUpdate, dtype_name

_spec = importlib.util.find_spec("sglang")
SGLANG = _spec.submodule_search_locations[0] if _spec else None
pytestmark = pytest.mark.skipif(SGLANG is None, reason="SGLang is not installed (make test installs sglang==0.5.10.post1 --no-deps)")


def _tree(rel: str) -> ast.Module:
    with open(os.path.join(SGLANG, rel)) as f:
        return ast.parse(f.read())


def _method_params(cls: str, method: str) -> list[str]:
    for node in ast.walk(_tree("srt/entrypoints/engine.py")):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    return [a.arg for a in f.args.args[1:] + f.args.kwonlyargs]
    raise AssertionError(f"{cls}.{method} not found in SGLang's engine.py")


def _fields(cls: str) -> list[str]:
    for node in ast.walk(_tree("srt/managers/io_struct.py")):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
    raise AssertionError(f"{cls} not found in SGLang's io_struct.py")


class StandInEngine:
    """NOT SGLang: accepts exactly the keywords SGLang's Engine methods declare (read from its
    source above) and loads the tensors into a real module; answers (success, message) as
    SGLang's tokenizer manager does."""

    def __init__(self, model: torch.nn.Module, refuse: bool = False):
        self.model, self.refuse, self.calls = model, refuse, []
        self.tensor_params = set(_method_params("Engine", "update_weights_from_tensor"))
        self.dist_params = set(_method_params("Engine", "update_weights_from_distributed"))

    def update_weights_from_tensor(self, **kw):
        assert set(kw) <= self.tensor_params, set(kw) - self.tensor_params
        self.calls.append(("tensor", kw))
        if self.refuse:
            return False, "refused by the stand-in"
        self.model.load_state_dict(dict(kw["named_tensors"]), strict=False)
        return True, "Succeeded"

    def update_weights_from_distributed(self, **kw):
        assert set(kw) <= self.dist_params, set(kw) - self.dist_params
        self.calls.append(("distributed", kw))
        return True, "Succeeded"


def test_request_keywords_are_sglangs():
    fields = _fields("UpdateWeightsFromDistributedReqInput")
    assert {"names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"} <= set(fields)
    assert {"named_tensors", "load_format", "flush_cache"} <= set(_method_params("Engine", "update_weights_from_tensor"))
    assert "serialized_named_tensors" in _fields("UpdateWeightsFromTensorReqInput")
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        assert getattr(torch, dtype_name(dt)) is dt  # as SGLang's model runner reads it back


def test_tensor_update_loads_what_it_is_given_and_raises_on_refusal():
    model = torch.nn.Linear(8, 4)
    new = {"weight": torch.full((4, 8), 0.5), "bias": torch.arange(4.0)}
    engine = StandInEngine(model)
    TensorUpdate(engine, flush_cache=False)(list(new.items()))
    assert torch.equal(model.weight.detach(), new["weight"]) and torch.equal(model.bias.detach(), new["bias"])
    kind, kw = engine.calls[-1]
    assert kind == "tensor" and kw["flush_cache"] is False and kw["load_format"] is None
    with pytest.raises(EngineError, match="refused"):
        TensorUpdate(StandInEngine(model, refuse=True))(new)
    with pytest.raises(InvalidArgumentError):
        TensorUpdate(object())


def test_distributed_update_asks_and_broadcasts_in_order(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        engine = StandInEngine(torch.nn.Linear(2, 2))
        pairs = [("a.weight", torch.ones(3, 2, dtype=torch.bfloat16)), ("b", torch.zeros(5, dtype=torch.int64))]
        DistributedUpdate(engine, group, group_name="g1")(pairs)
        kind, kw = engine.calls[-1]
        assert kind == "distributed"
        assert kw["names"] == ["a.weight", "b"] and kw["dtypes"] == ["bfloat16", "int64"]
        assert kw["shapes"] == [[3, 2], [5]] and kw["group_name"] == "g1"
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------ SGLang's own code, run on the CPU
# SGLang's package does not import here (``sglang/__init__`` needs IPython, its model runner a
# CUDA stack), so the test runs SGLang's own code from its installed files: whole modules that
# import only the standard library and torch (``weight_sync/tensor_bucket.py``,
# ``utils/network.py``, ``utils/torch_memory_saver_adapter.py``) are loaded by their path, and the
# functions this needs from modules that do not import here are compiled from those files' own
# text, unchanged (``ModelRunner.init_weights_update_group`` / ``update_weights_from_distributed``
# / ``_update_bucketed_weights_from_distributed`` from ``model_executor/model_runner.py``,
# ``init_custom_process_group`` from ``utils/common.py``).  What stands in: the model runner's
# ``self`` (``tp_rank``, ``device="cpu"``, ``_model_update_group``, and a ``model`` whose
# ``load_weights`` is torch's ``load_state_dict``), and the scheduler's hop between SGLang's
# ``Engine`` and its model runner (a pipe to the child process that plays the model runner).

_SGLANG_SIDE = r'''
import ast, importlib.util, json, logging, os, sys, types
import torch, torch.distributed as dist

S = os.environ["SGLANG_DIR"]

def load(rel, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(S, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

def compiled(rel, names, ns, cls=None):
    """SGLang's own functions (or ``cls``'s methods), compiled from its installed file."""
    tree = ast.parse(open(os.path.join(S, rel)).read())
    body = tree.body
    if cls:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(compile(ast.Module([node], []), os.path.join(S, rel), "exec"), ns)
    return ns

bucket = load("srt/weight_sync/tensor_bucket.py", "sglang_tensor_bucket")
network = load("srt/utils/network.py", "sglang_network")
common_ns = {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])}
compiled("srt/utils/common.py", {"init_custom_process_group"}, common_ns)
'''

_MODEL_RUNNER = _SGLANG_SIDE + r'''
from typing import Optional
ns = {"torch": torch, "logger": logging.getLogger("sglang"), "Optional": Optional,
      "NetworkAddress": network.NetworkAddress, "init_custom_process_group": common_ns["init_custom_process_group"],
      "FlattenedTensorBucket": bucket.FlattenedTensorBucket}
compiled("srt/model_executor/model_runner.py",
         {"init_weights_update_group", "update_weights_from_distributed", "_update_bucketed_weights_from_distributed"},
         ns, cls="ModelRunner")
torch.manual_seed(0)
model = torch.nn.Linear(6, 4)
model.load_weights = lambda pairs: model.load_state_dict(dict(pairs), strict=False)
runner = types.SimpleNamespace(tp_rank=0, device="cpu", _model_update_group={}, model=model)
for f in ("init_weights_update_group", "update_weights_from_distributed", "_update_bucketed_weights_from_distributed"):
    setattr(runner, f, types.MethodType(ns[f], runner))
# SGLang's model runner runs inside its own default group (asserted by init_weights_update_group)
dist.init_process_group("gloo", init_method="file://" + os.environ["PG_FILE"], rank=0, world_size=1)
for line in sys.stdin:          # the scheduler's hop: one request per line
    req = json.loads(line)
    fn = getattr(runner, req.pop("call"))
    ok, msg = fn(**req)
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    print(json.dumps({"ok": ok, "message": msg, "state": state}), flush=True)
'''


class PipedEngine:
    """NOT SGLang's Engine: forwards ``init_weights_update_group`` / ``update_weights_from_distributed``
    (with SGLang's keywords) to a child process running SGLang's own ModelRunner methods."""

    def __init__(self, proc):
        self.proc, self.answers = proc, []
        self.dist_params = set(_method_params("Engine", "update_weights_from_distributed"))
        self.group_params = set(_method_params("Engine", "init_weights_update_group"))

    def _ask(self, call, kw):
        import json

        self.proc.stdin.write(json.dumps({"call": call, **kw}) + "\n")
        self.proc.stdin.flush()
        ans = json.loads(self.proc.stdout.readline())
        self.answers.append(ans)
        return ans["ok"], ans["message"]

    def init_weights_update_group(self, **kw):
        assert set(kw) <= self.group_params, set(kw) - self.group_params
        return self._ask("init_weights_update_group", kw)

    def update_weights_from_distributed(self, **kw):
        assert set(kw) <= self.dist_params, set(kw) - self.dist_params
        kw.pop("flush_cache")  # the scheduler's part: the model runner does not take it
        return self._ask("update_weights_from_distributed", kw)


@pytest.mark.slow
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_rank0_group_and_update_against_sglangs_model_runner(tmp_path, load_format, monkeypatch):
    import subprocess
    import sys

    import torch.distributed as dist

    from unisleep.engines.vllm_server import free_port
    from unisleep.integrations.sglang import init_update_group

    monkeypatch.setenv("SGLANG_DIR", SGLANG)
    env = dict(os.environ, PG_FILE=str(tmp_path / "sglang-default-pg"))
    proc = subprocess.Popen([sys.executable, "-c", _MODEL_RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        ns: dict = {}
        exec(_SGLANG_SIDE, ns)   # this process: SGLang's own init_custom_process_group and bucket
        engine = PipedEngine(proc)
        group = init_update_group(engine, master_port=free_port(), world_size=2, group_name="wug",
                                  timeout_s=60, make_group=ns["common_ns"]["init_custom_process_group"])
        assert engine.answers[-1]["ok"], engine.answers
        new = [("weight", torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7), ("bias", torch.full((4,), -2.5))]
        DistributedUpdate(engine, group, group_name="wug", load_format=load_format, timeout_s=60,
                          bucket_class=ns["bucket"].FlattenedTensorBucket if load_format else None)(new)
        got = engine.answers[-1]
        assert got["ok"], got
        assert got["state"] == {n: t.tolist() for n, t in new}, got   # SGLang's runner loaded exactly these
        dist.destroy_process_group(group)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_tensor_update_refuses_flattened_bucket_by_name():
    with pytest.raises(InvalidArgumentError, match="flattened_bucket"):
        TensorUpdate(StandInEngine(torch.nn.Linear(2, 2)), load_format="flattened_bucket")


def test_init_update_group_refuses_a_remote_unauthenticated_group():
    from unisleep.integrations.sglang import init_update_group

    with pytest.raises(InvalidArgumentError, match="not authenticated"):
        init_update_group(StandInEngine(torch.nn.Linear(2, 2)), master_address="10.1.2.3", master_port=1, world_size=2)


_SAVER = r'''
import importlib.util, json, os
import unisleep.compat
unisleep.compat.install()
import torch
spec = importlib.util.spec_from_file_location("sglang_tms_adapter", os.environ["SGLANG_ADAPTER"])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
adapter = mod.TorchMemorySaverAdapter.create(enable=True)   # what --enable-memory-saver builds
saver = mod._memory_saver
out = {"adapter": type(adapter).__name__, "enabled": adapter.enabled, "saver": type(saver).__module__}
torch.manual_seed(0)
with adapter.region("weights", enable_cpu_backup=True):    # ModelRunner.load_model's region
    model = torch.nn.Linear(256, 256)
with adapter.region("kv_cache"):                           # the KV pool's region
    kv = torch.ones(1 << 20, dtype=torch.uint8)
want = [p.detach().clone() for p in model.parameters()]
ptrs = [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()]
tags = ("weights", "kv_cache")
out["before"] = {t: saver.resident_bytes(t) for t in tags}
adapter.pause("kv_cache"); adapter.pause("weights")       # release_memory_occupation's order
out["paused"] = {t: saver.resident_bytes(t) for t in tags}
adapter.resume("weights"); adapter.resume("kv_cache")
out["exact"] = all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want))
out["same_addresses"] = ptrs == [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()]
out["kv_zeroed"] = int(kv.max()) == 0
print(json.dumps(out))
'''


@pytest.mark.slow
def test_sglangs_memory_saver_adapter_runs_on_the_facade():
    """SGLang's own ``TorchMemorySaverAdapter`` (``--enable-memory-saver``), loaded from its
    installed file, on unisleep's torch_memory_saver facade (host platform, whole-process capture:
    SGLang allocates with plain torch inside its regions).  Not run: its ``cuda_graph()`` region
    (no graphs on a CPU)."""
    import json
    import subprocess
    import sys

    from unisleep.compat.torch_memory_saver import native_library_path

    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k not in ("UNISLEEP_TMS", "LD_PRELOAD")}
    env.update(UNISLEEP_PLATFORM="host", LD_PRELOAD=native_library_path(), TMS_INIT_ENABLE="1",
               SGLANG_ADAPTER=os.path.join(SGLANG, "srt", "utils", "torch_memory_saver_adapter.py"),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", _SAVER], capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["adapter"] == "_TorchMemorySaverAdapterReal" and got["enabled"] is True, got
    assert got["saver"] == "unisleep.compat.torch_memory_saver", got
    assert got["before"]["weights"] >= (256 * 256 + 256) * 4 and got["before"]["kv_cache"] >= 1 << 20, got
    assert got["paused"] == {"weights": 0, "kv_cache": 0}, got
    assert got["exact"] and got["same_addresses"] and got["kv_zeroed"], got
