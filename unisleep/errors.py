"""The errors unisleep raises.

Every illegal move raises *before* anything changes, so catching one of these leaves the
lifecycle exactly as it was.  Bad arguments (a level that does not exist, an unknown tag) also
subclass :class:`ValueError`, so generic argument handling keeps working.
"""

from __future__ import annotations


class UnisleepError(RuntimeError):
    """Base class of every error unisleep raises on purpose."""


class InvalidTransitionError(UnisleepError):
    """The move is not allowed from the current state (e.g. weights sent into sleeping memory,
    a level-1 sleep over a level-2 sleep).  Nothing was changed."""


class BackupError(UnisleepError):
    """A level-1 backup could not be made (no room, ENOSPC, EIO, a read-only spill directory, a
    driver or hook failure).  The lifecycle was returned to exactly its state before the call:
    every tag as it was, bytes exact, addresses mapped, the partial backup removed.  ``tag``,
    ``nbytes``, ``path`` and ``cause`` say what failed where."""

    def __init__(self, message: str, *, tag=None, nbytes=None, path=None, cause=None):
        super().__init__(message)
        self.tag, self.nbytes, self.path, self.cause = tag, nbytes, path, cause


class HostBudgetError(BackupError):
    """A level-1 sleep would need more host memory or spill space than allowed or available.
    Checked before anything is released."""


class HostMemoryError(HostBudgetError):
    """The host cannot hold a backup: it needs more host memory than the tightest limit allows —
    what the kernel has available (``MemAvailable``), the room left under the process's memory
    cgroup (``memory.max`` / ``memory.limit_in_bytes``, up its hierarchy), its address-space
    limit, or its locked-memory limit where the store page-locks with ``mlock``.  Raised before
    anything is pinned or released, instead of letting the kernel's OOM killer pick a process.
    ``needed`` and ``available`` are bytes; ``limit`` names the limit that refused, ``limits``
    every limit read (name -> bytes available under it)."""

    def __init__(self, message: str, *, needed: int, available: int, limit: str, limits=None, **kw):
        super().__init__(message, nbytes=needed, **kw)
        self.needed, self.available, self.limit = needed, available, limit
        self.limits = dict(limits or {})


class BackupCorruptError(BackupError):
    """A backup failed its checksum, or its file is missing or short, when waking.  Nothing of
    it was exposed: the tag stays ``"offloaded"`` (its memory unmapped) and can be discarded,
    slept at level 2, or woken empty and refilled by a weight transfer."""


class BackupLostError(BackupError):
    """Memory could not be brought back after a failure: the tag is marked ``"lost"``.  Discard
    it (``discard([tag])``), then wake it (zeros) and load the weights again."""


class InsufficientMemoryError(UnisleepError):
    """An allocation asks for more physical memory than the device or host has free; checked
    before anything is committed."""


class LifecycleClosedError(InvalidTransitionError):
    """The :class:`~unisleep.MemoryLifecycle` was closed (``close()``, garbage collection or
    interpreter exit): its memory is released, every tag reads ``"closed"``, and every verb —
    sleep, wake, discard, allocate, adopt, pool, backup, ``resident_bytes``, a transfer guard —
    raises this before touching memory.  Create a new lifecycle."""


class CopyInFlightError(InvalidTransitionError):
    """A progressive wake or a background sleep is still copying the memory this call would
    touch (wake, sleep, discard or allocate into a tag whose copy is in flight).  Nothing was
    changed; ``MemoryLifecycle.wait()`` waits for the copies, then call again."""


class UnsupportedError(UnisleepError):
    """The operation does not exist on this platform or backend; the message names the
    alternative."""


class NativeLibraryMissingError(UnsupportedError):
    """unisleep was installed without its one compiled file, the torch_memory_saver preload
    library (no C compiler at install time); the message says how to build it."""


class PlatformError(UnisleepError):
    """Platform detection or backend loading failed; the message says what to install or set."""


class InvalidArgumentError(UnisleepError, ValueError):
    """An argument is out of range (e.g. ``level=3``)."""


class SleepBudgetError(InvalidArgumentError):
    """``sleep(free_at_least=N)`` cannot free ``N`` bytes: the tags this sleep may put to sleep
    (its level, ``tags`` and ``offload_tags``) hold less memory, or the request conflicts with the
    other arguments.  Checked before anything changes; ``asked`` and ``available`` are bytes
    (``available``: what this sleep could free at most)."""

    def __init__(self, message: str, *, asked: int = 0, available: int = 0):
        super().__init__(message)
        self.asked, self.available = asked, available


