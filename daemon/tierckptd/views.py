"""What the tiers hold, merged: the answers behind Latest, List and Availability.

Local ranks come from the store; each remote tier answers through its ``catalog_with_gaps``
(cluster-wide: bounded fan-out, names who did not answer) or ``rank_catalog`` (one rank, as
cheaply as the tier can: the peer tier asks only its ring neighbourhood).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierckpt.common.names import check_job
from tierckpt.errors import DeadlineExceededError

from .knobs import KNOBS
from .local.store import LocalStore
from .tiers import RankCopy, RemoteTier

__all__ = ["CatalogViews", "StepView", "RankView", "TIERS"]

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "persistent")


@dataclass
class RankView:
    rank: int
    tiers: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    nbytes: int = 0


@dataclass
class StepView:
    step: int
    world_size: int
    ranks: dict[int, RankView] = field(default_factory=dict)
    created: float = 0.0
    newest: float = 0.0  # the newest rank copy's creation time (0: unknown, e.g. a bare listing)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world_size

    def complete_in(self) -> list[str]:
        return [t for t in TIERS if self.ranks and len(self.ranks) == self.world_size
                and all(t in r.tiers for r in self.ranks.values())]



class CatalogViews:
    """Merged views of a job's steps over the local store and the remote tiers."""

    def __init__(self, store: LocalStore, tiers: Sequence[RemoteTier], node_id: str) -> None:
        self.store, self.tiers, self.node_id = store, list(tiers), node_id

    async def steps(self, job: str, job_owner: str | None = None) -> dict[int, StepView]:
        """Every step of ``job`` known to any tier, with where each rank is held; with
        ``job_owner``, only the copies that identity saved (everywhere a caller asks)."""
        return (await self.views_with_gaps(job, job_owner))[0]

    async def views_with_gaps(self, job: str, job_owner: str | None = None
                              ) -> tuple[dict[int, StepView], list[str]]:
        """:meth:`views` plus the sources (peers, tiers) that did not answer within the deadline."""
        check_job(job)
        views: _Candidates = {}
        for step, ranks in self.store.steps(job).items():
            for rank, man in ranks.items():
                if job_owner in (None, man.job_owner):
                    _add(views, job, step, rank, "local", RankCopy(man.world_size, (self.node_id,), man.nbytes,
                                                                   man.created, man.job_owner))
        gaps: list[str] = []
        results = await asyncio.gather(*(self._tier_catalog(t, job, job_owner) for t in self.tiers),
                                       return_exceptions=True)
        for t, res in zip(self.tiers, results):
            if isinstance(res, BaseException):
                log.warning("catalog of the %s tier unavailable for %s: %s", t.name, job, res)
                gaps.append(f"{t.name} tier ({res})")
                continue
            copies, missed = res
            gaps.extend(f"peer {n}" if t.name == "peer" else n for n in missed)  # peers name nodes, others say it all
            for step, held in copies.items():
                for rank, copy in held.items():
                    _add(views, job, step, rank, t.name, copy)
        return _pick(views, job), gaps

    async def _tier_catalog(self, t: RemoteTier, job: str, job_owner: str | None
                            ) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        try:
            return await asyncio.wait_for(t.catalog_with_gaps(job, job_owner),
                                          KNOBS.fanout_deadline + KNOBS.rpc_timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"no answer within {KNOBS.fanout_deadline + KNOBS.rpc_timeout:.0f}s") from None

    async def latest(self, job: str, job_owner: str | None = None) -> int | None:
        return (await self.latest_with_gaps(job, job_owner))[0]

    async def latest_with_gaps(self, job: str, job_owner: str | None = None) -> tuple[int | None, list[str]]:
        """Newest step complete over all tiers and nodes that answered, and those that did not
        (with ``job_owner``: of the steps that identity saved)."""
        views, gaps = await self.views_with_gaps(job, job_owner)
        complete = [s for s, v in views.items() if v.complete]
        return (max(complete) if complete else None), gaps

    async def availability(self, job: str, rank: int, job_owner: str | None = None
                           ) -> tuple[list[StepView], list[str]]:
        """Steps that ``rank`` can restore: from the local tier, each remote tier's cheapest
        answer for one rank (the peer tier: the ring neighbourhood), nearest tier first (with
        ``job_owner``: the copies that identity saved)."""
        check_job(job)
        views: _Candidates = {}
        for step, local in self.store.steps(job).items():
            man = local.get(rank)
            if man is not None and job_owner in (None, man.job_owner):
                copy = RankCopy(man.world_size, (self.node_id,), man.nbytes, man.created, man.job_owner)
                _add(views, job, step, rank, "local", copy)
        gaps: list[str] = []
        results = await asyncio.gather(*(asyncio.wait_for(t.rank_catalog(job, rank, job_owner), KNOBS.fanout_deadline
                                                          + KNOBS.rpc_timeout) for t in self.tiers),
                                       return_exceptions=True)
        for t, res in zip(self.tiers, results):
            if isinstance(res, BaseException):
                log.warning("availability of %s rank %d: the %s tier did not answer: %r", job, rank, t.name, res)
                gaps.append(f"{t.name} tier")
                continue
            for step, copy in res.items():
                _add(views, job, step, rank, t.name, copy)
        picked = _pick(views, job)
        return [picked[s] for s in sorted(picked)], gaps


_Candidates = dict[int, dict[int, StepView]]
"""step -> world size -> the ranks held with that world size"""


def _add(views: _Candidates, job: str, step: int, rank: int, tier: str, copy: RankCopy) -> None:
    by_world = views.setdefault(step, {})
    v = by_world.get(copy.world_size)
    if v is None:
        v = by_world[copy.world_size] = StepView(step, copy.world_size, created=copy.created)
    r = v.ranks.setdefault(rank, RankView(rank))
    r.tiers.add(tier)
    r.nodes.update(copy.nodes)
    r.nbytes = max(r.nbytes, copy.nbytes)
    v.created = min(v.created, copy.created) if v.created else copy.created
    v.newest = max(v.newest, copy.created)


def _pick(views: _Candidates, job: str) -> dict[int, StepView]:
    """One view per step. A step re-saved with another world size (a job restarted on fewer
    ranks) can still hold ranks of the earlier save, in some tier or on some node: the step is
    what one save wrote, never a mix. The complete one wins, then the newest, then the one with
    more ranks held, then the first seen (the nearest tier); the others' ranks are ignored."""
    out: dict[int, StepView] = {}
    for step, by_world in views.items():
        cands = list(by_world.values())
        best = max(cands, key=lambda v: (v.complete, v.newest, len(v.ranks)))
        if len(cands) > 1:
            log.info("%s step %d: ranks saved with world sizes %s; using world size %d (ignoring %s)", job, step,
                     sorted(by_world), best.world_size,
                     {v.world_size: sorted(v.ranks) for v in cands if v is not best})
        out[step] = best
    return out
