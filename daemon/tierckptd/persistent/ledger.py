"""What this process knows of its drains, in memory, on the event loop.

The :class:`Ledger` holds the pending entries (one per queued rank), the generations drained by
this process, the permanent failures, and the event that wakes ``wait`` callers whenever one of
these changes. Components change it; none keeps a copy of it.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..local.manifest import Manifest

__all__ = ["Entry", "Bounded", "Ledger", "Key"]

Key = tuple[str, int, int]
"""(job, step, rank)"""


@dataclass(eq=False)
class Entry:
    """One queued rank."""

    man: Manifest  # the local manifest to drain (replaced by a re-save of the same rank)
    enqueued: float  # wall clock, kept across restarts
    running: bool = False
    not_before: float = 0.0  # monotonic: earliest next attempt after a non-retryable failure
    error: str = ""  # last non-retryable failure, reported by wait()
    cancelled: bool = False  # evicted, superseded or deleted: threads stop retrying
    task: asyncio.Task | None = None  # the attempt in flight, if any


class Bounded(collections.OrderedDict):
    """An insertion-ordered dict that forgets its oldest items beyond ``limit``. Setting, ``get``
    and ``pop`` are safe from several threads (the content layout's upload workers share one)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self._lock = threading.Lock()

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.limit:
                self.popitem(last=False)

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            return super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        with self._lock:
            return super().pop(key, *default)


class Ledger:
    """Pending, drained and failed ranks of this process.

    Attributes:
        pending: key -> entry of every queued rank.
        recent: key -> generation drained by this process (bounded).
        failed: key -> (generation, reason) of permanent failures (bounded).
    """

    def __init__(self) -> None:
        self.pending: dict[Key, Entry] = {}
        self.recent: Bounded = Bounded(65536)
        self.failed: Bounded = Bounded(4096)
        self._changed = asyncio.Event()

    def broadcast(self) -> None:
        """Wake every :meth:`changed` waiter."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def changed(self) -> None:
        """Until the next :meth:`broadcast`."""
        await self._changed.wait()

    def has_pending(self, job: str, step: int) -> bool:
        """Whether any rank of the step is queued."""
        return any(k[0] == job and k[1] == step for k in self.pending)

    def status(self, url: str) -> dict:
        """``backlog_bytes``, ``backlog_steps`` (pending ranks), ``oldest_age_seconds``, ``url``, ``failing``."""
        pending = list(self.pending.values())
        oldest = min((e.enqueued for e in pending), default=None)
        return {
            "backlog_bytes": sum(e.man.nbytes for e in pending),
            "backlog_steps": len(pending),
            "oldest_age_seconds": max(0.0, time.time() - oldest) if oldest is not None else 0.0,
            "url": url,
            "failing": sum(1 for e in pending if e.error),
        }
