"""Ascend backend: ACL virtual memory through ctypes ``libascendcl.so`` (loaded only when a
driver is created); torch_npu is imported only by ``pool()`` and NPU tensor views.  Verified
against the simulated ACL library in tests/sim, not on Ascend hardware — see docs/ascend.md."""

from unisleep.backend import Backend

from .detect import EXPANDABLE_NOTE

BACKEND = Backend(
    name="ascend",
    package=__name__,
    torch_device="npu",
    driver=".driver:AscendDriver",
    detect=".detect:detect",
    priority=30,
    store=".store:AclHostStore",
    collective=".collective",
    pool=".pool",
    graph_class="torch_npu.npu.graphs:NPUGraph",  # capture_begin/capture_end in Python since torch_npu 2.1
    environment_warnings=".detect:environment_warnings",
    alloc_conf_vars=("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    expandable_note=EXPANDABLE_NOTE,
    packages=(("torch_npu", "torch_npu"), ("vllm_ascend", "vllm_ascend")),
    extra="ascend",
    vllm_worker=".vllm_worker",
)

_LAZY = {"AscendDriver": ".driver", "AclHandle": ".driver"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = ["BACKEND", *_LAZY]
