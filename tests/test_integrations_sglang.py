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
