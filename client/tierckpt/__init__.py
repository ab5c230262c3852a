"""tierckpt: a thin client for the tierckpt multi-tier checkpoint daemon.

    import tierckpt
    with tierckpt.Client() as c:
        fut = c.save("job", step=100, rank=0, world_size=4, shards={"model": array})
        fut.result()
        ck = c.restore("job", rank=0)
"""

from .client import Checkpoint, CheckpointInfo, Client, RankLocation, StepAvailability, SaveFuture, SaveResult
from .manager import CheckpointManager
from .errors import (
    AlreadyExistsError,
    CapacityError,
    DataLossError,
    DeadlineExceededError,
    PermissionDeniedError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
    TierError,
    UnavailableError,
)

__version__ = "0.1.0"

__all__ = [
    "Client", "CheckpointManager", "SaveFuture", "SaveResult", "Checkpoint", "CheckpointInfo", "RankLocation", "StepAvailability",
    "TierckptError", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError", "CapacityError",
    "UnavailableError", "DataLossError", "FailedPreconditionError", "DeadlineExceededError", "PermissionDeniedError", "TierError",
]
