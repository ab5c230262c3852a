"""Retention of the persistent tier (``keep_persistent`` N > 0).

After a drain, the steps that :func:`.selection.plan_retention` names (older than the N-th newest
complete step) are deleted, manifests first, then data, so a reader never sees a manifest whose
data is gone; chunks of the content layout that no manifest names any more are then collected
(:mod:`.gc`). One retention pass per job at a time; a failure postpones it to the next drain.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable

from tierckpt.errors import DataLossError, UnavailableError

from ..backends import BackendError
from ..knobs import KNOBS
from .calls import BackendCalls
from .catalog import Catalog
from .gc import collect
from .layout import parse_tombstone_key, step_data_prefix, step_manifests_prefix
from .selection import plan_retention

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Deletes old steps from the store.

    Args:
        calls: the tier's object-store handle.
        catalog: lists the job's steps; told what was deleted.
        keep: a job's ``keep_persistent`` (0 keeps everything): its policy.
        node_id: this node (named by its collections' markers).
        collecting: the markers of this process's collections in flight (:func:`.gc.collect`).
    """

    def __init__(self, calls: BackendCalls, catalog: Catalog, keep: Callable[[str], int], node_id: str = "",
                 collecting: set[str] | None = None) -> None:
        self.node_id = node_id
        self.collecting = collecting if collecting is not None else set()
        self.calls = calls
        self.catalog = catalog
        self.keep = keep
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    async def retain(self, job: str) -> None:
        """Keep the newest ``keep`` complete steps of ``job``: manifests go first (a task: errors
        are logged, not raised)."""
        async with self._locks[job]:
            try:
                steps = await self.catalog.list_steps(job, KNOBS.catalog_retry)
                doomed = plan_retention(steps, self.keep(job))
                for step in doomed:
                    await self._delete_step(job, step)
                if doomed:
                    await collect(self.calls, job, self.node_id, self.collecting)
            except (BackendError, UnavailableError, DataLossError) as err:
                log.warning("persistent retention of %s postponed to the next drain: %s", job, err)
            finally:
                self.catalog.invalidate(job)

    async def delete_step(self, job: str, step: int) -> tuple[int, int]:
        """Delete one step on request (``tierckpt rm``), under the job's retention lock: every
        rank's manifest first, then the data (per-shard objects; then the chunks no other step
        names are collected). Returns (manifests, data objects and chunks) deleted.

        Raises:
            BackendError, UnavailableError: the store failed (manifests may be gone already).
        """
        async with self._locks[job]:
            try:
                manifests, data = await self._delete_step(job, step, "deleted on request", keep_tombstone=True)
            finally:
                self.catalog.invalidate(job)
            try:
                data += await collect(self.calls, job, self.node_id, self.collecting)
            except (BackendError, UnavailableError, DataLossError) as err:  # the step is gone already
                log.warning("collection after deleting %s step %d postponed to the next one: %s", job, step, err)
            return manifests, data

    async def _delete_step(self, job: str, step: int, why: str = "", *,
                           keep_tombstone: bool = False) -> tuple[int, int]:
        """Manifests first, then data; the step's tombstone goes too unless ``keep_tombstone``
        (``tierckpt rm`` wrote it just before: :mod:`.tombstone`)."""
        be, policy = self.calls.be, KNOBS.catalog_retry
        listed = await self.calls.read(functools.partial(be.list, step_manifests_prefix(job, step)), policy)
        manifests = [k for k in listed if parse_tombstone_key(job, k) is None]
        await self.calls.read(functools.partial(be.delete, manifests if keep_tombstone else listed), policy)
        data = await self.calls.read(functools.partial(be.list, step_data_prefix(job, step)), policy)
        await self.calls.read(functools.partial(be.delete, data), policy)
        self.catalog.forget_step(job, step)
        log.info("%s: deleted %s step %d from %s (%d objects)", why or f"keep_persistent={self.keep(job)}",
                 job, step, self.catalog.url, len(manifests) + len(data))
        return len(manifests), len(data)
