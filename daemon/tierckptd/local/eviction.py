"""Carrying out evictions in the local tier: retention, capacity (planned first), rank removal.

The rules are :mod:`.rules`'s; this class applies them to the catalog and the files. Every
method is called with the store's lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierckpt.errors import CapacityError

from .index import Catalog
from .manifest import Manifest
from .paths import StoreLayout
from .recycle import RecyclePool
from .rules import Eviction, charge_rank, plan_room
from .staging import Staging

__all__ = ["Evictor", "charge"]

log = logging.getLogger(__name__)


def charge(x: Staging | Manifest) -> int:
    """Bytes an open save or a committed rank is charged against the capacity: its files and its
    manifest (metadata included; an open save's manifest is charged the minimum until its commit
    knows the size). An open save's shared files are charged to their inode, see :mod:`.links`."""
    if isinstance(x, Manifest):
        return charge_rank((s.size for s in x.shards), x.stored_bytes)
    return charge_rank((f.size for f in x.files.values() if not f.shared), x.manifest_bytes)


class Evictor:
    """Evicts steps and ranks from the catalog and the local dir (under the store's lock)."""

    def __init__(self, catalog: Catalog, layout: StoreLayout, recycle: RecyclePool, counters: dict[str, int]) -> None:
        self._catalog = catalog
        self._layout = layout
        self._recycle = recycle
        self.counters = counters

    def retain(self, job: str, keep_local: int) -> list[Eviction]:
        """Apply retention to ``job``."""
        return [self.evict(job, step, "retention") for step in self._catalog.retention_victims(job, keep_local)]

    def make_room_for(self, job: str, need: int, capacity: int, used: int, evictable: Callable[[str], bool] | None,
                      safe_elsewhere: Callable[[Manifest], bool]) -> list[Eviction]:
        """:meth:`make_room` for a reservation of ``job``: it may evict its own job's steps, and
        other jobs' steps only where every rank is safe in another tier (``safe_elsewhere``): a
        writer never costs another job a step that exists nowhere else. ``evictable(job)``
        (when given) excludes whole jobs."""
        def allowed(j: str, step: int) -> bool:
            if evictable is not None and not evictable(j):
                return False
            if j == job:
                return True
            ranks = self._catalog.steps(j).get(step, {})
            return bool(ranks) and all(safe_elsewhere(m) for m in ranks.values())

        self._recycle.sink_paused = True  # the plan counts on freeing what it evicts
        try:
            return self.make_room(need, capacity, used, allowed)
        finally:
            self._recycle.sink_paused = False

    def make_room(self, need: int, capacity: int, used: int,
                  evictable: Callable[[str, int], bool] | None = None) -> list[Eviction]:
        """Evict (recycled files, then old safe steps, then old undrained steps) until ``need`` fits.

        Decided up front: a reservation that cannot fit evicts nothing. ``evictable(job, step)``
        limits the steps considered (recycled files are always droppable).

        Raises:
            CapacityError: ``need`` does not fit even after every possible eviction.
        """
        if need > capacity:
            raise CapacityError(f"shards: {need} bytes exceed local_capacity {capacity}")
        order = self._catalog.capacity_order(allow_pinned=False)
        first = set(order)
        order += [k for k in self._catalog.capacity_order(allow_pinned=True) if k not in first]
        if evictable is not None:
            order = [k for k in order if evictable(*k)]
        cat = self._catalog
        cands = [(k, sum(cat.freeable(m, charge(m)) for m in cat.steps(k[0])[k[1]].values())) for k in order]
        plan = plan_room(need, capacity, used, self._recycle.bytes, cands)
        if not plan.fits:
            raise CapacityError(f"shards: {need} bytes do not fit in local_capacity {capacity} "
                                f"({used - plan.reclaimable} used by the newest complete and in-progress steps)")
        # open and committing saves:
        staging = used - cat.committed_bytes - cat.links.charged - self._recycle.bytes

        def over() -> int:
            return staging + cat.committed_bytes + cat.links.charged + self._recycle.bytes + need - capacity

        self._recycle.drop(over())
        evictions = []
        for job, step in plan.evict:
            evictions.append(self._evict_for_capacity(job, step))
            self._recycle.drop(over())  # the evicted files may have gone to the pool
        return evictions

    def _evict_for_capacity(self, job: str, step: int) -> Eviction:
        pins = self._catalog.pins(job, step)
        if pins:
            log.error("local tier full: evicting %s step %d before it was drained (%s)", job, step,
                      ",".join(sorted(pins)))
            self.counters["evictions_capacity_undrained"] += 1
            self._catalog.drop_pins(job, step)
        return self.evict(job, step, "capacity_undrained" if pins else "capacity")

    def evict(self, job: str, step: int, reason: str) -> Eviction:
        """Remove a whole step (manifests first, data files to the recycle pool)."""
        ranks = self._catalog.pop_step(job, step)
        for man in ranks.values():
            self._catalog.uncharge(man, charge(man))
            self._layout.remove_rank_files(man)
        self._layout.prune(job, step, job_too=not self._catalog.has_job(job))
        log.info("evicted %s step %d (%d ranks, %s)", job, step, len(ranks), reason)
        return Eviction(job, step, tuple(sorted(ranks)), reason)

    def remove_rank(self, job: str, step: int, rank: int, reason: str, *, generation: str | None = None) -> bool:
        """Remove one committed rank; with ``generation``, only if it is still that save."""
        man = self._catalog.get(job, step, rank)
        if man is None or (generation is not None and man.generation != generation):
            return False
        self._catalog.pop_rank(job, step, rank)
        self._catalog.uncharge(man, charge(man))
        self._layout.remove_rank_files(man)
        if not self._catalog.steps(job).get(step):
            self._layout.prune(job, step, job_too=False)
        log.info("removed %s step %d rank %d (%s)", job, step, rank, reason)
        return True
