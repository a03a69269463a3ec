"""Level-1 backups of host memory (:class:`SpillStore`): spill files that really leave the process's RAM,
one file per backed-up range: the store, its checksummed reads and how it makes and opens its
directory.  Device memory spills through :class:`~.staged_spill.StagedSpillStore`; where spill
directories may live and which may be removed is :mod:`.spill_dir`.

Trust rules:

* the whole file is allocated (``posix_fallocate``) before any memory is released, so a disk
  that fills up fails the sleep *before* anything changes;
* every piece is written with its XXH3-64 checksum (``xxhash``) and checked when read back: a
  corrupted, truncated or deleted file raises :class:`~unisleep.errors.BackupCorruptError`;
* each spill directory carries unisleep's marker of its owner (an ``.owner`` file: pid, boot
  id, and an ``flock`` taken *before* the marker is written and held while the process lives),
  so a later lifecycle or ``unisleep doctor --clean`` removes only directories whose marker
  names a dead owner — never a live one's, never one being created, never anything unmarked;
* a spill directory another user could swap is refused (:func:`check_spill_parent`), and every
  spill file is opened relative to the private directory's descriptor (``O_NOFOLLOW``, created
  ``O_EXCL``), so no renamed directory or planted link redirects the weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import json
import logging
import os
import secrets
import stat as _stat
import time
import warnings
from typing import Optional

from unisleep import backup_encoding
from unisleep.backup import BackupStore
from unisleep.errors import BackupCorruptError, BackupError, HostBudgetError, SpillDirError, UnisleepError
from unisleep.hostmem import check_host_room
from unisleep.private_dir import private_dir
from unisleep.trusted_dirs import remove_made
from unisleep.units import human_bytes

from .collective import boot_id
from .spill_dir import (
    DIR_FLAGS,
    DIR_PREFIX,
    FLAT_PREFIX,
    MARKER_KIND,
    OWNER_FILE,
    RAM_FILESYSTEMS,
    clean_orphans,
    default_spill_parent,
    empty_dir,
    exit_cleanly_on_sigterm,
    filesystem_type,
    open_spill_parent,
    unlink_at,
)

log = logging.getLogger("unisleep.host")

#: how long a sleep waits for another process's turn at the spill disk (a turn is a free-space
#: check and the backup files' allocation: milliseconds) before it goes on without
ROOM_LOCK_WAIT_S = 30.0


# ---- checksummed reads of spill files: raw memory as a buffer, the XXH3-64 hasher, reads that
# hash each step right after it lands and name a truncated or unreadable file
def _buffer(ptr: int, n: int):
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if n else memoryview(b"")


def _hasher():
    import xxhash

    return xxhash.xxh3_64()


#: bytes read or written between checksum updates: small enough to still be in cache
_STEP = 4 << 20


#: verification piece of a backup written in one go
PIECE = 256 << 20

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


class SpillStore(BackupStore):
    """One file per backed-up range under a private directory (mode 0700) in ``spill_dir``
    (``layout="private"``), or directly in ``spill_dir`` (``layout="flat"``, torch_memory_saver's
    layout: files named ``unisleep-backup-<pid>-…``, created ``O_EXCL`` mode 0600 at the
    directory's descriptor, kept open — and ``flock``-ed, so an orphan cleaner can tell a live
    owner's — for as long as the backup lives: every read and write goes through that descriptor,
    never through the name again; removed when the backup is dropped, at the wake or at close).

    Writing is ``pwrite`` from the resident pages into a file allocated to its full size first;
    reading is ``preadv`` straight into the freshly mapped memory, then each piece's XXH3-64
    is checked.  Dropping a backup unlinks its file, so disk is returned at once; a file that
    cannot be unlinked (a file system gone read-only) stays counted in :attr:`held_bytes`,
    is named in a warning and is removed at the next level-1 sleep or at :meth:`close`.

    ``spill_dir`` and every directory on the way to it must be safe from other users
    (:func:`~.spill_dir.check_spill_parent`), and no link of another user may lie on the way to
    it: it is opened, and what is missing of it made, one name at a time at its parent's descriptor
    (:func:`~.spill_dir.open_spill_parent`); the private directory is created and then only used through
    its descriptor, its files opened with ``O_NOFOLLOW`` (and created ``O_EXCL``).
    """

    def __init__(self, budget_bytes: Optional[int], spill_dir: Optional[str], layout: str = "private"):
        if layout not in ("private", "flat"):
            raise ValueError(f"layout must be 'private' or 'flat', got {layout!r}")
        self.layout = layout
        self._fds: dict[str, int] = {}  # flat layout: file name -> its descriptor, kept open (and locked)
        self._room_lock_path: Optional[str] = None  # room_lock()'s file
        parent = os.path.abspath(os.path.expanduser(spill_dir or default_spill_parent()))
        self._made_dirs: list = []
        self._parent_fd = self._dir_fd = self._lock_fd = -1
        # checked and made one name at a time at its parent's descriptor, never through another
        # user's link; nothing is made under a directory others can swap
        pfd, self._made_dirs = open_spill_parent(parent)
        if self._made_dirs:
            log.warning("created the spill directory %s (removed again at close if still empty)", parent)
        try:
            try:
                real = os.readlink(f"/proc/self/fd/{pfd}")
            except OSError:  # pragma: no cover - no /proc
                real = os.path.realpath(parent)
            self.fstype = filesystem_type(real)
            if self.fstype in RAM_FILESYSTEMS:
                shown = parent if real == parent else f"{parent} (which is {real})"
                warnings.warn(
                    f"spill_dir {shown!r} is on {self.fstype}, which lives in RAM: level-1 backups written "
                    "there free no memory. Pass spill_dir= (or set UNISLEEP_SPILL_DIR) to a disk-backed directory.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            clean_orphans(parent)
            if layout == "flat":
                self._open_flat_dir(parent, pfd)
            else:
                self._make_private_dir(parent, pfd)
        except BaseException:
            if pfd not in (self._parent_fd, self._dir_fd):
                os.close(pfd)
            self._close_fds()
            self._remove_made_parent()
            raise
        self.parent = parent
        exit_cleanly_on_sigterm()
        self.where = f"spill files in {self.dir} ({self.fstype})"
        self.budget = budget_bytes
        self._names = itertools.count()
        self._reserved: dict[tuple[int, int], tuple[str, int]] = {}
        # key -> (file name, nbytes, [(offset, length, xxh3)])
        self._files: dict[tuple[int, int], tuple[str, int, list[tuple[int, int, int]]]] = {}
        # key -> [(offset, length, xxh3)]: the pieces already on disk of a write that failed, so a
        # failed sleep's undo reads back the chunks released behind them (still reserved)
        self._written: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        # key -> the frames of a backup written with an encoding (its file holds them back to back),
        # and the bytes its file keeps once written (the room beyond is given back)
        self._frames: dict[tuple[int, int], list[backup_encoding.Frame]] = {}
        self._stored: dict[tuple[int, int], int] = {}
        # file name -> nbytes: backups no longer needed whose file could not be unlinked yet
        self._leftover: dict[str, int] = {}

    #: the backup encodings this store writes (``MemoryLifecycle(backup_encoding=)``)
    encodings = backup_encoding.ENCODINGS

    # -- accounting
    @property
    def held_bytes(self) -> int:
        """Bytes the backups take in their files: an encoded backup counts what its file keeps,
        a reservation its whole raw size (the room taken before anything is released)."""
        return (sum(self._stored.get(k, e[1]) for k, e in self._files.items())
                + sum(n for _, n in self._reserved.values()) + sum(self._leftover.values()))

    def _names_held(self) -> list[str]:
        return [e[0] for e in self._files.values()] + [e[0] for e in self._reserved.values()] + list(self._leftover)

    def residency(self) -> dict[str, int]:
        """The blocks the store's files take now (``st_blocks``), on disk — or in host memory
        ("pageable") when the spill directory is a RAM file system."""
        total = 0
        for name in self._names_held():
            try:
                fd = self._fds.get(name)
                st = os.fstat(fd) if fd is not None else os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                total += st.st_blocks * 512
            except OSError:
                continue
        in_ram = self.fstype in RAM_FILESYSTEMS
        return {"pinned": 0, "pageable": total if in_ram else 0, "disk": 0 if in_ram else total}

    def free_space(self) -> int:
        st = os.fstatvfs(self._dir_fd)
        return st.f_bavail * st.f_frsize

    @contextlib.contextmanager
    def room_lock(self):
        """Take turns at the disk with this user's other stores on the same file system (other
        processes too): an exclusive ``flock`` on a lock file of that file system in this user's
        private run directory (:func:`unisleep.private_dir.private_dir`, mode 0700: no other
        user can hold it), held from the free-space check to the last file's allocation.  Two
        sleeps at once onto a nearly full disk: one reserves, the other's check then sees the
        room taken and refuses cleanly — without turns both could pass the check and both fail
        to allocate (each allocation taking part of the room).  Held for more than
        :data:`ROOM_LOCK_WAIT_S` (a stuck process), or no private directory: the sleep goes on
        without it, said in a warning."""
        fd = -1
        try:
            if self._room_lock_path is None:  # found once: the directory and its file system stay
                dev = os.fstat(self._dir_fd).st_dev
                self._room_lock_path = os.path.join(private_dir(), f"spill-room-{dev:x}.lock")
            fd = os.open(self._room_lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except (OSError, UnisleepError) as e:
            log.warning("the spill disk's turn lock cannot be opened (%s): this sleep checks and reserves its room "
                        "alone", e)
        t0, delay = time.monotonic(), 0.002
        while fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > ROOM_LOCK_WAIT_S:
                    log.warning("another process of this user has held the turn at spill_dir %s's disk for %.0f s: "
                                "this sleep checks and reserves its room without waiting longer", self.parent,
                                time.monotonic() - t0)
                    os.close(fd)
                    fd = -1
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            if fd >= 0:
                os.close(fd)  # the lock goes with the descriptor

    def ensure_fits(self, nbytes: int) -> None:
        self._retry_leftovers()
        if self.budget is not None and self.held_bytes + nbytes > self.budget:
            raise HostBudgetError(
                f"a level-1 backup of {human_bytes(nbytes)} would exceed host_budget_bytes="
                f"{human_bytes(self.budget)} ({human_bytes(self.held_bytes)} already held). "
                "Raise host_budget_bytes, or sleep at level 2 (no backup). Nothing was released."
            )
        if self.fstype in RAM_FILESYSTEMS:  # files there are host memory: its limits apply too
            check_host_room(nbytes, what=f"a level-1 backup of {human_bytes(nbytes)} to {self.dir} ({self.fstype}, in "
                                         "RAM)", headroom=64 << 20, mapped=False)
        free = self.free_space()
        if nbytes + (64 << 20) > free:
            raise HostBudgetError(
                f"a level-1 backup of {human_bytes(nbytes)} does not fit in {self.dir} "
                f"({human_bytes(free)} free). Point spill_dir= at a larger disk, or sleep at level 2. "
                "Nothing was released."
            )

    # -- data
    def _new_name(self, key) -> str:
        if self.layout == "flat":
            return f"{self._flat_tag}-{key[0]}-{key[1]}-{next(self._names)}.bin"
        return f"{key[0]}-{key[1]}-{next(self._names)}.bin"

    def _full(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _open(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self._dir_fd)

    def _open_to_read(self, name: str, path: str, total: int) -> tuple[int, bool]:
        """:meth:`_use` for reading a backup back; a file that is gone or unreadable is the
        named :class:`BackupCorruptError` (removed or made unreadable while asleep)."""
        try:
            return self._use(name, os.O_RDONLY)
        except OSError as e:
            raise BackupCorruptError(
                f"the backup file {path} cannot be opened ({e.strerror}): it was removed or made unreadable "
                "while asleep", path=path, nbytes=total, cause=e,
            ) from e

    def _use(self, name: str, flags: int) -> tuple[int, bool]:
        """(a descriptor of file ``name``, whether the caller closes it): the flat layout's kept
        descriptor, or the file opened again at the private directory's descriptor."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd, False
        if self.layout == "flat":  # every flat file is kept open from its creation on
            raise FileNotFoundError(errno.ENOENT, "no open descriptor", self._full(name))
        return self._open(name, flags), True

    def reserve(self, key, nbytes: int) -> None:
        """Allocate the whole file for backup ``key`` now, so a full disk fails here, before
        any memory is released."""
        self.drop(key)
        name = self._new_name(key)
        path = self._full(name)
        try:
            if self.layout == "flat":  # kept open and locked from here on
                fd = self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fds[name] = fd
            else:
                fd = self._open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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
            if name not in self._fds:
                os.close(fd)
            self._unlink(name)
            raise BackupError(
                f"cannot reserve {human_bytes(nbytes)} for the backup file {path}: {e.strerror} "
                f"({human_bytes(self.free_space())} free now; free disk space, point spill_dir= at a "
                "larger disk, or sleep at level 2)",
                nbytes=nbytes, path=path, cause=e,
            ) from e
        if name not in self._fds:
            os.close(fd)
        self._reserved[key] = (name, nbytes)

    def save(self, key, src) -> None:
        self.save_progressively(key, src, PIECE, lambda end: None)

    def save_progressively(self, key, src, piece: int, on_written) -> None:
        """Write ``src`` into backup ``key`` in ``piece``-byte writes, each with its checksum;
        ``on_written(end)`` is called after each one so the caller can release memory that is
        already safe on disk."""
        mv = _buffer(src.data_ptr(), src.numel())
        self._write_pieces(key, src.numel(), piece, lambda lo, hi: mv[lo:hi], on_written)

    def _write_pieces(self, key, n: int, piece: int, fetch, on_written) -> None:
        """Write ``n`` bytes into backup ``key`` in ``piece``-byte pieces, each with its XXH3
        checksum; ``fetch(lo, hi)`` gives the host bytes ``[lo, hi)`` of one piece (a view of
        the source, or of a staging buffer it was copied into), ``on_written(end)`` is called
        after each piece."""
        if key not in self._reserved or self._reserved[key][1] != n:
            self.reserve(key, n)
        if self.encoding is not None:
            return self._write_frames(key, n, piece, fetch, on_written)
        name = self._reserved[key][0]
        path = self._full(name)
        pieces: list[tuple[int, int, int]] = []
        self._written[key] = pieces  # until the write completes: what a failed sleep's undo may read
        try:
            fd, own = self._use(name, os.O_WRONLY)
            try:
                done = 0
                while done < n:
                    end = min(n, done + max(1, piece))
                    mv, base = fetch(done, end), done
                    h, start = _hasher(), done
                    while done < end:  # hash each step just before writing it (still in cache)
                        step_end = min(end, done + _STEP)
                        h.update(mv[done - base:step_end - base])
                        while done < step_end:
                            done += os.pwrite(fd, mv[done - base:step_end - base], done)
                    pieces.append((start, end - start, h.intdigest()))
                    on_written(done)
            finally:
                if own:
                    os.close(fd)
        except OSError as e:
            raise BackupError(
                f"writing the backup file {path} failed after {human_bytes(sum(p[1] for p in pieces[:-1]))} of "
                f"{human_bytes(n)}: {e.strerror}",
                nbytes=n, path=path, cause=e,
            ) from e
        del self._reserved[key]
        self._written.pop(key, None)
        self._files[key] = (name, n, pieces)

    def _write_frames(self, key, n: int, piece: int, fetch, on_written) -> None:
        """:meth:`_write_pieces` with the store's encoding: each piece becomes one frame
        (:mod:`unisleep.backup_encoding`), encoded where that pays and plain otherwise, written
        back to back; once all are written the file is cut to what they take, so the room taken
        whole before the sleep shrinks to the encoded bytes."""
        name = self._reserved[key][0]
        path = self._full(name)
        piece = min(max(1, piece), backup_encoding.MAX_FRAME)  # the scratch of one frame stays bounded
        pieces: list[tuple[int, int, int]] = []
        frames: list[backup_encoding.Frame] = []
        self._written[key] = pieces  # a failed sleep's undo reads the frames already on disk
        self._frames[key] = frames
        cursor = 0
        try:
            fd, own = self._use(name, os.O_WRONLY)
            try:
                done = 0
                while done < n:
                    end = min(n, done + max(1, piece))
                    mv = fetch(done, end)
                    t = backup_encoding.choose(mv)
                    coded = backup_encoding.encode(mv, t) if t else None
                    if coded is None:  # plain: hashed and written step by step, as without an encoding
                        h = _hasher()
                        for lo in range(0, len(mv), _STEP):
                            step = mv[lo:lo + _STEP]
                            h.update(step)
                            put = 0
                            while put < len(step):
                                put += os.pwrite(fd, step[put:], cursor + lo + put)
                        raw_sum = stored_sum = h.intdigest()
                        data = mv
                    else:
                        h = _hasher()
                        h.update(mv)
                        raw_sum = h.intdigest()
                        data = memoryview(coded)
                        h = _hasher()
                        h.update(data)
                        stored_sum = h.intdigest()
                        put = 0
                        while put < len(data):
                            put += os.pwrite(fd, data[put:], cursor + put)
                    frames.append(backup_encoding.Frame(done, end - done, cursor, len(data),
                                                        0 if coded is None else coded[4], raw_sum, stored_sum))
                    pieces.append((done, end - done, raw_sum))
                    cursor += len(data)
                    done = end
                    on_written(done)
                os.ftruncate(fd, cursor)  # the room beyond the frames goes back to the disk
            finally:
                if own:
                    os.close(fd)
        except OSError as e:
            raise BackupError(
                f"writing the backup file {path} failed after {human_bytes(sum(p[1] for p in pieces))} of "
                f"{human_bytes(n)}: {e.strerror}",
                nbytes=n, path=path, cause=e,
            ) from e
        del self._reserved[key]
        self._written.pop(key, None)
        self._files[key] = (name, n, pieces)
        self._stored[key] = cursor

    def _load_frames(self, key, offset: int, dst, name: str, total: int, frames) -> None:
        """:meth:`load_range` of an encoded backup: every frame the range covers is read whole,
        its stored bytes checked before anything is decoded, decoded, and its raw bytes checked."""
        path = self._full(name)
        n = dst.numel()
        covered = sum(f.length for f in frames)
        if offset + n > covered:
            raise BackupCorruptError(f"the backup file {path} holds only {human_bytes(covered)} of {human_bytes(total)} "
                                     f"checked bytes; cannot read {human_bytes(n)} at {offset}", path=path, nbytes=total)
        fd, own = self._open_to_read(name, path, total)
        try:
            end = max((f.file_offset + f.stored for f in frames), default=0)
            size = os.fstat(fd).st_size
            if size < end:
                raise BackupCorruptError(
                    f"the backup file {path} holds {human_bytes(size)} of {human_bytes(end)}: it was truncated "
                    "while asleep", path=path, nbytes=total)
            dmv = _buffer(dst.data_ptr(), n)
            for i, f in enumerate(frames):
                lo, hi = max(offset, f.offset), min(offset + n, f.offset + f.length)
                if lo >= hi:
                    continue
                whole = lo == f.offset and hi == f.offset + f.length
                target = dmv[lo - offset:hi - offset] if whole else memoryview(bytearray(f.length))
                if f.transform == 0:
                    got = _read_hashed(fd, target, f.file_offset, path, total)
                    ok = got == f.stored_sum
                else:
                    stored = bytearray(f.stored)
                    ok = _read_hashed(fd, memoryview(stored), f.file_offset, path, total) == f.stored_sum
                    if ok:
                        try:
                            backup_encoding.decode(stored, target)
                        except backup_encoding.FormatError as e:
                            raise BackupCorruptError(f"the backup file {path}: frame {i} does not decode ({e}); the "
                                                     "bytes were not exposed", path=path, nbytes=total) from e
                        h = _hasher()
                        h.update(target)
                        ok = h.intdigest() == f.raw_sum
                if not ok:
                    raise BackupCorruptError(
                        f"the backup file {path} is corrupt: frame {i} (bytes {f.offset}..{f.offset + f.length}, "
                        f"{'encoded' if f.transform else 'plain'}) fails its XXH3 checksum; the bytes were not exposed",
                        path=path, nbytes=total)
                if not whole:
                    dmv[lo - offset:hi - offset] = target[lo - f.offset:hi - f.offset]
        finally:
            if own:
                os.close(fd)

    def encoded_bytes(self) -> dict[str, int]:
        """``{"raw", "stored"}``: the bytes of the complete encoded backups, before and as stored."""
        keys = [k for k in self._stored if k in self._files]
        return {"raw": sum(self._files[k][1] for k in keys), "stored": sum(self._stored[k] for k in keys)}

    def load(self, key, dst) -> None:
        n = self._entry(key)[1]
        if dst.numel() != n:
            raise ValueError(f"backup {key} holds {n} bytes, destination has {dst.numel()}")
        self.load_range(key, 0, dst)

    def _entry(self, key):
        """``(file name, bytes, pieces)`` of backup ``key``; of a write that failed part-way, the
        pieces already on disk (a failed sleep's undo reads back the chunks released behind them:
        :meth:`load_range` refuses bytes beyond them)."""
        try:
            return self._files[key]
        except KeyError:
            pass
        if key in self._written and key in self._reserved:
            name, n = self._reserved[key]
            return name, n, list(self._written[key])
        raise BackupCorruptError(f"no backup is recorded under {key}", path=None)

    def load_range(self, key, offset: int, dst) -> None:
        """Read ``dst.numel()`` bytes of backup ``key`` starting at ``offset`` into ``dst`` and
        check every piece they cover against its checksum (a piece only partly covered is read
        whole into a scratch buffer to be checked)."""
        name, total, pieces = self._entry(key)
        path = self._full(name)
        n = dst.numel()
        if offset + n > total:
            raise ValueError(f"backup {key} holds {total} bytes; cannot read {n} at {offset}")
        if key in self._frames:
            return self._load_frames(key, offset, dst, name, total, self._frames[key])
        written = sum(p[1] for p in pieces)
        if offset + n > written:  # a write that failed part-way: only its pieces on disk are readable
            raise BackupCorruptError(f"the backup file {path} holds only {human_bytes(written)} of {human_bytes(total)} "
                                     f"checked bytes; cannot read {human_bytes(n)} at {offset}", path=path, nbytes=total)
        fd, own = self._open_to_read(name, path, total)
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
            if own:
                os.close(fd)

    def path(self, key) -> str:
        return self._full(self._entry(key)[0])

    def has(self, key) -> bool:
        return key in self._files

    def drop(self, key) -> None:
        """Forget backup ``key`` and unlink its file.  A file that cannot be unlinked (e.g. the
        file system went read-only) is not an error — its bytes are no longer needed — but it
        keeps its room counted and is named in a warning until a later try removes it."""
        self._written.pop(key, None)
        self._frames.pop(key, None)
        self._stored.pop(key, None)
        for table in (self._files, self._reserved):
            entry = table.pop(key, None)
            if entry:
                self._unlink(entry[0], entry[1])

    def _unlink(self, name: str, nbytes: int = 0) -> bool:
        fd = self._fds.get(name)
        if fd is not None and not self._still_ours(name, fd):  # renamed away, something else under the name
            log.warning("the spill file %s is no longer the one unisleep wrote (renamed or replaced): left as it is",
                        self._full(name))
            self._close_kept(name)
            self._leftover.pop(name, None)
            return True
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._close_kept(name)  # its lock goes: a later cleaner may remove it
            first = name not in self._leftover
            self._leftover[name] = nbytes
            if first:
                msg = (f"the spill file {self._full(name)} could not be removed ({e.strerror}); the backup it holds is "
                       f"no longer needed (the memory it backed up is mapped again, or was discarded). Its "
                       f"{human_bytes(nbytes)} stay on disk, counted in backup_bytes(), until it can be removed: "
                       "unisleep tries again at the next level-1 sleep and at close()")
                log.warning("%s", msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return False
        self._close_kept(name)
        self._leftover.pop(name, None)
        return True

    def _still_ours(self, name: str, fd: int) -> bool:
        """The name ``name`` in the directory still refers to the file open as ``fd``."""
        try:
            a, b = os.fstat(fd), os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _close_kept(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _retry_leftovers(self) -> None:
        for name in list(self._leftover):
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self._close_kept(name)
            self._leftover.pop(name, None)
            log.info("removed the leftover spill file %s", self._full(name))

    def close(self) -> None:
        if self.layout == "flat":  # only this store's own files: the directory is the user's
            for name in self._names_held():
                fd = self._fds.get(name)
                if fd is not None and not self._still_ours(name, fd):
                    continue  # renamed away: what now has the name is not ours to remove
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                except OSError:
                    pass
            for name in list(self._fds):
                self._close_kept(name)
            self._files.clear()
            self._reserved.clear()
            self._written.clear()
            self._frames.clear()
            self._stored.clear()
            self._leftover.clear()
            self._close_fds()
            self._remove_made_parent()
            return
        self._files.clear()
        self._reserved.clear()
        self._written.clear()
        self._frames.clear()
        self._stored.clear()
        self._leftover.clear()
        if self._dir_fd >= 0:
            empty_dir(self._dir_fd)
            unlink_at(OWNER_FILE, self._dir_fd)  # the marker last: a failed removal is reaped later
            try:
                os.rmdir(self._name, dir_fd=self._parent_fd)
            except OSError:
                pass
        self._close_fds()
        self._remove_made_parent()

    def _close_fds(self) -> None:
        for attr in ("_lock_fd", "_dir_fd", "_parent_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, -1)

    # ---- the directory: made, claimed, opened (under the trust rules above) ----------------
    def _make_private_dir(self, parent: str, pfd: int) -> None:
        """Create this store's private directory in ``parent`` (open as ``pfd``, which the store
        keeps) and claim it: the owner lock is taken before the marker is written, so no cleaner
        ever takes a starting store's directory for a dead one.  ``parent`` may be removed by
        another store's close while this one starts (it created it and found it empty): it is
        made again then, under the same rules."""
        me = os.geteuid()
        self._parent_fd = pfd
        for attempt in range(20):
            if self._parent_fd < 0:
                self._parent_fd, made = open_spill_parent(parent)
                self._made_dirs += [d for d in made if d not in self._made_dirs]
            name = f"{DIR_PREFIX}{os.getpid()}-{boot_id()[:8]}-{secrets.token_hex(5)}"
            try:
                os.mkdir(name, 0o700, dir_fd=self._parent_fd)
            except FileExistsError:
                continue
            except FileNotFoundError:  # the parent was removed under its descriptor: make it again
                os.close(self._parent_fd)
                self._parent_fd = -1
                continue
            except OSError as e:
                raise SpillDirError(
                    f"cannot write in spill_dir {parent!r}: {e.strerror}. Pass spill_dir= (or set "
                    "UNISLEEP_SPILL_DIR) to a writable directory on a disk with room for the weights."
                ) from e
            break
        else:  # pragma: no cover
            raise SpillDirError(f"cannot create a private directory in spill_dir {parent!r}: 20 attempts failed")
        self.dir, self._name = os.path.join(parent, name), name
        self._dir_fd = os.open(name, DIR_FLAGS, dir_fd=self._parent_fd)
        st = os.fstat(self._dir_fd)
        if st.st_uid != me or _stat.S_IMODE(st.st_mode) & 0o077:  # pragma: no cover - not what mkdir made
            raise SpillDirError(f"the private spill directory {self.dir} is not this user's mode-0700 directory")
        self._lock_fd = self._claim(self._dir_fd)

    def _open_flat_dir(self, parent: str, pfd: int) -> None:
        """The flat layout: ``parent`` itself (open as ``pfd``, which the store keeps) holds the
        files, used only through that descriptor."""
        self._dir_fd = pfd
        if not os.access(f"/proc/self/fd/{pfd}" if os.path.exists("/proc/self/fd") else parent, os.W_OK):
            raise SpillDirError(f"cannot write in spill_dir {parent!r}. Pass spill_dir= (or set UNISLEEP_SPILL_DIR) "
                                "to a writable directory on a disk with room for the weights.")
        self.dir, self._name = parent, None
        self._flat_tag = f"{FLAT_PREFIX}{os.getpid()}-{boot_id()[:8]}-{secrets.token_hex(5)}"

    @staticmethod
    def _claim(dfd: int) -> int:
        """Create the owner marker in the directory ``dfd``: lock first, then write.  Returns
        the descriptor holding the lock (read-only: a file open for writing would keep the
        file system from being remounted)."""
        wfd = os.open(OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=dfd)
        try:
            fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody locks an unwritten marker
            info = {"kind": MARKER_KIND, "pid": os.getpid(), "boot_id": boot_id(), "created": time.time()}
            os.write(wfd, json.dumps(info).encode())
        finally:
            os.close(wfd)
        return fd

    def _remove_made_parent(self) -> None:
        remove_made(self._made_dirs)  # each only if still empty
        self._made_dirs = []
