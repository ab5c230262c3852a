"""Object-store calls off the event loop, with retries, on the persistent tier's own threads.

Retries: every upload retries throttling, 5xx and connection errors with capped exponential
backoff and full jitter for as long as they last (``KNOBS.drain_retry``: an outage delays
drains, loses nothing); reads (restore downloads, manifests, listings) retry within
``KNOBS.read_retry`` or a tighter policy. A non-retryable error is raised at once.

Every call runs through :func:`~tierckptd.offload.run_blocking` on :class:`DaemonThreads`, the
tier's pools: a fresh daemon thread per call (at most ``KNOBS.upload_threads`` uploads,
``KNOBS.codec_threads`` chunks being read and encoded and ``KNOBS.read_threads`` reads at once),
so a slow object store cannot starve the default pool and a hung SDK call never blocks the
daemon's exit. The drain's threads (uploads, and the calls that hand chunks to the chunk
worker processes of :mod:`.chunkproc`, or with ``KNOBS.drain_processes=0`` read, hash and encode
them themselves) run under ``SCHED_IDLE`` (``KNOBS.drain_idle``) at nice ``KNOBS.drain_nice``
and wait up to ``DRAIN_THREAD_KEEP`` seconds for their next call, so that a drain takes only the
CPU that saves and the trainers' own threads leave idle (bench/save_during_drain.py); reads
(restores) run at the daemon's priority.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import os
import queue
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

DRAIN_THREAD_KEEP = 30.0
"""Seconds a drain thread waits for its next call before it ends (:class:`DaemonThreads`)."""


class Stopped(Exception):
    """Raised inside a worker thread's retry sleep when the tier stops or the entry is cancelled."""


class DaemonThreads(cf.Executor):
    """An executor that runs each call on a daemon thread; ``active`` counts running calls.

    Concurrency is bounded by the caller (:class:`BackendCalls`' semaphores), not here. A thread
    that finished a call waits up to ``keep`` seconds for the next one (a drain's chunks follow
    each other: no thread start, no new stack, its zstd coders kept); one is started whenever none
    waits. ``policy()`` says how each call runs: a niceness, and whether under ``SCHED_IDLE``
    (Linux applies both per thread); a waiting thread only takes calls of its own policy (an
    unprivileged thread cannot raise its priority again).
    """

    def __init__(self, name: str, policy: Callable[[], tuple[int, bool]] = lambda: (0, False),
                 keep: float = 0.0) -> None:
        self.name = name
        self.policy = policy
        self.keep = keep
        self.active = 0
        self._lock = threading.Lock()
        self._parked: list[tuple[tuple[int, bool], queue.SimpleQueue]] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        item = (fut, functools.partial(fn, *args, **kwargs))
        policy = self.policy()
        with self._lock:
            self.active += 1
            for i in range(len(self._parked) - 1, -1, -1):
                if self._parked[i][0] == policy:
                    self._parked.pop(i)[1].put(item)
                    return fut
        threading.Thread(target=self._work, args=(policy, item), name=self.name, daemon=True).start()
        return fut

    def _work(self, policy: tuple[int, bool], item: tuple[cf.Future, Callable[[], Any]]) -> None:
        _apply(policy)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while True:
            self._run(*item)
            if self.keep <= 0:
                return
            with self._lock:
                self._parked.append((policy, inbox))
            try:
                item = inbox.get(timeout=self.keep)
            except queue.Empty:
                with self._lock:
                    if (policy, inbox) in self._parked:
                        self._parked.remove((policy, inbox))
                        return
                item = inbox.get()  # a submit took this thread as the wait ended: its call is in the inbox

    def _run(self, fut: cf.Future, call: Callable[[], Any]) -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, call())
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


def _apply(policy: tuple[int, bool]) -> None:
    """Set this thread's niceness and, where asked, ``SCHED_IDLE`` (Linux: a thread id is a process
    id for these calls). ``SCHED_IDLE`` threads run only on a CPU that nothing else wants: a
    save's RPC, its client's copy and the trainer preempt them at once on wake-up."""
    niceness, idle = policy
    tid = threading.get_native_id()
    try:
        if niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # pragma: no cover - not Linux, or a sandbox forbids it
        pass


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
        self.drain_threads = DaemonThreads("tierckpt-drain", lambda: (KNOBS.drain_nice, bool(KNOBS.drain_idle)),
                                           keep=DRAIN_THREAD_KEEP)
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
