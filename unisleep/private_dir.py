"""This user's private run directory for unisleep (mode 0700, owned by this user): where a
loopback transfer group's secret file and the spill disks' turn locks live.  Nobody else can
read, plant or swap anything there; a directory another user made at its name is never used
(:class:`~unisleep.errors.PrivateDirError` names its owner and the fix)."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from typing import Optional

from .errors import PrivateDirError

log = logging.getLogger("unisleep")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _private_base(path: str, owners: tuple) -> Optional[str]:
    """Why ``path`` cannot hold this user's run directory (None: it can): it must be a real
    directory owned by one of ``owners`` that nobody else may write."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in owners:
        return f"{path} belongs to {_owner(st.st_uid)}"
    if st.st_mode & 0o022:
        return f"{path} may be written by others (mode {oct(st.st_mode & 0o777)})"
    return None


def _run_dir_candidates() -> list:
    """(base, the run directory in it, whose base it must be) in order of preference."""
    uid = os.getuid()
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        out.append((xdg, os.path.join(xdg, "unisleep"), (uid,)))
    sysd = f"/run/user/{uid}"
    if sysd != xdg and os.path.isdir(sysd):
        out.append((sysd, os.path.join(sysd, "unisleep"), (uid,)))
    if uid == 0:
        out.append(("/run", "/run/unisleep", (0,)))  # only root may create entries there: no one can squat it
    return out


def private_dir() -> str:
    """This user's private run directory for unisleep (mode 0700, owned by this user), created on
    first use, in the first of these whose parent is this user's own and written by no one else:
    ``$XDG_RUNTIME_DIR/unisleep``, ``/run/user/<uid>/unisleep``, for root ``/run/unisleep``; else
    ``<tmp>/unisleep-<uid>``.  A directory of another user at that name (planted to block or to
    read this user's secrets) is never used: :class:`TransferError` names its owner and the fix."""
    for base, path, owners in _run_dir_candidates():
        why = _private_base(base, owners)
        if why is None:
            return _make_private(path, squattable=False)
        if base == os.environ.get("XDG_RUNTIME_DIR"):
            log.warning("XDG_RUNTIME_DIR is not used for unisleep's private files: %s (it must be a directory of "
                        "mode 0700 owned by %s)", why, _owner(os.getuid()))
    return _make_private(os.path.join(tempfile.gettempdir(), f"unisleep-{os.getuid()}"), squattable=True)


def _make_private(path: str, squattable: bool) -> str:
    uid = os.getuid()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise PrivateDirError(f"cannot create unisleep's private directory {path}: {e.strerror}; set XDG_RUNTIME_DIR "
                            "to a directory of mode 0700 that you own") from None
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return path
    what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a file")
    if st.st_uid != uid:
        fix = (f"another user made it, which blocks this user's transfer groups (and could read what is put there): "
               f"remove it (as root: rm -r {path}) and tell that user's owner; or set XDG_RUNTIME_DIR to a "
               f"directory of mode 0700 that {_owner(uid)} owns (e.g. mkdir -m 700 -p ~/.run && export "
               "XDG_RUNTIME_DIR=~/.run)")
    else:
        fix = (f"it is this user's but {'not a directory' if what != 'a directory' else 'open to others'}: remove it "
               f"(rm -r {path}) or set XDG_RUNTIME_DIR to a directory of mode 0700 that you own")
    where = " (in a directory every user may write)" if squattable else ""
    raise PrivateDirError(f"unisleep's private directory {path}{where} is {what} of mode {oct(st.st_mode & 0o777)} "
                        f"owned by {_owner(st.st_uid)}, not a directory of mode 0700 owned by {_owner(uid)}: {fix}")
