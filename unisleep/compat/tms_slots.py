"""The facade's tags (:mod:`.torch_memory_saver`): a tms tag's slot in a lifecycle, the handle
``region()`` yields, and the small checks and groupings of slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError

NONE, CPU, DISK = "none", "cpu", "disk"  # backup kinds

@dataclass
class _Slot:
    """One lifecycle tag behind a tms tag: (tms tag, backup kind, device, lifecycle tag, lifecycle)."""

    tag: str
    kind: str
    device: int
    ltag: str
    lc: Any  # MemoryLifecycle


class RegionHandle:
    """What ``with torch_memory_saver.region(...) as r`` yields (tms yields ``None``, so code
    written for tms is unaffected): ``r.empty`` / ``r.adopt`` put tensors into the region's tag
    on every platform — on the host backend they are the only way in."""

    def __init__(self, saver: "TorchMemorySaver", slot: _Slot):
        self._saver, self._slot = saver, slot

    @property
    def tag(self) -> str:
        return self._slot.tag

    def empty(self, shape, dtype=None):
        """A new tensor in the region's tag (zeros), on the platform's device."""
        return self._saver._empty(self._slot, shape, dtype)

    def adopt(self, obj):
        """Move ``obj``'s tensors (a module, optimizer state, tensor, dict…) into the region's
        tag in place (see ``MemoryLifecycle.adopt``).  Returns ``obj``."""
        return self._saver._adopt(self._slot, obj)



def _check_tag(tag) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"tag must be a non-empty string, got {tag!r}")


def _names(slots) -> str:
    return ", ".join(sorted({repr(s.tag) for s in slots}))


def _by_lifecycle(slots) -> list[tuple[Any, list[_Slot]]]:
    """``slots`` grouped by lifecycle, disk-backed lifecycles first (then in first-seen order)."""
    groups: dict[int, tuple[Any, list[_Slot]]] = {}
    for s in sorted(slots, key=lambda s: s.kind != DISK):
        groups.setdefault(id(s.lc), (s.lc, []))[1].append(s)
    return list(groups.values())


def _pool_key(pool):
    return tuple(pool) if isinstance(pool, (tuple, list)) else pool
