"""The drain's chunk worker processes stopped while a save is open or committing on the node.

A save's blocking is a memory copy; a drain's chunk workers stream memory too (reading,
hashing and encoding 8 MiB chunks), and even at ``SCHED_IDLE`` on another core they take the
memory bandwidth and the last-level cache the copy needs. Waiting between chunks
(:meth:`.chunkread.ChunkReader.yield_to_saves`) leaves the chunk begun before the save running
through it, and a chunk takes longer than most saves' copies. So, with the work in child
processes (``KNOBS.drain_processes``), the daemon stops them (``SIGSTOP``) the moment a save
opens and continues them (``SIGCONT``) ``KNOBS.drain_resume_delay`` seconds after the last one
has committed or was aborted (unless another opened meanwhile): no drain work runs alongside a
save, whatever point a chunk was at, nor while the commit's reply travels back to the trainer
(bench/save_during_drain.py).

The drain's threads wait in :meth:`DrainPause.wait_idle` before each upload (and, without child
processes, before each chunk's read): woken when the pause ends, never polling. A ``file://``
store writes an upload out in 1 MiB pieces, waiting between them (:mod:`..backends.file`).

Bounded, so that a node whose saves never stop still drains: a pause lasts at most
``KNOBS.drain_yield`` seconds, and one that lasted that long is followed by at least as long a
run before the next pause (the drain then keeps half the time). ``drain_yield = 0``: never
paused.

A stopped child is not a risk to the daemon: a drain thread waiting for its answer just waits
(the GIL released), and nothing on a save's path ever waits for a child. The children set
``PR_SET_PDEATHSIG`` (:func:`.chunkproc.lower_priority`), so a daemon killed while they are
stopped does not leave them behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from ..knobs import KNOBS

__all__ = ["DrainPause"]

log = logging.getLogger(__name__)


class DrainPause:
    """Holds the drain back while the node's saves come and go: stops and continues the processes
    ``pids()`` names, and keeps :meth:`wait_idle` callers (the drain's threads) waiting.

    Args:
        pids: the drain's chunk worker processes, asked at each pause.
        limit: the longest pause in seconds (default: ``KNOBS.drain_yield``; 0: never pause).
        clock, kill: for tests.
    """

    def __init__(self, pids: Callable[[], list[int]], limit: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, kill: Callable[[int, int], None] = os.kill,
                 linger: Callable[[], float] | None = None) -> None:
        self._pids = pids
        self._limit = limit or (lambda: KNOBS.drain_yield)
        self._linger = linger or (lambda: KNOBS.drain_resume_delay)
        self._clock, self._kill = clock, kill
        self._cv = threading.Condition()
        self._busy = False
        self._paused = False
        self._stopped: list[int] = []  # processes stopped by the pause in progress
        self._since = 0.0
        self._resume_at = 0.0  # the last save left: the pause ends then, unless another opens first
        self._paused_before = 0.0  # seconds of the pauses that ended
        self._run_until = 0.0  # after a pause that reached its limit: none before this
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unsignalable = False
        self.pauses = 0
        """Pauses begun (tests and benchmarks)."""

    @property
    def stopped(self) -> list[int]:
        with self._cv:
            return list(self._stopped)

    @property
    def paused(self) -> bool:
        with self._cv:
            return self._paused

    def paused_seconds(self) -> float:
        """Seconds the drain was paused in all, the pause in progress included."""
        with self._cv:
            return self._paused_before + (self._clock() - self._since if self._paused else 0.0)

    def busy(self, busy: bool) -> None:
        """The local store's listener: a save opened here (True) or the last one left (False).
        Called under the store's lock: it only signals processes and wakes the others."""
        with self._cv:
            self._busy = busy
            self._resume_at = 0.0
            if busy:
                self._pause_locked()
            elif self._paused and (linger := self._linger()) > 0:  # a pause has its watcher running
                self._resume_at = self._clock() + linger  # which continues them then
            else:
                self._resume_locked()
            self._cv.notify_all()

    def adopt(self, pid: int) -> None:
        """A child started during a pause is stopped with the others before its first request."""
        with self._cv:
            if self._paused and not self._unsignalable and self._signal(pid, signal.SIGSTOP):
                self._stopped.append(pid)

    def wait_idle(self, halt: threading.Event) -> None:
        """Block (a drain thread) while the drain is paused, or until ``halt``: woken by
        :meth:`busy`, the watcher and :meth:`wake` (whoever sets ``halt`` calls it), not polling:
        pollers would take the daemon's GIL from the save's own RPCs many times a second (eight
        upload threads at 20 Hz did until 2026-12-07)."""
        with self._cv:
            while self._paused and not self._closed and not halt.is_set():
                self._cv.wait(1.0)  # a backstop only

    def wake(self) -> None:
        """Let every :meth:`wait_idle` caller look at its ``halt`` again (the tier stops)."""
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        """Continue every stopped process, release the waiters and end the watcher (the tier stops)."""
        with self._cv:
            self._closed = True
            self._resume_locked()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _pause_locked(self) -> None:
        if self._paused or self._closed or self._limit() <= 0 or self._clock() < self._run_until:
            return
        self._paused, self._since = True, self._clock()
        self.pauses += 1
        if not self._unsignalable:
            self._stopped = [pid for pid in self._pids() if self._signal(pid, signal.SIGSTOP)]
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="drain-pause", daemon=True)
            self._thread.start()

    def _resume_locked(self) -> None:
        self._resume_at = 0.0
        for pid in self._stopped:
            self._signal(pid, signal.SIGCONT)
        self._stopped = []
        if self._paused:
            self._paused_before += self._clock() - self._since
        self._paused = False

    def _signal(self, pid: int, sig: int) -> bool:
        try:
            self._kill(pid, sig)
            return True
        except ProcessLookupError:  # exited meanwhile: the pool replaces it
            return False
        except OSError as err:  # not ours to signal (cannot happen for our children): threads only
            log.warning("drain chunk worker %d cannot be paused (%s): only the drain's threads wait for saves",
                        pid, err)
            self._unsignalable = True
            return False

    def _watch(self) -> None:
        """Ends a pause at its limit, and begins the next one after the run that follows it
        while saves are still open."""
        with self._cv:
            while not self._closed:
                now, limit = self._clock(), self._limit()
                if self._paused and not self._busy and self._resume_at:
                    if now < self._resume_at and now < self._since + limit:
                        self._cv.wait(min(self._resume_at, self._since + limit) - now)
                        continue
                    self._resume_locked()
                    self._cv.notify_all()
                elif self._paused:
                    end = self._since + limit
                    if now < end:
                        self._cv.wait(end - now)
                        continue
                    self._resume_locked()
                    self._run_until = now + limit
                    self._cv.notify_all()
                    log.debug("drain paused for %.1f s while saves stay open: it runs for %.1f s", limit, limit)
                elif self._busy and now < self._run_until:
                    self._cv.wait(self._run_until - now)
                elif self._busy and limit > 0:
                    self._pause_locked()
                else:
                    self._cv.wait()
