"""Exception hierarchy of tierckpt.

Every error the client raises is a :class:`TierckptError`. Subclasses also derive from the
matching builtin so that callers can catch either (``NotFoundError`` is a ``KeyError``).
The daemon raises the same classes internally; :mod:`tierckpt.common.status` maps them to gRPC
status codes in exactly one place, and the client maps them back.
"""

from __future__ import annotations

__all__ = [
    "TierckptError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "CapacityError",
    "UnavailableError",
    "DataLossError",
    "FailedPreconditionError",
    "DeadlineExceededError",
    "PermissionDeniedError",
    "TierError",
    "AbortedError",
    "InternalError",
]


class TierckptError(Exception):
    """Root of every tierckpt error."""


class InvalidArgumentError(TierckptError, ValueError):
    """A request field is malformed; the message names the field."""


class NotFoundError(TierckptError, KeyError):
    """The job, step, rank or shard does not exist in any reachable tier."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class AlreadyExistsError(TierckptError):
    """The object already exists and may not be replaced."""


class CapacityError(TierckptError):
    """The local tier is full even after evicting what may be evicted."""


class UnavailableError(TierckptError, ConnectionError):
    """The daemon (or a peer / the object store it needs) cannot be reached."""


class DataLossError(TierckptError):
    """Stored bytes failed their checksum; they were not returned."""


class FailedPreconditionError(TierckptError):
    """The request is valid but the system is not in a state to serve it (e.g. shutting down)."""


class PermissionDeniedError(TierckptError, PermissionError):
    """The caller may not do this (a peer outside the placement, a certificate naming another node)."""


class DeadlineExceededError(TierckptError, TimeoutError):
    """The operation did not finish before its deadline."""


class TierError(TierckptError):
    """A background tier (peer replication, persistent drain) failed for this checkpoint."""


class AbortedError(TierckptError):
    """This save was superseded by another save of the same job, step and rank, or it was
    aborted or expired before its commit: nothing of it is stored (the other save, if any, is
    whole). Saving again is safe."""


class InternalError(TierckptError):
    """The daemon failed in a way no other class describes (an I/O error on its node, a bug);
    the message says what. Nothing was returned that failed verification."""
