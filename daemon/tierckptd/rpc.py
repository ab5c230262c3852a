"""The one place where the daemon maps exceptions to gRPC status codes.

Every servicer method (both services) is wrapped in :func:`rpc`: domain code raises
:class:`tierckpt.TierckptError` subclasses (the mapping is :mod:`tierckpt.common.status`), and
an ``OSError`` from the local tier becomes RESOURCE_EXHAUSTED (ENOSPC) or INTERNAL with its
message. Nothing else in the daemon calls ``context.abort``.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tierckpt.common import status as _status
from tierckpt.errors import TierckptError

__all__ = ["rpc", "rpc_stream", "abort_for"]

log = logging.getLogger(__name__)


async def abort_for(exc: BaseException, method: str, context: Any) -> None:
    """Abort the call with the status that ``exc`` maps to (re-raises anything unexpected)."""
    if isinstance(exc, TierckptError):
        code = _status.code_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        await context.abort(code, str(exc))
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:  # the local tier's filesystem is full: the capacity condition
            log.error("%s failed: local_dir is full: %s", method, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"local_dir is full on node: {exc.strerror or exc}")
        log.error("%s failed with an I/O error", method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"I/O error on node: {exc.strerror or exc}")
    raise exc


def rpc(fn: Callable) -> Callable:
    """Decorate a unary servicer method: tierckpt exceptions and OS errors become status codes."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await fn(self, request, context)
        except (TierckptError, OSError) as e:
            await abort_for(e, fn.__name__, context)

    return wrapper


def rpc_stream(fn: Callable) -> Callable:
    """Decorate a server-streaming servicer method (an async generator) the same way."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (TierckptError, OSError) as e:
            await abort_for(e, fn.__name__, context)

    return wrapper
