"""Who a transfer group's members are: :class:`Peer` (rank, device, host, process, user and the
namespaces and boot that tell whether two members share a machine), as the group's records carry
it."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _netns() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Peer:
    rank: int
    device_key: str
    host: str
    pid: int
    uid: int = -1
    pidns: int = 0
    boot: str = ""
    netns: int = 0

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"
def _peer_of(body: dict) -> Peer:
    return Peer(body["rank"], body["device_key"], body["host"], body["pid"], body["uid"], body["pidns"], body["boot"],
                body["netns"])


def _same_device_ranks(peers: list[Peer]) -> set[int]:
    seen: dict[str, list[int]] = {}
    for p in peers:
        seen.setdefault(p.device_key, []).append(p.rank)
    return {r for ranks in seen.values() if len(ranks) > 1 for r in ranks}
