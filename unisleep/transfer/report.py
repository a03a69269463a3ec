"""``TransferReport``: what one weight update did, as ``WeightSender.send`` and
``WeightReceiver.receive`` return it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransferReport:
    """What one update did (returned by ``send`` and ``receive``)."""

    version: Any
    previous_version: Any
    path: str
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    metadata_reused: bool = False
    verified: bool = True
    phases: dict = field(default_factory=dict)
    intrusions: list = field(default_factory=list)  # what the group refused during this update
    #: the receiver's names this update left out because they are preserved across the engine's
    #: sleep (``WeightReceiver(require_complete=...)``); empty when coverage is not checked
    omitted: list = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("version", "previous_version", "path", "tensors", "bytes", "buckets",
                                            "seconds", "metadata_reused", "verified", "phases", "intrusions",
                                            "omitted")}
        d["gbps"] = self.gbps
        return d

    def __str__(self) -> str:
        return (f"version {self.previous_version!r} -> {self.version!r} over {self.path}: {self.tensors} tensors, "
                f"{self.bytes / 2**30:.3f} GiB in {self.buckets} buckets, {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s)"
                + (f"; {len(self.omitted)} preserved tensor(s) left out" if self.omitted else ""))
