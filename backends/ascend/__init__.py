"""Ascend backend: ACL virtual memory through ctypes ``libascendcl.so`` (loaded only when a
driver is created); torch_npu is imported only by ``pool()`` and NPU tensor views.  Verified
against the simulated ACL library in tests/sim, not on Ascend hardware — see docs/ascend.md."""

from .descriptor import BACKEND

_LAZY = {"AscendDriver": ".driver", "AclHandle": ".driver"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = ["BACKEND", *_LAZY]
