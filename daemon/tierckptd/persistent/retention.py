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

from tierckpt.errors import DataLossError, UnavailableError

from ..backends import BackendError
from ..knobs import KNOBS
from .calls import BackendCalls
from .catalog import Catalog
from .gc import collect
from .layout import step_data_prefix, step_manifests_prefix
from .selection import plan_retention

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Deletes old steps from the store.

    Args:
        calls: the tier's object-store handle.
        catalog: lists the job's steps; told what was deleted.
        keep: ``keep_persistent`` (0 keeps everything).
    """

    def __init__(self, calls: BackendCalls, catalog: Catalog, keep: int) -> None:
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
                doomed = plan_retention(steps, self.keep)
                for step in doomed:
                    await self._delete_step(job, step)
                if doomed:
                    await collect(self.calls, job)
            except (BackendError, UnavailableError, DataLossError) as err:
                log.warning("persistent retention of %s postponed to the next drain: %s", job, err)
            finally:
                self.catalog.invalidate(job)

    async def _delete_step(self, job: str, step: int) -> None:
        be, policy = self.calls.be, KNOBS.catalog_retry
        manifests = await self.calls.read(functools.partial(be.list, step_manifests_prefix(job, step)), policy)
        await self.calls.read(functools.partial(be.delete, manifests), policy)
        data = await self.calls.read(functools.partial(be.list, step_data_prefix(job, step)), policy)
        await self.calls.read(functools.partial(be.delete, data), policy)
        self.catalog.forget_step(job, step)
        log.info("keep_persistent=%d: deleted %s step %d from %s (%d objects)",
                 self.keep, job, step, self.catalog.url, len(manifests) + len(data))
