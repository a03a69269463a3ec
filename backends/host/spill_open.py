"""How a :class:`~.spill_store.SpillStore` opens its directory: ``spill_dir`` made where it is
missing, one name at a time at its parent's descriptor and never through another user's link
(:func:`~.spill_dir.open_spill_parent`; removed again at close if still empty), the private directory created and claimed
with its owner marker (``layout="private"``), or ``spill_dir`` itself opened once
(``layout="flat"``) — every step under the trust rules of :mod:`.spill_store`."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import stat as _stat
import time

from unisleep.errors import SpillDirError
from unisleep.trusted_dirs import remove_made

from .collective import boot_id

from .spill_dir import DIR_FLAGS, DIR_PREFIX, FLAT_PREFIX, MARKER_KIND, OWNER_FILE, open_spill_parent

log = logging.getLogger("unisleep.host")


class SpillDirSetup:
    """The directory set-up of :class:`~.spill_store.SpillStore` (a mixin: it sets the store's
    ``dir``, ``_name``, ``_parent_fd``, ``_dir_fd``, ``_lock_fd``, ``_made_dirs`` and, for the
    flat layout, ``_flat_tag``)."""

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
