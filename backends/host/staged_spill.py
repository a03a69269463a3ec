"""Spill files for device memory (:class:`StagedSpillStore`): the host spill store written and
read through one host staging buffer."""

from __future__ import annotations

import os
from typing import Optional

from unisleep.errors import BackupCorruptError
from unisleep.units import human_bytes

from .spill_store import SpillStore, _buffer, _read_hashed


class StagedSpillStore(SpillStore):
    """Spill files for device memory (``MemoryLifecycle(backup_to="disk")`` on an accelerator):
    the same files, checksums, layouts and trust rules as :class:`SpillStore`, written and read
    one piece at a time through one host staging buffer (``STAGE`` bytes, made at the first
    use, given back by :meth:`release_unused`).  A host destination (``read_backup``) is read
    directly, as by :class:`SpillStore`.  The copies between the device and the staging buffer
    are torch's (blocking ``copy_``), so this store is the same on every accelerator.  ``pin``:
    page-lock the staging buffer (torch's pinned allocator then caches it for the process:
    "given back" returns it to that cache, not to the system); off by default — a device copy
    from ordinary memory is still faster than the disk it feeds."""

    #: bytes per staged piece (each piece is one checksum)
    STAGE = 64 << 20
    #: no backup encoding through the staging buffer (the encoded path is the host store's own)
    encodings = ()

    def __init__(self, budget_bytes: Optional[int], spill_dir: Optional[str], layout: str = "private",
                 pin: bool = False):
        super().__init__(budget_bytes, spill_dir, layout)
        self.pin = pin
        self._stage = None

    def _staging(self):
        import torch

        if self._stage is None:
            self._stage = torch.empty(self.STAGE, dtype=torch.uint8, pin_memory=self.pin)
        return self._stage

    @staticmethod
    def _on_host(t) -> bool:
        return t.device.type == "cpu"

    def save_progressively(self, key, src, piece: int, on_written) -> None:
        if self._on_host(src):
            return super().save_progressively(key, src, piece, on_written)
        stage = self._staging()

        def fetch(lo: int, hi: int):
            stage[: hi - lo].copy_(src[lo:hi])  # blocking: the bytes are on the host after it
            return _buffer(stage.data_ptr(), hi - lo)

        self._write_pieces(key, src.numel(), min(piece, self.STAGE), fetch, on_written)

    def save(self, key, src) -> None:
        self.save_progressively(key, src, self.STAGE, lambda end: None)

    def load_range(self, key, offset: int, dst) -> None:
        if self._on_host(dst):
            return super().load_range(key, offset, dst)
        name, total, pieces = self._entry(key)
        path = self._full(name)
        n = dst.numel()
        if offset + n > total:
            raise ValueError(f"backup {key} holds {total} bytes; cannot read {n} at {offset}")
        stage = self._staging()
        if any(p_len > stage.numel() for _, p_len, _ in pieces):  # pragma: no cover - written by another store
            raise BackupCorruptError(f"the backup file {path} has pieces larger than the staging buffer", path=path,
                                     nbytes=total)
        fd, own = self._open_to_read(name, path, total)
        try:
            if os.fstat(fd).st_size < total:
                raise BackupCorruptError(f"the backup file {path} holds less than {human_bytes(total)}: it was "
                                         "truncated while asleep", path=path, nbytes=total)
            for i, (p_off, p_len, p_sum) in enumerate(pieces):
                lo, hi = max(offset, p_off), min(offset + n, p_off + p_len)
                if lo >= hi:
                    continue
                got = _read_hashed(fd, _buffer(stage.data_ptr(), p_len), p_off, path, total)
                if got != p_sum:
                    raise BackupCorruptError(
                        f"the backup file {path} is corrupt: piece {i} (bytes {p_off}..{p_off + p_len}) fails its "
                        "XXH3 checksum; the bytes were not exposed", path=path, nbytes=total,
                    )
                dst[lo - offset: hi - offset].copy_(stage[lo - p_off: hi - p_off])  # blocking
        finally:
            if own:
                os.close(fd)

    def residency(self) -> dict[str, int]:
        out = super().residency()
        if self._stage is not None:
            out["pinned" if self.pin else "pageable"] += self._stage.numel()
        return out

    def release_unused(self) -> int:
        """The staging buffer goes back (made again at the next sleep)."""
        if self._stage is None:
            return super().release_unused()
        n, self._stage = self._stage.numel(), None
        return n + super().release_unused()

    def close(self) -> None:
        self._stage = None
        super().close()
