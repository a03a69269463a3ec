"""Level-1 backups of host memory: spill files that really leave the process's RAM.

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

The store is :class:`~.spill_store.SpillStore` (host memory; how it opens its directory:
:mod:`.spill_open`), :class:`~.staged_spill.StagedSpillStore` (device memory, through a host
staging buffer), their checksummed reads in :mod:`.spill_reads`; all importable from here.
"""

from __future__ import annotations

from .spill_reads import _STEP, PIECE, _buffer, _hasher, _read_exact, _read_hashed  # noqa: F401
from .spill_store import SpillStore, log  # noqa: F401
from .staged_spill import StagedSpillStore  # noqa: F401
