"""Running out of file descriptors, said as a :class:`~unisleep.errors.DescriptorLimitError` that
names the limit and the fix."""

from __future__ import annotations

import errno
import os
from typing import Optional

from ..errors import DescriptorLimitError


def descriptor_error(e: OSError, what: str, who: str = "this process") -> Optional[DescriptorLimitError]:
    """A :class:`DescriptorLimitError` for ``e`` when it is EMFILE/ENFILE (else None)."""
    if e.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:
        n = -1
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    scope = "the system's file table is full (fs.file-max)" if e.errno == errno.ENFILE else \
        f"it holds {n} descriptors, its limit (RLIMIT_NOFILE) is {soft} (hard {hard})"
    return DescriptorLimitError(
        f"{who} (pid {os.getpid()}) ran out of file descriptors {what}: {scope}; raise the limit "
        f"(ulimit -n {min(hard, max(soft * 4, 65536)) if hard > 0 else 65536}, or resource.setrlimit in the "
        f"process) or find what holds them (ls -l /proc/{os.getpid()}/fd)")
