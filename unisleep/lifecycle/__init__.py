"""The memory lifecycle: :class:`MemoryLifecycle` (the verbs, in :mod:`.memory`) over its
parts — :mod:`.state`, :mod:`.adoption`, :mod:`.planning`, :mod:`.rollback` and
:mod:`.progressive` (copies in flight)."""

from .memory import MemoryLifecycle
from .state import AWAKE, CLOSED, DISCARDED, LEVELS, LOST, OFFLOADED, SLEEPING, WAKING, Report

__all__ = ["MemoryLifecycle", "Report", "AWAKE", "OFFLOADED", "DISCARDED", "LOST", "WAKING", "SLEEPING", "CLOSED",
           "LEVELS"]
