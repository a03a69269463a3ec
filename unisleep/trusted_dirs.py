"""Directories no other user can steer: a path walked from ``/`` one name at a time, each opened at
the descriptor of the directory before it with ``O_NOFOLLOW`` (``openat`` semantics all the way
down), what is missing made there with ``mkdirat``.

Every directory on the way must belong to root or to this user and must not be writable by group
or others unless sticky (``/tmp``: others may add names there but not rename or replace ours).  A
link on the way is followed only when it belongs to root or to this user: another user's link —
planted at a name that does not exist yet in a sticky directory, to send root's files where that
user chooses — is refused, never followed.  The spill directories of the host backend and the
tiny test models' cache use this; each turns :class:`UnsafeDir` into its own named error."""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: links followed in one walk at most (the kernel's own bound)
MAX_LINKS = 40


def owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


class UnsafeDir(Exception):
    """Why a directory on the way cannot be trusted.  Internal: every caller raises its own named
    error (:class:`~unisleep.errors.SpillDirError`, :class:`~unisleep.errors.ModelDirError`).
    ``dir``: the directory or link at fault; ``why``: what is wrong with it; ``uid``: its owner;
    ``fix``: the command that fixes it; ``is_link``: it is another user's link."""

    def __init__(self, dir: str, why: str, uid: int, fix: str, is_link: bool = False):
        super().__init__(why)
        self.dir, self.why, self.uid, self.fix, self.is_link = dir, why, uid, fix, is_link


def untrusted(st: os.stat_result, shown: str, me: Optional[int] = None) -> Optional[UnsafeDir]:
    """Why the directory ``shown`` (its ``st``) may be changed by another user (None: it may not)."""
    me = os.geteuid() if me is None else me
    if st.st_uid not in (0, me):
        return UnsafeDir(shown, f"{shown} belongs to {owner_name(st.st_uid)}, who can rename or replace what is in "
                                "it", st.st_uid, f"chown {me} {shown}; chmod go-w {shown}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "other users" if st.st_mode & 0o002 else "its group"
        return UnsafeDir(shown, f"{who} can write in {shown}, mode {oct(st.st_mode & 0o7777)} and not sticky, and so "
                                "rename or replace what is in it", st.st_uid,
                         f"chmod go-w {shown} (or chmod +t {shown} to make it sticky like /tmp)")
    return None


def _err(e: OSError, shown: str) -> OSError:
    return type(e)(e.errno, e.strerror, shown)


def open_trusted_dir(path: str, *, create: bool = False, mode: int = 0o700) -> tuple[int, list]:
    """Open the directory ``path`` (absolute) through directories and links no other user can
    change; with ``create``, make the missing directories (``mode``) on the way.  Returns its
    descriptor (``O_RDONLY | O_DIRECTORY``; the caller closes it) and the directories made,
    outermost first.  Raises :class:`UnsafeDir` (nothing was made after the fault), or
    ``OSError`` naming the path walked (``FileNotFoundError`` when something is missing and not
    ``create``, ``NotADirectoryError``, ``PermissionError``, ``ELOOP``)."""
    if not path.startswith("/"):
        raise ValueError(f"open_trusted_dir needs an absolute path, got {path!r}")
    me = os.geteuid()
    todo = [c for c in reversed(path.split("/")) if c]
    fd = os.open("/", DIR_FLAGS)
    cur, links, created = "/", 0, []
    try:
        bad = untrusted(os.fstat(fd), "/", me)
        if bad:
            raise bad
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            shown = os.path.normpath(os.path.join(cur, name))
            if name != "..":
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError as e:
                    if not create:
                        raise _err(e, shown) from None
                    try:
                        os.mkdir(name, mode, dir_fd=fd)
                        created.append(shown)
                    except FileExistsError:  # made meanwhile (by anyone): look at it again
                        pass
                    except OSError as e2:
                        raise _err(e2, shown) from None
                    links += 1  # bounds the retries too
                    if links > MAX_LINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), shown) from None
                    todo.append(name)
                    continue
                if stat.S_ISLNK(st.st_mode):
                    if st.st_uid not in (0, me):
                        raise UnsafeDir(shown, f"{shown} is a link of {owner_name(st.st_uid)} (to "
                                               f"{os.readlink(name, dir_fd=fd)!r}): another user's link on the way is "
                                               "never followed", st.st_uid, f"rm {shown}", is_link=True)
                    links += 1
                    if links > MAX_LINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), shown)
                    target = os.readlink(name, dir_fd=fd)
                    if target.startswith("/"):
                        os.close(fd)
                        fd = -1
                        fd, cur = os.open("/", DIR_FLAGS), "/"
                    todo.extend(c for c in reversed(target.split("/")) if c)
                    continue
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP and name != ".." and links < MAX_LINKS:  # became a link: look again
                    links += 1
                    todo.append(name)
                    continue
                raise _err(e, shown) from None
            bad = untrusted(os.fstat(nfd), shown, me)
            if bad:
                os.close(nfd)
                raise bad
            os.close(fd)
            fd, cur = nfd, shown
        return fd, created
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def remove_made(created: list) -> None:
    """Remove the directories :func:`open_trusted_dir` made (innermost first), each only if it is
    still empty; stops at the first that is not."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            return
