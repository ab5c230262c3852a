"""Object-store calls off the event loop, with retries, on the persistent tier's own threads.

Retries: every upload retries throttling, 5xx and connection errors with capped exponential
backoff and full jitter for as long as they last (``KNOBS.drain_retry``: an outage delays
drains, loses nothing); reads (restore downloads, manifests, listings) retry within
``KNOBS.read_retry`` or a tighter policy. A non-retryable error is raised at once.

Every call runs through :func:`~tierckptd.offload.run_blocking` on :class:`DaemonThreads`, the
tier's pools: a fresh daemon thread per call (at most ``KNOBS.upload_threads`` uploads,
``KNOBS.codec_threads`` chunks being read and encoded and ``KNOBS.read_threads`` reads at once),
so a slow object store cannot starve the default pool and a hung SDK call never blocks the
daemon's exit. The drain's threads (reading, hashing and encoding chunks, on as many cores as
``codec_threads``: the codecs release the GIL; and uploads) run at nice ``KNOBS.drain_nice``, so
that a drain takes the CPU that saves and the trainers' own threads leave idle
(bench/save_during_drain.py); reads (restores) run at the daemon's priority.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from tierckpt.errors import UnavailableError

from ..backends import Backend, BackendError
from ..knobs import KNOBS
from ..offload import run_blocking
from ..retry import RetryPolicy, call_with_retry

__all__ = ["BackendCalls", "DaemonThreads", "Stopped"]

T = TypeVar("T")


class Stopped(Exception):
    """Raised inside a worker thread's retry sleep when the tier stops or the entry is cancelled."""


class DaemonThreads(cf.Executor):
    """An executor that runs each call in a new daemon thread; ``active`` counts running calls.

    Concurrency is bounded by the caller (:class:`BackendCalls`' semaphores), not here.
    """

    def __init__(self, name: str, nice: Callable[[], int] = lambda: 0) -> None:
        self.name = name
        self.nice = nice
        self.active = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()

        def run() -> None:
            outcome: tuple[bool, Any]
            if niceness := self.nice():
                try:  # this thread only (Linux: a thread id is a process id for setpriority); it ends with the call
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
                except (OSError, AttributeError):  # pragma: no cover - not Linux
                    pass
            try:
                outcome = (True, fn(*args, **kwargs))
            except BaseException as err:  # thread boundary: the awaiting coroutine re-raises it
                outcome = (False, err)
            finally:
                with self._lock:
                    self.active -= 1
            if not fut.set_running_or_notify_cancel():
                return
            if outcome[0]:
                fut.set_result(outcome[1])
            else:
                fut.set_exception(cast(BaseException, outcome[1]))

        with self._lock:
            self.active += 1
        threading.Thread(target=run, name=self.name, daemon=True).start()
        return fut


class BackendCalls:
    """The persistent tier's one handle on its object store.

    Args:
        metrics: optional :class:`~tierckptd.metrics.Metrics` (``drain_failures`` counts retries
            of uploads).
        backend: the opened backend, or None until :meth:`open` is called at start.
    """

    def __init__(self, metrics: Any = None, backend: Backend | None = None) -> None:
        self.metrics = metrics
        self.backend = backend
        self.threads = DaemonThreads("tierckpt-persistent")
        self.drain_threads = DaemonThreads("tierckpt-drain", lambda: KNOBS.drain_nice)
        self.halt = threading.Event()
        self._uploads = asyncio.Semaphore(KNOBS.upload_threads)
        self.coding = asyncio.Semaphore(KNOBS.codec_threads)
        """Held by a drain's chunk from its read until its upload ended (``KNOBS.codec_threads``)."""
        self._reads = asyncio.Semaphore(KNOBS.read_threads)

    @property
    def be(self) -> Backend:
        """The backend (after start).

        Raises:
            UnavailableError: it is not open (the tier has not started).
        """
        if self.backend is None:
            raise UnavailableError("persistent tier: the object store is not open yet")
        return self.backend

    async def write(self, fn: Callable[[], T], cancelled: Callable[[], bool] = lambda: False) -> T:
        """``fn()`` in a worker thread, retrying retryable errors until the tier stops.

        Raises:
            Stopped: the tier stopped, or ``cancelled()`` became true, while waiting to retry.
            BackendError: a non-retryable error.
        """
        def sleep(delay: float) -> None:
            if self.halt.wait(delay) or cancelled():
                raise Stopped()

        call = functools.partial(call_with_retry, fn, KNOBS.drain_retry, on_retry=self._on_retry, sleep=sleep)
        async with self._uploads:
            return await run_blocking(call, pool=self.drain_threads)

    async def code(self, fn: Callable[[], T]) -> T:
        """``fn()`` (reading, checking and encoding a chunk: local work, no retry) on a drain
        thread; the caller holds :attr:`coding`."""
        return await run_blocking(fn, pool=self.drain_threads)

    async def read(self, fn: Callable[[], T], policy: RetryPolicy | None = None) -> T:
        """``fn()`` in a worker thread, retrying retryable errors within ``policy`` (default
        ``KNOBS.read_retry``).

        Raises:
            UnavailableError: the tier is stopping.
            BackendError: the last error once the policy gave up, or a non-retryable one.
        """
        def sleep(delay: float) -> None:
            if self.halt.wait(delay):
                raise Stopped()

        call = functools.partial(call_with_retry, fn, policy or KNOBS.read_retry, sleep=sleep)
        try:
            async with self._reads:
                return await run_blocking(call, pool=self.threads)
        except Stopped:
            raise UnavailableError("daemon is shutting down") from None

    def _on_retry(self, attempt: int, err: BackendError, delay: float) -> None:
        if self.metrics:
            self.metrics.drain_failures.inc()

    def stop(self) -> None:
        """Wake every retry sleep (they raise :class:`Stopped`); close the backend unless a call
        is still running in a thread (a hung call keeps it; the process exits anyway)."""
        self.halt.set()
        if self.backend is not None and self.threads.active == 0 and self.drain_threads.active == 0:
            self.backend.close()
