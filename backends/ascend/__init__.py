"""Ascend backend: ACL virtual memory through ctypes ``libascendcl.so`` (loaded only when a
driver is created); torch_npu is imported only by ``pool()`` and NPU tensor views.  Verified
against the simulated ACL library in tests/sim, not on Ascend hardware — see docs/ascend.md."""

from .driver import AclHandle, AscendDriver

__all__ = ["AscendDriver", "AclHandle"]
