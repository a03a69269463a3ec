"""Level-1 backups of Ascend memory: pinned host buffers (``aclrtMallocHost``) filled with
``aclrtMemcpy(dst, destMax, src, count, DEVICE_TO_HOST)`` and copied back on wake (``destMax`` is
the destination's capacity in bytes — an argument CUDA and HIP do not have)."""

from __future__ import annotations

from ctypes import byref, c_void_p
from typing import Callable, Optional

from unisleep.backup import HostBufferStore

from . import acl


class AclHostStore(HostBufferStore):
    def __init__(self, api: "acl.AclApi", budget_bytes: Optional[int], is_device=None,
                 bind: Optional[Callable[[], None]] = None):
        """``bind`` makes the calling thread's current device the driver's (the store's copies
        run on whatever thread sleeps or wakes); default: nothing bound."""
        super().__init__(budget_bytes, "pinned host memory (aclrtMallocHost)", is_device)
        self.api = api
        self.bind = bind or (lambda: None)

    def _alloc_host(self, nbytes: int) -> int:
        self.bind()
        p = c_void_p()
        self.api.call("aclrtMallocHost", hostPtr=byref(p), size=nbytes, hint="pinned host memory for a backup")
        return p.value

    def _free_host(self, ptr: int) -> None:
        self.bind()
        self.api.call("aclrtFreeHost", hostPtr=ptr)

    def _to_host(self, dst: int, capacity: int, src: int, nbytes: int) -> None:
        self.bind()
        self.api.call("aclrtMemcpy", dst=dst, destMax=capacity, src=src, count=nbytes, kind=acl.ACL_MEMCPY_DEVICE_TO_HOST)

    def _to_device(self, dst: int, capacity: int, src: int, nbytes: int) -> None:
        self.bind()
        self.api.call("aclrtMemcpy", dst=dst, destMax=capacity, src=src, count=nbytes, kind=acl.ACL_MEMCPY_HOST_TO_DEVICE)
