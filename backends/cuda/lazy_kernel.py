"""A Triton kernel built on first use (model-load time, through the driver's warm-up), for the
CUDA backend's kernel modules (:mod:`.checksum`, :mod:`.host_reads`).

A build that fails (no Triton, no compiler for this GPU) is remembered: the callers fall back to
their slower path at once, every time, without trying to build again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

log = logging.getLogger("unisleep.cuda")


class LazyKernel:
    def __init__(self, build: Callable[[], Any], what: str):
        self._build = build
        self.what = what  # for the log: the kernel, and what runs without it
        self.kernel: Any = None
        self.error: Optional[BaseException] = None

    def get(self):
        """The compiled kernel, or None when it cannot be built (:attr:`error` says why)."""
        if self.kernel is None and self.error is None:
            try:
                self.kernel = self._build()
            except Exception as e:  # remembered: the callers take their slower path (module docstring)
                self.error = e
                log.debug("%s unavailable: %s", self.what, e)
        return self.kernel

    def disable(self, error: BaseException) -> None:
        """Use the fallback from now on (the kernel failed a check)."""
        self.kernel, self.error = None, error
