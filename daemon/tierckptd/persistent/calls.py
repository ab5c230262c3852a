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
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from tierckpt.errors import UnavailableError

from ..backends import Backend, BackendError
from ..knobs import KNOBS
from ..offload import run_blocking
from ..retry import RetryPolicy, call_with_retry

__all__ = ["BackendCalls", "DaemonThreads", "Stopped"]

T = TypeVar("T")
log = logging.getLogger(__name__)

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
                 keep: float = 0.0, *, lift: bool = False) -> None:
        self.name = name
        self.policy = policy
        self.keep = keep
        self.active = 0
        self._lock = threading.Lock()
        self._parked: list[tuple[tuple[int, bool], queue.SimpleQueue]] = []
        self.lifter = _lifter() if lift else None
        """With ``lift``: a call under ``SCHED_IDLE`` still running after ``KNOBS.drain_idle_grace``
        seconds finishes at the normal policy (:class:`Lifter`). Its thread is started here, by
        the thread that builds the pool, never by one of the pool's own."""

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
            watch = self.lifter.watch() if self.lifter is not None and policy[1] else None
            try:
                self._run(*item)
            finally:
                if watch is not None and self.lifter is not None and self.lifter.unwatch(watch):
                    _apply(policy)  # lifted during the call: back under SCHED_IDLE (a thread may lower itself)
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


class Lifter:
    """Lifts drain threads starved under ``SCHED_IDLE``: a call that is still running
    ``KNOBS.drain_idle_grace`` seconds after it began finishes at the normal policy (still at its
    niceness), then its thread goes back under ``SCHED_IDLE``.

    On a node whose every core stays busy a ``SCHED_IDLE`` thread gets almost no CPU, so a drain
    whose uploads (or, with ``drain_processes=0`` or children that cannot start, whose codec) run
    on such threads would stall for as long as the node is busy. The chunk workers have the same
    lift (:meth:`.chunkproc.ChunkWorker.lift`). One thread per process does the lifting; it must
    itself run at the normal policy, so it is started by the first pool built with ``lift``
    (:class:`BackendCalls`, as the tier is built), never by a drain thread, whose policy a new
    thread would inherit. Raising a thread's policy needs ``RLIMIT_NICE`` >= 1 for an
    unprivileged daemon (the systemd unit's ``LimitNICE=1``); refused, it warns once and the
    calls wait for idle CPU.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._due: dict[int, tuple[int, float]] = {}  # watch -> (thread id, deadline)
        self._lifted: set[int] = set()
        self._ids = itertools.count(1)
        self._wake = float("inf")  # the deadline the lifting thread waits for
        self.lifts = 0
        self.can_lift = True
        threading.Thread(target=self._loop, name="tierckpt-drain-lifter", daemon=True).start()

    def watch(self) -> int | None:
        """Watch the calling thread's call from now on; None where nothing will be lifted."""
        grace = KNOBS.drain_idle_grace
        if grace <= 0 or not self.can_lift:
            return None
        with self._cv:
            watch = next(self._ids)
            deadline = time.monotonic() + grace
            self._due[watch] = (threading.get_native_id(), deadline)
            if deadline < self._wake:  # usually a later one is due first: no wake-up per call
                self._cv.notify()
        return watch

    def unwatch(self, watch: int) -> bool:
        """The call ended; whether its thread was lifted meanwhile (then it lowers itself)."""
        with self._cv:
            self._due.pop(watch, None)
            if watch in self._lifted:
                self._lifted.discard(watch)
                return True
        return False

    def _loop(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                for watch, (tid, deadline) in list(self._due.items()):
                    if deadline <= now:
                        del self._due[watch]
                        if self._lift(tid):
                            self._lifted.add(watch)
                self._wake = min((deadline for _, deadline in self._due.values()), default=float("inf"))
                self._cv.wait(None if self._wake == float("inf") else max(0.001, self._wake - now))

    def _lift(self, tid: int) -> bool:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (OSError, AttributeError) as err:
            if self.can_lift:
                log.warning("a drain thread got no CPU for %.1f s under SCHED_IDLE and cannot be lifted (%s): on a "
                            "busy node the drain waits for idle CPU (RLIMIT_NICE >= 1 or CAP_SYS_NICE lets it be "
                            "lifted)", KNOBS.drain_idle_grace, err)
            self.can_lift = False
            return False
        self.lifts += 1
        if self.lifts == 1:
            log.warning("a drain thread got no CPU for %.1f s under SCHED_IDLE (a busy node): such calls finish at "
                        "the normal policy at nice %d (said once)", KNOBS.drain_idle_grace, KNOBS.drain_nice)
        return True


_LIFTER: list[Lifter] = []
_LIFTER_LOCK = threading.Lock()


def _lifter() -> Lifter:
    """The process's :class:`Lifter` (started by the first caller)."""
    with _LIFTER_LOCK:
        if not _LIFTER:
            _LIFTER.append(Lifter())
        return _LIFTER[0]


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
                                           keep=DRAIN_THREAD_KEEP, lift=True)
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
