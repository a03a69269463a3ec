"""Level-1 backups of Ascend memory: pinned host buffers (``aclrtMallocHost``) filled with
``aclrtMemcpy(dst, destMax, src, count, DEVICE_TO_HOST)`` and copied back on wake."""

from __future__ import annotations

from ctypes import byref, c_void_p
from typing import Optional

from unisleep.driver import BackupStore
from unisleep.errors import HostBudgetError

from . import acl


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


class AclHostStore(BackupStore):
    def __init__(self, api: "acl.AclApi", budget_bytes: Optional[int]):
        self.api = api
        self.budget = budget_bytes
        self.where = "pinned host memory (aclrtMallocHost)"
        self._bufs: dict[tuple[int, int], tuple[int, int]] = {}

    @property
    def held_bytes(self) -> int:
        return sum(n for _, n in self._bufs.values())

    def ensure_fits(self, nbytes: int) -> None:
        if self.budget is not None and self.held_bytes + nbytes > self.budget:
            raise HostBudgetError(
                f"a level-1 backup of {nbytes / 2**30:.2f} GiB would exceed host_budget_bytes="
                f"{self.budget / 2**30:.2f} GiB ({self.held_bytes / 2**30:.2f} GiB held). Raise the budget or "
                "sleep at level 2. Nothing was released."
            )
        avail = host_available_bytes()
        if nbytes + (256 << 20) > avail:
            raise HostBudgetError(
                f"a level-1 backup of {nbytes / 2**30:.2f} GiB does not fit in host memory "
                f"({avail / 2**30:.2f} GiB available). Sleep at level 2. Nothing was released."
            )

    def save(self, key, src) -> None:
        n = src.numel()
        old = self._bufs.get(key)
        if old is None or old[1] != n:
            self.drop(key)
            p = c_void_p()
            self.api.call("aclrtMallocHost", byref(p), n, hint="pinned host memory for a backup")
            self._bufs[key] = (p.value, n)
        ptr, cap = self._bufs[key]
        # destMax is the capacity of the destination in bytes
        self.api.call("aclrtMemcpy", ptr, cap, src.data_ptr(), n, acl.ACL_MEMCPY_DEVICE_TO_HOST)

    def load(self, key, dst) -> None:
        ptr, n = self._bufs[key]
        if dst.numel() != n:
            raise ValueError(f"backup {key} holds {n} bytes, destination has {dst.numel()}")
        self.api.call("aclrtMemcpy", dst.data_ptr(), dst.numel(), ptr, n, acl.ACL_MEMCPY_HOST_TO_DEVICE)

    def has(self, key) -> bool:
        return key in self._bufs

    def drop(self, key) -> None:
        entry = self._bufs.pop(key, None)
        if entry:
            self.api.call("aclrtFreeHost", entry[0])

    def close(self) -> None:
        for key in list(self._bufs):
            try:
                self.drop(key)
            except Exception:
                pass
