"""Level-1 backups of host memory: spill files that really leave the process's RAM.

Trust rules:

* the whole file is allocated (``posix_fallocate``) before any memory is released, so a disk
  that fills up fails the sleep *before* anything changes;
* every piece is written with its XXH3-64 checksum (``xxhash``) and checked when read back: a
  corrupted, truncated or deleted file raises :class:`~unisleep.errors.BackupCorruptError`;
* each spill directory carries its owner (pid, boot id, an ``flock`` held while the process
  lives), so a later lifecycle or ``unisleep doctor --clean`` removes the directories of dead
  processes — never a live one's.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import stat as _stat
import tempfile
import threading
import time
import warnings
from typing import Optional

from unisleep.driver import BackupStore
from unisleep.errors import BackupCorruptError, BackupError, HostBudgetError, SpillDirError
from unisleep.units import human_bytes

from .collective import boot_id

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


OWNER_FILE = ".owner"
DIR_PREFIX = "unisleep-"


def clean_orphans(parent: str, remove: bool = True) -> list[str]:
    """Remove the spill directories under ``parent`` whose owner is gone (its ``flock`` is free,
    or it was made before the last boot, or — for directories from before owner files — its pid
    no longer runs).  Only directories of this user are touched; a live owner's never.  Returns
    the paths removed (with ``remove=False``: the paths that would be)."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    me, boot = os.geteuid(), boot_id()
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not _stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            continue
        if _owner_alive(path, boot):
            continue
        if not remove:
            removed.append(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            log.warning("removed the spill directory %s left by a process that is gone", path)
    return removed


def tree_bytes(path: str) -> int:
    """Bytes allocated on disk under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _owner_alive(path: str, boot: str) -> bool:
    owner = os.path.join(path, OWNER_FILE)
    try:
        fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        # no owner file: made by an older unisleep (unisleep-<pid>-...), or being created now
        parts = os.path.basename(path).split("-")
        try:
            pid = int(parts[1])
        except (IndexError, ValueError):
            return True
        try:
            if time.time() - os.stat(path).st_mtime < 60:
                return True  # a directory this young may be mid-creation
        except OSError:
            return True
        return os.path.exists(f"/proc/{pid}")
    except OSError:
        return True
    try:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            info = {}
        if info.get("boot_id") not in (None, boot):
            return False  # made before the last boot: its process is gone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # the owner holds its lock (or it cannot be tested): treat as alive
            return True
        return False  # we got the lock: nobody holds it
    finally:
        os.close(fd)


_signals_installed = False


def _exit_cleanly_on_sigterm() -> None:
    """A SIGTERM with the default action kills the process without running exit handlers, so
    the spill files would stay: turn it into a normal exit (status 143) once per process, when
    nobody else installed a handler and we are on the main thread.  (SIGINT already raises
    KeyboardInterrupt, which unwinds and exits normally.)"""
    global _signals_installed
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    _signals_installed = True
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        pass


def _on_sigterm(signum, frame):  # pragma: no cover - exercised in a child process
    raise SystemExit(128 + signum)


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
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if n else memoryview(b"")


def _hasher():
    import xxhash

    return xxhash.xxh3_64()


#: bytes read or written between checksum updates: small enough to still be in cache
_STEP = 4 << 20


#: verification piece of a backup written in one go
PIECE = 256 << 20


class SpillStore(BackupStore):
    """One file per backed-up range under a private directory (mode 0700) in ``spill_dir``.

    Writing is ``pwrite`` from the resident pages into a file allocated to its full size first;
    reading is ``preadv`` straight into the freshly mapped memory, then each piece's XXH3-64
    is checked.  Dropping a backup unlinks its file, so disk is returned at once.
    """

    def __init__(self, budget_bytes: Optional[int], spill_dir: Optional[str]):
        parent = os.path.abspath(os.path.expanduser(spill_dir or default_spill_parent()))
        self._made_parent = None
        if os.path.lexists(parent) and not os.path.isdir(parent):
            raise SpillDirError(
                f"spill_dir {parent!r} exists and is not a directory. Pass spill_dir= (or set "
                "UNISLEEP_SPILL_DIR) to a directory on a disk with room for the weights."
            )
        if not os.path.exists(parent):
            try:
                os.makedirs(parent, mode=0o700)
            except FileExistsError:  # another process starting at the same time made it first
                if not os.path.isdir(parent):
                    raise SpillDirError(
                        f"spill_dir {parent!r} exists and is not a directory. Pass spill_dir= (or set "
                        "UNISLEEP_SPILL_DIR) to a directory on a disk with room for the weights."
                    ) from None
            except OSError as e:
                raise SpillDirError(
                    f"cannot create spill_dir {parent!r}: {e.strerror}. Pass spill_dir= (or set "
                    "UNISLEEP_SPILL_DIR) to a writable directory on a disk with room for the weights."
                ) from e
            else:
                self._made_parent = parent
                log.warning("created the spill directory %s (removed again at close if still empty)", parent)
        self.fstype = filesystem_type(parent)
        if self.fstype in RAM_FILESYSTEMS:
            warnings.warn(
                f"spill_dir {parent!r} is on {self.fstype}, which lives in RAM: level-1 backups written "
                "there free no memory. Pass spill_dir= (or set UNISLEEP_SPILL_DIR) to a disk-backed directory.",
                RuntimeWarning,
                stacklevel=4,
            )
        clean_orphans(parent)
        try:
            self.dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-{boot_id()[:8]}-", dir=parent)
        except OSError as e:
            self._remove_made_parent()
            raise SpillDirError(
                f"cannot write in spill_dir {parent!r}: {e.strerror}. Pass spill_dir= (or set "
                "UNISLEEP_SPILL_DIR) to a writable directory on a disk with room for the weights."
            ) from e
        self.parent = parent
        self._lock_fd = self._claim(self.dir)
        _exit_cleanly_on_sigterm()
        self.where = f"spill files in {self.dir} ({self.fstype})"
        self.budget = budget_bytes
        self._reserved: dict[tuple[int, int], tuple[str, int]] = {}
        # key -> (path, nbytes, [(offset, length, xxh3)])
        self._files: dict[tuple[int, int], tuple[str, int, list[tuple[int, int, int]]]] = {}

    @staticmethod
    def _claim(path: str) -> int:
        owner = os.path.join(path, OWNER_FILE)
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps({"pid": os.getpid(), "boot_id": boot_id(), "created": time.time()}).encode())
        finally:
            os.close(fd)
        # held read-only (a file open for writing would keep the filesystem from being remounted)
        fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    # -- accounting
    @property
    def held_bytes(self) -> int:
        return sum(e[1] for e in self._files.values()) + sum(n for _, n in self._reserved.values())

    def free_space(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def ensure_fits(self, nbytes: int) -> None:
        if self.budget is not None and self.held_bytes + nbytes > self.budget:
            raise HostBudgetError(
                f"a level-1 backup of {human_bytes(nbytes)} would exceed host_budget_bytes="
                f"{human_bytes(self.budget)} ({human_bytes(self.held_bytes)} already held). "
                "Raise host_budget_bytes, or sleep at level 2 (no backup). Nothing was released."
            )
        free = self.free_space()
        if nbytes + (64 << 20) > free:
            raise HostBudgetError(
                f"a level-1 backup of {human_bytes(nbytes)} does not fit in {self.dir} "
                f"({human_bytes(free)} free). Point spill_dir= at a larger disk, or sleep at level 2. "
                "Nothing was released."
            )

    # -- data
    def _path(self, key):
        return os.path.join(self.dir, f"{key[0]}-{key[1]}.bin")

    def reserve(self, key, nbytes: int) -> None:
        """Allocate the whole file for backup ``key`` now, so a full disk fails here, before
        any memory is released."""
        self.drop(key)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise BackupError(
                f"cannot create the backup file {path}: {e.strerror} (point spill_dir= at a writable disk "
                "with room, or sleep at level 2)",
                nbytes=nbytes, path=path, cause=e,
            ) from e
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            _unlink(path)
            raise BackupError(
                f"cannot reserve {human_bytes(nbytes)} for the backup file {path}: {e.strerror} "
                f"({human_bytes(self.free_space())} free now; free disk space, point spill_dir= at a "
                "larger disk, or sleep at level 2)",
                nbytes=nbytes, path=path, cause=e,
            ) from e
        os.close(fd)
        self._reserved[key] = (path, nbytes)

    def save(self, key, src) -> None:
        self.save_progressively(key, src, PIECE, lambda end: None)

    def save_progressively(self, key, src, piece: int, on_written) -> None:
        """Write ``src`` into backup ``key`` in ``piece``-byte writes, each with its checksum;
        ``on_written(end)`` is called after each one so the caller can release memory that is
        already safe on disk."""
        n = src.numel()
        if key not in self._reserved or self._reserved[key][1] != n:
            self.reserve(key, n)
        path = self._reserved[key][0]
        pieces: list[tuple[int, int, int]] = []
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                mv, done = _buffer(src.data_ptr(), n), 0
                while done < n:
                    end = min(n, done + max(1, piece))
                    h, start = _hasher(), done
                    while done < end:  # hash each step just before writing it (still in cache)
                        step_end = min(end, done + _STEP)
                        h.update(mv[done:step_end])
                        while done < step_end:
                            done += os.pwrite(fd, mv[done:step_end], done)
                    pieces.append((start, end - start, h.intdigest()))
                    on_written(done)
            finally:
                os.close(fd)
        except OSError as e:
            raise BackupError(
                f"writing the backup file {path} failed after {human_bytes(sum(p[1] for p in pieces[:-1]))} of "
                f"{human_bytes(n)}: {e.strerror}",
                nbytes=n, path=path, cause=e,
            ) from e
        del self._reserved[key]
        self._files[key] = (path, n, pieces)

    def load(self, key, dst) -> None:
        n = self._entry(key)[1]
        if dst.numel() != n:
            raise ValueError(f"backup {key} holds {n} bytes, destination has {dst.numel()}")
        self.load_range(key, 0, dst)

    def _entry(self, key):
        try:
            return self._files[key]
        except KeyError:
            raise BackupCorruptError(f"no backup is recorded under {key}", path=None) from None

    def load_range(self, key, offset: int, dst) -> None:
        """Read ``dst.numel()`` bytes of backup ``key`` starting at ``offset`` into ``dst`` and
        check every piece they cover against its checksum (a piece only partly covered is read
        whole into a scratch buffer to be checked)."""
        path, total, pieces = self._entry(key)
        n = dst.numel()
        if offset + n > total:
            raise ValueError(f"backup {key} holds {total} bytes; cannot read {n} at {offset}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise BackupCorruptError(
                f"the backup file {path} cannot be opened ({e.strerror}): it was removed or made unreadable "
                "while asleep", path=path, nbytes=total, cause=e,
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < total:
                raise BackupCorruptError(
                    f"the backup file {path} holds {human_bytes(size)} of {human_bytes(total)}: it was truncated "
                    "while asleep", path=path, nbytes=total,
                )
            dmv = _buffer(dst.data_ptr(), n)
            for i, (p_off, p_len, p_sum) in enumerate(pieces):
                lo, hi = max(offset, p_off), min(offset + n, p_off + p_len)
                if lo >= hi:
                    continue
                if lo == p_off and hi == p_off + p_len:
                    got = _read_hashed(fd, dmv[lo - offset : hi - offset], p_off, path, total)
                else:
                    scratch = bytearray(p_len)
                    got = _read_hashed(fd, memoryview(scratch), p_off, path, total)
                    dmv[lo - offset : hi - offset] = scratch[lo - p_off : hi - p_off]
                if got != p_sum:
                    raise BackupCorruptError(
                        f"the backup file {path} is corrupt: piece {i} (bytes {p_off}..{p_off + p_len}) fails its "
                        "XXH3 checksum; the bytes were not exposed", path=path, nbytes=total,
                    )
        finally:
            os.close(fd)

    def path(self, key) -> str:
        return self._entry(key)[0]

    def has(self, key) -> bool:
        return key in self._files

    def drop(self, key) -> None:
        for table in (self._files, self._reserved):
            entry = table.pop(key, None)
            if entry:
                _unlink(entry[0])

    def close(self) -> None:
        self._files.clear()
        self._reserved.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._remove_made_parent()

    def _remove_made_parent(self) -> None:
        if self._made_parent:
            try:
                os.rmdir(self._made_parent)  # only if still empty
            except OSError:
                pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_hashed(fd: int, target, offset: int, path: str, total: int) -> int:
    """Read ``target`` from ``offset``, hashing each step right after it lands; the XXH3-64."""
    h, done, n = _hasher(), 0, len(target)
    while done < n:
        end = min(n, done + _STEP)
        _read_exact(fd, target[done:end], offset + done, path, total)
        h.update(target[done:end])
        done = end
    return h.intdigest()


def _read_exact(fd: int, target, offset: int, path: str, total: int) -> None:
    done, n = 0, len(target)
    while done < n:
        try:
            got = os.preadv(fd, [target[done:]], offset + done)
        except OSError as e:
            raise BackupCorruptError(
                f"reading the backup file {path} failed at byte {offset + done}: {e.strerror}",
                path=path, nbytes=total, cause=e,
            ) from e
        if got <= 0:
            raise BackupCorruptError(
                f"the backup file {path} ended after {offset + done} of {total} bytes: it was truncated while asleep",
                path=path, nbytes=total,
            )
        done += got
