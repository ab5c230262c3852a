"""The drain's chunk worker processes stopped while a save is open or committing on the node.

A save's blocking is a memory copy; a drain's chunk workers stream memory too (reading,
hashing and encoding 8 MiB chunks), and even at ``SCHED_IDLE`` on another core they take the
memory bandwidth and the last-level cache the copy needs. Waiting between chunks
(:meth:`.chunkread.ChunkReader.yield_to_saves`) leaves the chunk begun before the save running
through it, and a chunk takes longer than most saves' copies. So, with the work in child
processes (``KNOBS.drain_processes``), the daemon stops them (``SIGSTOP``) the moment a save
opens and continues them (``SIGCONT``) when the last one has committed or was aborted: no drain
work runs alongside a save, whatever point a chunk was at (bench/save_during_drain.py).

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
    """Stops and continues the processes ``pids()`` names as the node's saves come and go.

    Args:
        pids: the drain's chunk worker processes, asked at each pause.
        limit: the longest pause in seconds (default: ``KNOBS.drain_yield``; 0: never pause).
        clock, kill: for tests.
    """

    def __init__(self, pids: Callable[[], list[int]], limit: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, kill: Callable[[int, int], None] = os.kill) -> None:
        self._pids = pids
        self._limit = limit or (lambda: KNOBS.drain_yield)
        self._clock, self._kill = clock, kill
        self._cv = threading.Condition()
        self._busy = False
        self._stopped: list[int] = []  # processes stopped by the pause in progress
        self._since = 0.0
        self._run_until = 0.0  # after a pause that reached its limit: none before this
        self._thread: threading.Thread | None = None
        self._closed = False
        self.pauses = 0
        """Pauses begun (tests and benchmarks)."""

    @property
    def stopped(self) -> list[int]:
        with self._cv:
            return list(self._stopped)

    def busy(self, busy: bool) -> None:
        """The local store's listener: a save opened here (True) or the last one left (False).
        Called under the store's lock: it only signals processes and wakes the watcher."""
        with self._cv:
            self._busy = busy
            if busy:
                self._stop_locked()
            else:
                self._continue_locked()
            self._cv.notify_all()

    def close(self) -> None:
        """Continue every stopped process and end the watcher (the tier stops)."""
        with self._cv:
            self._closed = True
            self._continue_locked()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _stop_locked(self) -> None:
        if self._stopped or self._closed or self._limit() <= 0 or self._clock() < self._run_until:
            return
        stopped = []
        for pid in self._pids():
            if self._signal(pid, signal.SIGSTOP):
                stopped.append(pid)
        if not stopped:
            return
        self._stopped, self._since = stopped, self._clock()
        self.pauses += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="drain-pause", daemon=True)
            self._thread.start()

    def _continue_locked(self) -> None:
        for pid in self._stopped:
            self._signal(pid, signal.SIGCONT)
        self._stopped = []

    def _signal(self, pid: int, sig: int) -> bool:
        try:
            self._kill(pid, sig)
            return True
        except ProcessLookupError:  # exited meanwhile: the pool replaces it
            return False
        except OSError as err:  # not ours to signal (cannot happen for our children): never paused again
            log.warning("drain chunk worker %d cannot be paused (%s): the drain runs alongside saves", pid, err)
            self._closed = True
            return False

    def _watch(self) -> None:
        """Ends a pause at its limit, and begins the next one after the run that follows it
        while saves are still open."""
        with self._cv:
            while not self._closed:
                now, limit = self._clock(), self._limit()
                if self._stopped:
                    end = self._since + limit
                    if now < end:
                        self._cv.wait(end - now)
                        continue
                    self._continue_locked()
                    self._run_until = now + limit
                    log.debug("drain paused for %.1f s while saves stay open: it runs for %.1f s", limit, limit)
                elif self._busy and now < self._run_until:
                    self._cv.wait(self._run_until - now)
                elif self._busy:
                    self._stop_locked()
                    if not self._stopped:
                        self._cv.wait()
                else:
                    self._cv.wait()
