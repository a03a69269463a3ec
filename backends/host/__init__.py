"""Host backend: memfd/mmap memory that really sleeps and wakes, without an accelerator."""

from .driver import HostDriver

__all__ = ["HostDriver"]
