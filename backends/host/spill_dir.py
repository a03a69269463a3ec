"""The host backend's spill directories: where they may live and what may be removed.

* :func:`check_spill_parent` refuses a spill directory another user could swap (it, or an
  ancestor, writable by someone else without the sticky bit, or another user's link on the way);
  :func:`open_spill_parent` opens it, making what is missing one name at a time at its parent's
  descriptor (``O_NOFOLLOW``), never through another user's link;
* each spill directory carries unisleep's marker of its owner (an ``.owner`` file: pid, boot
  id, and an ``flock`` held while the process lives); :func:`clean_orphans` removes only
  directories whose marker names a dead owner — never a live one's, never one being created,
  never anything unmarked;
* :func:`filesystem_type` tells a RAM file system (where a backup frees nothing) from a disk.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import signal
import stat as _stat
import tempfile
import threading
from typing import Optional

from unisleep.errors import SpillDirError
from unisleep.trusted_dirs import UnsafeDir, open_trusted_dir

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
#: a file of the flat layout (``SpillStore(layout="flat")``): ``unisleep-backup-<pid>-<boot>-…bin``
FLAT_PREFIX = "unisleep-backup-"
#: a dead owner's directory renamed here while it is removed (no start-up ever sees it again)
REAP_PREFIX = ".unisleep-reap-"
#: the ``kind`` of unisleep's owner marker: only directories carrying it are ever removed
MARKER_KIND = "unisleep-spill-dir"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def clean_orphans(parent: str, remove: bool = True) -> list[str]:
    """Remove the spill directories under ``parent`` whose owner is gone.  A directory is
    removed only when it carries unisleep's marker (a private ``.owner`` file of this user,
    written by :class:`SpillStore` after taking its lock) and that marker's lock is free, or it
    was made before the last boot; a flat-layout spill file (``unisleep-backup-<pid>-…bin``, see
    :class:`SpillStore`) only when it is this user's mode-0600 file, its lock is free and the
    process its name carries is not alive on this boot.  Nothing else is touched: no directory without a valid
    marker (e.g. the private run directory ``unisleep-<uid>`` holding transfer-group secrets),
    no other user's, no live or half-created one.  A directory being removed is first renamed
    (under its owner's lock) so no other process sees it.  Returns the paths removed (with
    ``remove=False``: the paths that would be)."""
    removed: list[str] = []
    try:
        pfd = os.open(parent, DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError:
        return removed
    try:
        names = os.listdir(pfd)
        boot = boot_id()
        for name in names:
            if name.startswith(FLAT_PREFIX) and name.endswith(".bin"):
                if _reap_flat(pfd, name, boot, remove):
                    removed.append(os.path.join(parent, name))
                continue
            if not (name.startswith(DIR_PREFIX) or name.startswith(REAP_PREFIX)):
                continue
            if _reap(pfd, parent, name, boot, remove):
                removed.append(os.path.join(parent, name))
    finally:
        os.close(pfd)
    return removed


def _reap(pfd: int, parent: str, name: str, boot: str, remove: bool) -> bool:
    """Remove ``parent/name`` if it is a spill directory of this user whose marked owner is
    dead (``remove=False``: only say so).  True when it was (or would be) removed."""
    me = os.geteuid()
    try:
        dfd = os.open(name, DIR_FLAGS, dir_fd=pfd)
    except OSError:  # gone, not a directory, a link, or not ours to read
        return False
    ofd = -1
    try:
        st = os.fstat(dfd)
        if st.st_uid != me:
            return False
        try:
            ofd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:  # no marker (or not a plain file): not ours to judge
            return False
        info = _read_marker(ofd, me)
        if info is None:  # not unisleep's marker, or still being written by a starting owner
            return False
        if info["boot_id"] == boot:
            try:  # the marker is written only after its owner took this lock
                fcntl.flock(ofd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its owner lives
        # else: made before the last boot, its process is gone
        if not remove:
            return True
        shown = os.path.join(parent, name)
        if name.startswith(DIR_PREFIX):
            reap = f"{REAP_PREFIX}{secrets.token_hex(6)}"
            try:
                os.rename(name, reap, src_dir_fd=pfd, dst_dir_fd=pfd)
            except OSError:  # removed meanwhile (its owner closed, another cleaner took it)
                return False
            name = reap
        empty_dir(dfd)
        unlink_at(OWNER_FILE, dfd)  # the marker goes last: an interrupted removal is retried
        try:
            os.rmdir(name, dir_fd=pfd)
        except OSError as e:
            log.warning("could not remove the spill directory %s left by a process that is gone (now %s): %s",
                        shown, os.path.join(parent, name), e.strerror)
            return False
        # routine housekeeping (a killed run leaves one behind): not for the user's console;
        # ``unisleep doctor --clean`` prints what it removes
        log.debug("removed the spill directory %s left by a process that is gone", shown)
        return True
    finally:
        if ofd >= 0:
            os.close(ofd)
        os.close(dfd)


def _reap_flat(pfd: int, name: str, boot: str, remove: bool) -> bool:
    """Remove the flat-layout spill file ``name`` if it is this user's (a regular mode-0600 file)
    and its owner is gone: no process holds its lock, and the process its name carries is not
    alive on this boot (a store locks its file right after creating it; the name check covers
    that instant).  True when it was (or would be) removed."""
    parts = name[len(FLAT_PREFIX):].split("-")
    if len(parts) < 3 or not parts[0].isdigit():
        return False
    pid, file_boot = int(parts[0]), parts[1]
    if file_boot == boot[:8] and _alive(pid):
        return False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=pfd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner lives
        if not remove:
            return True
        try:
            os.unlink(name, dir_fd=pfd)
        except OSError:
            return False
        log.warning("removed the spill file %s left by a process that is gone", name)
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_marker(fd: int, uid: int) -> Optional[dict]:
    """The owner marker in ``fd`` when it is unisleep's: a regular file of ``uid``, not readable
    by others, holding ``{"kind": MARKER_KIND, "pid": int, "boot_id": str, ...}``."""
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077 or st.st_size > 4096:
            return None
        info = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    if (not isinstance(info, dict) or info.get("kind") != MARKER_KIND or not isinstance(info.get("pid"), int)
            or not isinstance(info.get("boot_id"), str)):
        return None
    return info


def empty_dir(dfd: int) -> None:
    """Remove everything in the directory ``dfd`` except its owner marker (without following
    links; best effort)."""
    try:
        names = os.listdir(dfd)
    except OSError:
        return
    for n in names:
        if n == OWNER_FILE:
            continue
        try:
            os.unlink(n, dir_fd=dfd)
        except IsADirectoryError:
            _remove_tree_at(n, dfd)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.EPERM):
                _remove_tree_at(n, dfd)


def _remove_tree_at(name: str, pfd: int) -> None:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=pfd)
    except OSError:
        return
    try:
        for n in os.listdir(fd):
            try:
                os.unlink(n, dir_fd=fd)
            except OSError:
                _remove_tree_at(n, fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=pfd)
    except OSError:
        pass


def unlink_at(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def _not_safe(e: UnsafeDir, shown: str) -> SpillDirError:
    me = os.geteuid()
    dn = e.dir if e.dir.rstrip("/") == shown.rstrip("/") else f"{e.dir} (on the way to it)"
    why = e.why.replace(e.dir, dn, 1)
    use = ("a directory that only this user (uid {me}) or root can change — e.g. mkdir -m 700 "
           "/var/tmp/unisleep-spill — and pass it as spill_dir= (or UNISLEEP_SPILL_DIR; TMS_DISK_BACKUP_DIR for "
           "the torch_memory_saver facade)").format(me=me)
    if e.is_link:
        return SpillDirError(
            f"spill_dir {shown!r} is not safe: {why} — this user's spill files would go wherever that user points "
            f"it: into a directory of their choosing, or onto a RAM file system where a level-1 sleep frees "
            f"nothing. Remove the link (as root: {e.fix}), or use {use}. Nothing was written there."
        )
    return SpillDirError(
        f"spill_dir {shown!r} is not safe: {why} — e.g. swap in links or files of theirs and get the weights "
        f"written where they can read them. Use {use}, or fix it: {e.fix}. Nothing was written there."
    )


def check_spill_parent(path: str, shown: Optional[str] = None) -> None:
    """Raise :class:`~unisleep.errors.SpillDirError` unless no other user can swap ``path`` or
    anything on the way to it (:func:`~unisleep.trusted_dirs.open_trusted_dir`): every directory
    from ``/`` to it, links followed, must belong to root or to this user and must not be writable
    by group or others unless it is sticky (like ``/tmp``, where others cannot rename what is
    ours), and every link on the way must be root's or this user's (another user's link is
    refused, never followed).  ``shown``: the spill directory asked for, when ``path`` is the part
    of it that exists."""
    shown = shown or path
    try:
        fd, _ = open_trusted_dir(os.path.abspath(path))
    except UnsafeDir as e:
        raise _not_safe(e, shown) from None
    except OSError as e:
        raise SpillDirError(f"cannot check the spill directory {path!r}: {e.filename}: {e.strerror}") from e
    os.close(fd)


def open_spill_parent(parent: str) -> tuple[int, list]:
    """Open the spill directory ``parent``, making what is missing of it (mode 0700) one name at a
    time at its parent's descriptor, never through another user's link
    (:func:`~unisleep.trusted_dirs.open_trusted_dir`).  Returns its descriptor and the directories
    made (outermost first; :func:`~unisleep.trusted_dirs.remove_made` removes them if still
    empty).  Raises :class:`~unisleep.errors.SpillDirError` naming the fix, with nothing made."""
    try:
        return open_trusted_dir(parent, create=True)
    except UnsafeDir as e:
        raise _not_safe(e, parent) from None
    except NotADirectoryError:
        raise SpillDirError(
            f"spill_dir {parent!r} exists and is not a directory. Pass spill_dir= (or set "
            "UNISLEEP_SPILL_DIR) to a directory on a disk with room for the weights."
        ) from None
    except OSError as e:
        raise SpillDirError(
            f"cannot create spill_dir {parent!r}: {e.filename}: {e.strerror}. Pass spill_dir= (or set "
            "UNISLEEP_SPILL_DIR) to a writable directory on a disk with room for the weights."
        ) from e


def tree_bytes(path: str) -> int:
    """Bytes allocated on disk under ``path`` (a spill directory), or by ``path`` itself when it is
    a file (a flat-layout spill file); links are not followed."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if _stat.S_ISREG(st.st_mode):
        return st.st_blocks * 512
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


_signals_installed = False


def exit_cleanly_on_sigterm() -> None:
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
