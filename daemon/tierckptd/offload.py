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

__all__ = ["run_blocking"]

T = TypeVar("T")


async def run_blocking(fn: Callable[..., T], /, *args: Any, pool: cf.Executor | None = None, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a worker thread (``pool``, else the loop's default pool)
    and return its result; context variables travel with the call as with ``asyncio.to_thread``."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await loop.run_in_executor(pool, call)
