"""Host colocated IPC: bucket memory is a memfd; its fd travels over a Unix socket
(SCM_RIGHTS) and the receiver maps the same pages.  No bytes go through a socket."""

from __future__ import annotations

import mmap
import os

#: where export buffers live (the receiver copies out of them into its own memory)
KIND = "memfd"


class ExportBuffer:
    """Sender side: ``nbytes`` of shareable memory as a uint8 tensor (``.tensor``); ``fd()`` is
    the descriptor to pass to receivers."""

    def __init__(self, nbytes: int, device_index: int = 0):
        import torch

        self.nbytes = nbytes
        self._fd = os.memfd_create("unisleep-transfer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, max(nbytes, 1))
            self._map = mmap.mmap(self._fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception:
            os.close(self._fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ImportedBuffer:
    """Receiver side: map a received fd (the fd is closed here once mapped)."""

    def __init__(self, fd: int, nbytes: int, device_index: int = 0):
        import torch

        self.nbytes = nbytes
        try:
            self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None


def synchronize(device_index: int = 0) -> None:
    """Host copies are synchronous."""
