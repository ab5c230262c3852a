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
    (E.TierError, grpc.StatusCode.ABORTED),  # first: what ABORTED means without the class name
    (E.AbortedError, grpc.StatusCode.ABORTED),
    (E.InternalError, grpc.StatusCode.INTERNAL),
]
_FROM_CODE: dict[grpc.StatusCode, type[E.TierckptError]] = {}
for _cls, _code in _TO_CODE:
    _FROM_CODE.setdefault(_code, _cls)
# codes the daemon does not send itself (a proxy, grpcio, an older or newer peer): still typed
_FROM_CODE.update({
    grpc.StatusCode.UNKNOWN: E.InternalError,
    grpc.StatusCode.CANCELLED: E.UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: E.PermissionDeniedError,
    grpc.StatusCode.UNIMPLEMENTED: E.FailedPreconditionError,
    grpc.StatusCode.OUT_OF_RANGE: E.InvalidArgumentError,
})
_BY_NAME = {cls.__name__: cls for cls, _ in _TO_CODE}

ERROR_CLASS_KEY = "tierckpt-error"
"""Trailing metadata naming the exception class, where one code carries two (ABORTED)."""


def _known(exc: E.TierckptError) -> tuple[type[E.TierckptError], grpc.StatusCode]:
    for cls, code in _TO_CODE:
        if isinstance(exc, cls):
            return cls, code
    return E.InternalError, grpc.StatusCode.INTERNAL


def code_for(exc: E.TierckptError) -> grpc.StatusCode:
    return _known(exc)[1]


def trailing_metadata(exc: E.TierckptError) -> tuple[tuple[str, str], ...]:
    """What the daemon sends beside the code: the class name (:data:`ERROR_CLASS_KEY`)."""
    return ((ERROR_CLASS_KEY, _known(exc)[0].__name__),)


def error_for_code(code: grpc.StatusCode | None, message: str, name: str = "") -> E.TierckptError:
    """The tierckpt exception for a status code (the inverse of :func:`code_for`); ``name``, the
    class the daemon named, picks between the classes that share the code. Never the bare root
    class: a code nobody sends is an :class:`~tierckpt.errors.InternalError`."""
    cls = _BY_NAME.get(name)
    if cls is None or dict(_TO_CODE).get(cls) != code:
        cls = _FROM_CODE.get(code, E.InternalError) if code is not None else E.InternalError
    return cls(message)


def error_from_rpc(err: grpc.RpcError, what: str = "") -> E.TierckptError:
    """Turn a gRPC error into the matching tierckpt exception (never leak grpc.RpcError)."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return E.UnavailableError(f"{what}: daemon unavailable: {details}" if what else details)
    name = ""
    try:
        for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
            if key == ERROR_CLASS_KEY:
                name = value if isinstance(value, str) else value.decode(errors="replace")
    except Exception:  # metadata is a hint; the code alone still types the error
        name = ""
    return error_for_code(code, details, name)
