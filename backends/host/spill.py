"""Level-1 backups of host memory: spill files that really leave the process's RAM."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import warnings
from typing import Optional

from unisleep.driver import BackupStore
from unisleep.errors import HostBudgetError

log = logging.getLogger("unisleep.host")

RAM_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "shm"}


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` lives on (longest mount-point match in /proc/mounts)."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def default_spill_parent() -> str:
    """Where spill files go by default: $UNISLEEP_SPILL_DIR, else the temp dir unless it is in
    RAM (tmpfs), else /var/tmp, else ~/.cache/unisleep."""
    env = os.environ.get("UNISLEEP_SPILL_DIR")
    if env:
        return env
    for cand in (tempfile.gettempdir(), "/var/tmp", os.path.expanduser("~/.cache/unisleep")):
        try:
            os.makedirs(cand, exist_ok=True)
        except OSError:
            continue
        if filesystem_type(cand) not in RAM_FILESYSTEMS and os.access(cand, os.W_OK):
            return cand
    return tempfile.gettempdir()


def _buffer(ptr: int, n: int):
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class SpillStore(BackupStore):
    """One file per backed-up range under a private directory in ``spill_dir``.

    Writing is a single ``pwrite`` from the resident pages; reading is a ``preadv`` straight into
    the freshly mapped memory.  Dropping a backup unlinks its file, so disk is returned at once.
    """

    def __init__(self, budget_bytes: Optional[int], spill_dir: Optional[str]):
        parent = spill_dir or default_spill_parent()
        os.makedirs(parent, exist_ok=True)
        self.fstype = filesystem_type(parent)
        if self.fstype in RAM_FILESYSTEMS:
            msg = (
                f"spill_dir {parent!r} is on {self.fstype}, which lives in RAM: level-1 backups written "
                "there free no memory. Pass spill_dir= (or set UNISLEEP_SPILL_DIR) to a disk-backed directory."
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            log.warning(msg)
        self.dir = tempfile.mkdtemp(prefix=f"unisleep-{os.getpid()}-", dir=parent)
        self.where = f"spill files in {self.dir} ({self.fstype})"
        self.budget = budget_bytes
        self._files: dict[tuple[int, int], tuple[str, int]] = {}

    # -- accounting
    @property
    def held_bytes(self) -> int:
        return sum(n for _, n in self._files.values())

    def free_space(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def ensure_fits(self, nbytes: int) -> None:
        if self.budget is not None and self.held_bytes + nbytes > self.budget:
            raise HostBudgetError(
                f"a level-1 backup of {nbytes / 2**30:.2f} GiB would exceed host_budget_bytes="
                f"{self.budget / 2**30:.2f} GiB ({self.held_bytes / 2**30:.2f} GiB already held). "
                "Raise host_budget_bytes, or sleep at level 2 (no backup). Nothing was released."
            )
        free = self.free_space()
        if nbytes + (64 << 20) > free:
            raise HostBudgetError(
                f"a level-1 backup of {nbytes / 2**30:.2f} GiB does not fit in {self.dir} "
                f"({free / 2**30:.2f} GiB free). Point spill_dir= at a larger disk, or sleep at level 2. "
                "Nothing was released."
            )

    # -- data
    def _path(self, key):
        return os.path.join(self.dir, f"{key[0]}-{key[1]}.bin")

    def save(self, key, src) -> None:
        self.save_progressively(key, src, max(src.numel(), 1), lambda end: None)

    def save_progressively(self, key, src, piece: int, on_written) -> None:
        """Like :meth:`save`, in ``piece``-byte writes; ``on_written(end)`` is called after each one
        so the caller can release memory that is already safe on disk."""
        n = src.numel()
        path = self._path(key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            mv, done = _buffer(src.data_ptr(), n), 0
            while done < n:
                end = min(n, done + piece)
                while done < end:
                    done += os.pwrite(fd, mv[done:end], done)
                on_written(done)
        finally:
            os.close(fd)
        self._files[key] = (path, n)

    def load(self, key, dst) -> None:
        n = self._files[key][1]
        if dst.numel() != n:
            raise ValueError(f"backup {key} holds {n} bytes, destination has {dst.numel()}")
        self.load_range(key, 0, dst)

    def load_range(self, key, offset: int, dst) -> None:
        """Read ``dst.numel()`` bytes of backup ``key`` starting at ``offset`` into ``dst``."""
        path, total = self._files[key]
        n = dst.numel()
        if offset + n > total:
            raise ValueError(f"backup {key} holds {total} bytes; cannot read {n} at {offset}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mv, done = _buffer(dst.data_ptr(), n), 0
            while done < n:
                got = os.preadv(fd, [mv[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"spill file {path} ended after {offset + done} of {total} bytes")
                done += got
        finally:
            os.close(fd)

    def path(self, key) -> str:
        return self._files[key][0]

    def has(self, key) -> bool:
        return key in self._files

    def drop(self, key) -> None:
        entry = self._files.pop(key, None)
        if entry:
            try:
                os.unlink(entry[0])
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
