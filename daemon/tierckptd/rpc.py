"""The one place where the daemon maps exceptions to gRPC status codes.

Every servicer method (both services) is wrapped in :func:`rpc`: domain code raises
:class:`tierckpt.TierckptError` subclasses (the mapping is :mod:`tierckpt.common.status`), and
an ``OSError`` from the local tier becomes RESOURCE_EXHAUSTED (ENOSPC) or INTERNAL with its
message. Nothing else in the daemon calls ``context.abort``.

Services are registered through :func:`add_service`, whose request deserializers never raise:
bytes that do not decode as the request message become an :class:`Undecodable` request, which
the wrappers answer with INVALID_ARGUMENT (grpcio's own deserializer failure is UNKNOWN).
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tierckpt.common import status as _status
from tierckpt.errors import InvalidArgumentError, TierckptError

__all__ = ["rpc", "rpc_stream", "abort_for", "add_service", "Undecodable", "check_decoded", "Authorizing"]

log = logging.getLogger(__name__)


async def abort_for(exc: BaseException, method: str, context: Any) -> None:
    """Abort the call with the status that ``exc`` maps to (re-raises anything unexpected)."""
    if isinstance(exc, TierckptError):
        code = _status.code_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        await context.abort(code, str(exc), _status.trailing_metadata(exc))
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:  # the local tier's filesystem is full: the capacity condition
            log.error("%s failed: local_dir is full: %s", method, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"local_dir is full on node: {exc.strerror or exc}")
        log.error("%s failed with an I/O error", method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"I/O error on node: {exc.strerror or exc}")
    raise exc


class Undecodable:
    """A request whose bytes did not decode as its message (answered INVALID_ARGUMENT)."""

    def __init__(self, message: str) -> None:
        self.message = message


def check_decoded(request: Any) -> Any:
    """Return ``request``; raise InvalidArgumentError if it is :class:`Undecodable`."""
    if isinstance(request, Undecodable):
        raise InvalidArgumentError(f"request: not a valid protobuf message ({request.message})")
    return request


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    parse = deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(str(e) or "undecodable bytes")

    return deserialize


class _Capture:
    """Stands in for a server while generated code registers a service's handlers."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, dict[str, Any]]] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # rebuilt from the registered handlers below

    def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
        self.registered.append((name, handlers))


def add_service(add_to_server: Callable[[Any, Any], None], servicer: Any, server: Any) -> None:
    """Register ``servicer`` as generated ``add_XServicer_to_server`` would, with lenient deserializers."""
    cap = _Capture()
    add_to_server(servicer, cap)
    for name, handlers in cap.registered:
        wrapped = {m: h._replace(request_deserializer=_lenient(h.request_deserializer)) for m, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, wrapped),))
        server.add_registered_method_handlers(name, wrapped)


class Authorizing:
    """The base of every servicer whose methods :func:`rpc` wraps."""

    def authorize(self, request: Any, context: Any) -> None:
        """Runs before every wrapped method; raises PermissionDeniedError to refuse the call.
        Default: every caller that reached the service may call it."""


def rpc(fn: Callable) -> Callable:
    """Decorate a unary method of an :class:`Authorizing` servicer: tierckpt exceptions and OS
    errors become status codes. The servicer's ``authorize(request, context)`` runs first."""

    @functools.wraps(fn)
    async def wrapper(self: Authorizing, request: Any, context: Any) -> Any:
        try:
            request = check_decoded(request)
            self.authorize(request, context)
            return await fn(self, request, context)
        except (TierckptError, OSError) as e:
            await abort_for(e, fn.__name__, context)

    return wrapper


def rpc_stream(fn: Callable) -> Callable:
    """Decorate a server-streaming servicer method (an async generator) the same way."""

    @functools.wraps(fn)
    async def wrapper(self: Authorizing, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            request = check_decoded(request)
            self.authorize(request, context)
            async for item in fn(self, request, context):
                yield item
        except (TierckptError, OSError) as e:
            await abort_for(e, fn.__name__, context)

    return wrapper
