"""The durable drain queue: what survives a restart of the daemon.

One JSON file per pending rank, ``<local_dir>/drain-queue/<job>.<step:020d>.<rank:07d>.json``
holding ``{"format": 1, "job", "step", "rank", "generation", "enqueued"}``, written under a
temporary name and renamed (flushed when the local tier flushes), removed once the manifest is
uploaded. A restarted daemon re-queues every entry whose rank is still in the local store. While
queued, the step is pinned in the local store (``store.pin(job, step, "drain")``): retention skips
it; only capacity may evict it, and then the entry fails loudly (logged, counted in
``drain_failures``) rather than retrying forever.

:class:`DrainQueue` does the (blocking) file work; :class:`QueueWriter` applies the puts and
removes that the event loop asks for in a worker thread, one at a time and in the order asked, so
a remove of a drained save never overtakes the put of the re-save that follows it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from pathlib import Path
from typing import Any

from tierckpt.common.fileio import atomic_write

from ..local.localfs import read_small_path
from ..local.manifest import Manifest
from ..offload import run_blocking

__all__ = ["DrainQueue", "QueueWriter", "QUEUE_DIR"]

log = logging.getLogger(__name__)

QUEUE_DIR = "drain-queue"
"""Name of the queue directory inside the local dir."""
_QUEUE_FORMAT = 1
_MAX_ENTRY_BYTES = 64 << 10


class DrainQueue:
    """Pending drains, one small JSON file per rank (see the module docstring). Blocking.

    Args:
        root: the queue directory (``<local_dir>/drain-queue``); created if missing.
        fsync: flush each entry and the directory (when the local tier is on a durable medium).
    """

    def __init__(self, root: Path, *, fsync: bool) -> None:
        self.root = root
        self.fsync = fsync

    def _path(self, job: str, step: int, rank: int) -> Path:
        return self.root / f"{job}.{step:020d}.{rank:07d}.json"

    def put(self, man: Manifest, enqueued: float) -> None:
        """Record (or replace) the entry for ``man``'s rank, atomically.

        Raises:
            OSError: the entry could not be written.
        """
        doc = {"format": _QUEUE_FORMAT, "job": man.job, "step": man.step, "rank": man.rank,
               "generation": man.generation, "enqueued": enqueued}
        atomic_write(self._path(man.job, man.step, man.rank), json.dumps(doc, sort_keys=True).encode(),
                     fsync=self.fsync)

    def remove(self, job: str, step: int, rank: int) -> None:
        """Forget the rank's entry (none is fine)."""
        self._path(job, step, rank).unlink(missing_ok=True)

    def load(self) -> list[dict[str, Any]]:
        """Every entry, oldest first; temporary leftovers and unreadable entries are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        out = []
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.name.endswith(".json"):
                p.unlink(missing_ok=True)
                continue
            try:
                doc = json.loads(read_small_path(p, _MAX_ENTRY_BYTES))  # no link, FIFO or device
                named = self._path(doc["job"], int(doc["step"]), int(doc["rank"]))
                if doc.get("format") != _QUEUE_FORMAT or p != named:
                    raise ValueError("unexpected format or name")
                doc["enqueued"] = float(doc["enqueued"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("drain queue: dropping unreadable entry %s: %s", p, e)
                p.unlink(missing_ok=True)
                continue
            out.append(doc)
        return sorted(out, key=lambda d: (d["enqueued"], d["step"], d["rank"]))


class QueueWriter:
    """Applies :class:`DrainQueue` puts and removes off the event loop, in call order.

    ``put`` and ``remove`` are called on the loop and return at once; a failed put is logged
    (the drain still runs; only a restart before it ends would lose it). ``flush`` waits until
    every change asked for so far is on disk.
    """

    def __init__(self, queue: DrainQueue) -> None:
        self.queue = queue
        self._ops: collections.deque[tuple[str, Any]] = collections.deque()
        self._task: asyncio.Task | None = None

    def put(self, man: Manifest, enqueued: float) -> None:
        """Record ``man``'s rank (soon, off the loop)."""
        self._submit("put", (man, enqueued))

    def remove(self, job: str, step: int, rank: int) -> None:
        """Forget the rank's entry (soon, off the loop)."""
        self._submit("remove", (job, step, rank))

    def _submit(self, op: str, args: Any) -> None:
        self._ops.append((op, args))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self) -> None:
        """Until every put and remove asked for so far is applied."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while self._ops:
            op, args = self._ops.popleft()
            try:
                if op == "put":
                    await run_blocking(self.queue.put, *args)
                else:
                    await run_blocking(self.queue.remove, *args)
            except OSError as err:
                if op == "put":
                    man = args[0]
                    log.error("drain queue: cannot record %s step %d rank %d in %s: %s; this drain does not "
                              "survive a restart", man.job, man.step, man.rank, self.queue.root, err)
                else:
                    log.error("drain queue: cannot remove the entry of %s step %d rank %d in %s: %s",
                              *args, self.queue.root, err)
