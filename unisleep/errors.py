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


class HostBudgetError(UnisleepError):
    """A level-1 sleep would need more host memory or spill space than allowed or available.
    Checked before anything is released."""


class UnsupportedError(UnisleepError):
    """The operation does not exist on this platform or backend; the message names the
    alternative."""


class PlatformError(UnisleepError):
    """Platform detection or backend loading failed; the message says what to install or set."""


class InvalidArgumentError(UnisleepError, ValueError):
    """An argument is out of range (e.g. ``level=3``)."""


class UnknownTagError(InvalidArgumentError):
    """A tag that this lifecycle has never allocated; the message lists the known ones."""


class TransferError(UnisleepError):
    """A weight update failed, was incomplete or corrupt; the previous version stays served."""


class EngineError(UnisleepError):
    """An inference engine answered with an error (route, status and body are in the message)."""


__all__ = [
    "UnisleepError",
    "InvalidTransitionError",
    "HostBudgetError",
    "UnsupportedError",
    "PlatformError",
    "InvalidArgumentError",
    "UnknownTagError",
    "TransferError",
    "EngineError",
]
