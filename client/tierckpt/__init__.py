"""tierckpt: a thin client for the tierckpt multi-tier checkpoint daemon.

    import tierckpt
    with tierckpt.Client() as c:
        fut = c.save("job", step=100, rank=0, world_size=4, shards={"model": array})
        fut.result()
        ck = c.restore("job", rank=0)
"""

from typing import TYPE_CHECKING, Any

# Errors are light (no dependency): imported now. Everything else is imported on first use
# (PEP 562), so that ``tierckpt.errors`` and ``tierckpt.common``, which the daemon shares, load
# no client module, grpc or numpy.
from .errors import (
    AbortedError,
    AlreadyExistsError,
    CapacityError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    TierckptError,
    TierError,
    UnavailableError,
)

if TYPE_CHECKING:
    from ._admin import CopyCheck, DeleteResult, JobPolicy, VerifyResult
    from .client import Checkpoint, CheckpointInfo, Client, RankLocation, SaveFuture, SaveResult, StepAvailability
    from .manager import CheckpointManager

_LAZY = {
    "CopyCheck": "._admin", "DeleteResult": "._admin", "JobPolicy": "._admin", "VerifyResult": "._admin",
    "Checkpoint": ".client", "CheckpointInfo": ".client", "Client": ".client", "RankLocation": ".client",
    "SaveFuture": ".client", "SaveResult": ".client", "StepAvailability": ".client",
    "CheckpointManager": ".manager",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Client", "CheckpointManager", "SaveFuture", "SaveResult", "Checkpoint", "CheckpointInfo", "RankLocation",
    "StepAvailability", "TierckptError", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError",
    "CapacityError", "UnavailableError", "DataLossError", "FailedPreconditionError", "DeadlineExceededError",
    "PermissionDeniedError", "TierError", "AbortedError", "InternalError", "JobPolicy", "CopyCheck",
    "DeleteResult", "VerifyResult",
]