class SpillDirError(InvalidArgumentError):
    """The spill directory cannot be used (read-only, not a directory, not creatable); the
    message names the path and what to pass instead."""


class ModelDirError(InvalidArgumentError):
    """A model directory, or the cache it is built in, that another user could have planted or
    could change: it, a directory on the way to it or a file in it belongs to another user or may
    be written by one, or a link on the way is another user's.  Nothing was loaded from it or
    built there; the message names the path, its owner and the fix (a directory only this user
    can change — by default unisleep's private run directory)."""


class LiveTensorsError(InvalidTransitionError):
    """``close(strict=True)`` was asked while tensors handed out by the lifecycle are still
    referenced; the message lists their tags.  Drop them first, or use ``close()``."""


class UnknownTagError(InvalidArgumentError):
    """A tag that this lifecycle has never allocated; the message lists the known ones."""


class TransferError(UnisleepError):
    """A weight update failed, was incomplete or corrupt; the previous version stays served."""


class TornWeightsError(TransferError):
    """The engine's weights are torn: an update failed after part of it was applied, and the
    previous weights could not be restored (no retained level-1 backup held them).  Generation
    and weight reads through unisleep refuse until a complete update arrives.  ``version`` is
    the update that is incomplete, ``previous`` the version served before it, ``names`` the
    tensors already overwritten (``None`` when not known)."""

    def __init__(self, msg: str, *, version=None, previous=None, names=None):
        super().__init__(msg)
        self.version, self.previous, self.names = version, previous, names


class IncompleteUpdateError(TransferError):
    """An update that must cover the receiver's weights (``WeightReceiver(require_complete=...)``)
    leaves out tensors that are not preserved across the engine's sleep: refused at the
    acknowledgement, before any byte moved.  ``missing`` lists them."""

    def __init__(self, msg: str, *, missing=None):
        super().__init__(msg)
        self.missing = list(missing or [])


class UpdateMemoryError(TransferError, InsufficientMemoryError):
    """The receiving side ran out of memory (host or device) part-way through an update — its
    own memory, not a fault of the sender; ``outcome`` says what became of the weights.  Free
    memory on the receiving side, or give the sender a smaller ``bucket_bytes``."""


class PrivateDirError(TransferError):
    """unisleep's private run directory for this user cannot be used: another user made a
    directory at its name (to block this user's transfer groups or read what is put there), or
    it is not a directory of mode 0700 owned by this user.  The message names the owner and the
    fix.  A :class:`TransferError`: a loopback transfer group keeps its secret there."""


class VersionError(TransferError, InvalidArgumentError):
    """An update's version is not a version (an integer or a short string) or does not come after
    the version sent last (on the sender) or served (on a receiver).  Nothing was sent or applied;
    the receiver keeps its version, and the sender's error says which side refused and why."""


class IntrusionError(TransferError):
    """A process outside the group took part in an update — a connection to the data channel that
    could not prove the group secret — so the update stopped before any weights reached it.  The
    message and ``group.intrusions`` name what was refused (its uid where this machine can see it);
    the next update uses a fresh data channel."""


class DescriptorLimitError(TransferError):
    """A process of the group ran out of file descriptors (``EMFILE``/``ENFILE``: its
    ``RLIMIT_NOFILE`` or the system's limit) in the middle of an update.  The message names the
    process, how many descriptors it holds and its limit, and how to raise it; the other side of
    the update hears the same reason instead of waiting for a timeout."""


class EngineError(UnisleepError):
    """An inference engine answered with an error (route, status and body are in the message)."""


class DeviceProcessError(UnisleepError):
    """One of the per-device processes of ``unisleep bench --devices`` exited, reported an error,
    or did not answer within the stated time.  The message names the process (its device and
    pid), the step it was in and the time waited; the other processes were stopped before it
    was raised."""


__all__ = [
    "UnisleepError",
    "InvalidTransitionError",
    "LifecycleClosedError",
    "HostBudgetError",
    "BackupError",
    "BackupCorruptError",
    "BackupLostError",
    "InsufficientMemoryError",
    "UpdateMemoryError",
    "SpillDirError",
    "ModelDirError",
    "LiveTensorsError",
    "UnsupportedError",
    "PlatformError",
    "InvalidArgumentError",
    "UnknownTagError",
    "TransferError",
    "TornWeightsError",
    "IncompleteUpdateError",
    "VersionError",
    "IntrusionError",
    "DescriptorLimitError",
    "EngineError",
    "DeviceProcessError",
]
