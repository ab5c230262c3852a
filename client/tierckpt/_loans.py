"""Ending the daemon's loans of restored files once the client no longer maps them.

A same-node restore maps the committed files; the daemon keeps them out of its recycle pool
while a loan is open (see ``tierckptd.local.recycle``). Each restore's maps get a
:func:`weakref.finalize`; when the last map of a restore is gone (the Checkpoint and every array
or tensor made from it were collected, or :meth:`tierckpt.Checkpoint.close` unmapped them), the
Release RPC is sent from this module's background thread. Finalizers only put a token on a
:class:`queue.SimpleQueue` (reentrant: safe from a finalizer), never call the daemon themselves.
A loan that is never released (the client died, the process exited) only keeps the files out of
the pool, which is safe.
"""

from __future__ import annotations

import mmap
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Loans"]


class Loans:
    """Open loans of one client, released through ``send(job, step, rank, generation)``."""

    def __init__(self, send: Callable[[str, int, int, str], None]) -> None:
        self._send = send
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._left: dict[int, list] = {}  # loan id -> [maps left, key]; only the thread touches it
        self._next = 0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def track(self, key: tuple[str, int, int, str], bufs: dict[str, Any]) -> dict[str, weakref.finalize]:
        """Release ``key`` once every map among ``bufs`` (by shard) is gone; returns their finalizers."""
        maps = {n: b for n, b in bufs.items() if isinstance(b, mmap.mmap)}
        self._ensure_thread()
        with self._start_lock:
            self._next += 1
            loan = self._next
        self._q.put(("open", loan, len(maps), key))
        if not maps:
            self._q.put(("drop", loan))
        return {n: weakref.finalize(m, self._q.put, ("drop", loan)) for n, m in maps.items()}

    def release_now(self, key: tuple[str, int, int, str]) -> None:
        """End a loan whose maps were never handed to the caller (a failed restore)."""
        self._ensure_thread()
        self._q.put(("send", key))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every release queued so far was sent."""
        if self._thread is None:
            return
        done = threading.Event()
        self._q.put(("flush", done))
        done.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Send what is queued, then end the thread (loans still mapped stay open)."""
        if self._thread is not None:
            self._q.put(("stop",))
            self._thread.join(timeout)

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierckpt-release", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            kind = item[0]
            if kind == "stop":
                return
            if kind == "flush":
                item[1].set()
            elif kind == "open":
                self._left[item[1]] = [item[2], item[3]]
            elif kind == "send":
                self._send(*item[1])
            elif kind == "drop":
                left = self._left.get(item[1])
                if left is None:
                    continue
                left[0] -= 1
                if left[0] <= 0:
                    del self._left[item[1]]
                    self._send(*left[1])
