"""tierckpt: a thin client for the tierckpt multi-tier checkpoint daemon.

    import tierckpt
    with tierckpt.Client() as c:
        fut = c.save("job", step=100, rank=0, world_size=4, shards={"model": array})
        fut.result()
        ck = c.restore("job", rank=0)
"""

from ._admin import CopyCheck, DeleteResult, JobPolicy, VerifyResult
from .client import Checkpoint, CheckpointInfo, Client, RankLocation, SaveFuture, SaveResult, StepAvailability
from .errors import (
    AlreadyExistsError,
    CapacityError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    TierckptError,
    TierError,
    UnavailableError,
)
from .manager import CheckpointManager

__version__ = "0.1.0"

__all__ = [
    "Client", "CheckpointManager", "SaveFuture", "SaveResult", "Checkpoint", "CheckpointInfo", "RankLocation",
    "StepAvailability", "TierckptError", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError",
    "CapacityError", "UnavailableError", "DataLossError", "FailedPreconditionError", "DeadlineExceededError",
    "PermissionDeniedError", "TierError", "JobPolicy", "CopyCheck", "DeleteResult", "VerifyResult",
]
