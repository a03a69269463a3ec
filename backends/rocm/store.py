"""Level-1 backups of ROCm memory: pinned host buffers (``hipHostMalloc``) filled with
``hipMemcpy`` device-to-host and copied back host-to-device on wake."""

from __future__ import annotations

from ctypes import byref, c_void_p
from typing import Callable, Optional

from unisleep.backup import HostBufferStore

from . import hip


class HipHostStore(HostBufferStore):
    def __init__(self, api: "hip.HipApi", budget_bytes: Optional[int], is_device=None,
                 bind: Optional[Callable[[], None]] = None):
        """``bind`` makes the calling thread's current device the driver's (the store's copies
        run on whatever thread sleeps or wakes); default: nothing bound."""
        super().__init__(budget_bytes, "pinned host memory (hipHostMalloc)", is_device)
        self.api = api
        self.bind = bind or (lambda: None)

    def _alloc_host(self, nbytes: int) -> int:
        self.bind()
        p = c_void_p()
        self.api.call("hipHostMalloc", ptr=byref(p), size=nbytes, flags=hip.hipHostMallocDefault,
                      hint="pinned host memory for a backup")
        return p.value

    def _free_host(self, ptr: int) -> None:
        self.bind()
        self.api.call("hipHostFree", ptr=ptr)

    def _to_host(self, dst: int, capacity: int, src: int, nbytes: int) -> None:
        self.bind()
        self.api.call("hipMemcpy", dst=dst, src=src, sizeBytes=nbytes, kind=hip.hipMemcpyDeviceToHost)

    def _to_device(self, dst: int, capacity: int, src: int, nbytes: int) -> None:
        self.bind()
        self.api.call("hipMemcpy", dst=dst, src=src, sizeBytes=nbytes, kind=hip.hipMemcpyHostToDevice)
