"""Host backend: memfd/mmap memory that really sleeps and wakes, without an accelerator.

It is the fallback of detection (priority 0: every other backend is asked first) and the
embedded default on a machine without an accelerator.
"""

from .descriptor import BACKEND


def __getattr__(name):
    if name == "HostDriver":
        from .driver import HostDriver

        return HostDriver
    raise AttributeError(name)


__all__ = ["BACKEND", "HostDriver"]
