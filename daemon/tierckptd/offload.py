"""The one way the daemon runs blocking work off the event loop.

See the concurrency model in the :mod:`tierckptd` package docstring: everything that may block
goes through :func:`run_blocking`, on the loop's default pool or a tier's own pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["run_blocking", "run_owning"]

T = TypeVar("T")


async def run_blocking(fn: Callable[..., T], /, *args: Any, pool: cf.Executor | None = None, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a worker thread (``pool``, else the loop's default pool)
    and return its result; context variables travel with the call as with ``asyncio.to_thread``."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await loop.run_in_executor(pool, call)


async def run_owning(fn: Callable[..., T], undo: Callable[[T], Any], /, *args: Any, pool: cf.Executor | None = None,
                     **kwargs: Any) -> T:
    """:func:`run_blocking` for a call that acquires something (a staging area): when the awaiting
    task is cancelled (its RPC's caller went away) while ``fn`` still runs, the thread's result is
    handed to ``undo`` (in the pool) instead of being leaked."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    fut = loop.run_in_executor(pool, functools.partial(ctx.run, fn, *args, **kwargs))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        def release(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                loop.run_in_executor(pool, undo, done.result())
        fut.add_done_callback(release)
        raise
