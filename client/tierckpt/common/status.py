"""The one mapping between tierckpt exceptions and gRPC status codes (both directions)."""

from __future__ import annotations

import grpc

from .. import errors as E

_TO_CODE: list[tuple[type[E.TierckptError], grpc.StatusCode]] = [
    (E.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (E.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (E.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (E.DataLossError, grpc.StatusCode.DATA_LOSS),
    (E.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (E.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (E.TierError, grpc.StatusCode.ABORTED),
]
_FROM_CODE = {code: cls for cls, code in _TO_CODE}


def code_for(exc: E.TierckptError) -> grpc.StatusCode:
    for cls, code in _TO_CODE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_for_code(code: grpc.StatusCode | None, message: str) -> E.TierckptError:
    """The tierckpt exception for a status code (the inverse of :func:`code_for`)."""
    return _FROM_CODE.get(code, E.TierckptError)(message)


def error_from_rpc(err: grpc.RpcError, what: str = "") -> E.TierckptError:
    """Turn a gRPC error into the matching tierckpt exception (never leak grpc.RpcError)."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return E.UnavailableError(f"{what}: daemon unavailable: {details}" if what else details)
    return error_for_code(code, details)
