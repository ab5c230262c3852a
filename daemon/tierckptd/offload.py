"""The one way the daemon runs blocking work off the event loop.

Concurrency model (the whole daemon): one asyncio event loop (uvloop when installed) runs the
gRPC servers, the tiers' background tasks and all bookkeeping. Anything that may block — file
I/O in the local dir (open, write, fsync, rename, rmtree, hashing), object-store SDK calls, bulk
socket transfers — runs in a worker thread through :func:`run_blocking`, never on the loop.
The local store guards its catalog with its own lock, so its methods are safe from any thread;
tiers keep their in-memory state on the loop and hand worker threads only immutable inputs.
Worker pools: the default pool (file and store work), plus dedicated pools owned by the peer
tier (long-lived bulk connections) and the persistent tier (uploads and downloads), passed as
``pool=`` so that a slow object store cannot starve local saves of threads.
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
