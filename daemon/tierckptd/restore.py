"""The node's restore path: bring one rank into the local tier from the nearest tier holding it.

The local tier is asked first (a copy the client reported corrupt is re-verified and dropped
if it is, see :mod:`.repair`), then each remote tier in restore order (peer before
persistent). A fetched step is pinned while it is fetched and for ``KNOBS.restore_pin_seconds``
after, so retention cannot evict it before the client has mapped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tierckpt.common.names import check_job, check_step
from tierckpt.errors import DataLossError, InvalidArgumentError, NotFoundError, UnavailableError

from .fetchprogress import CURRENT, Fetch
from .knobs import KNOBS
from .local.manifest import Manifest
from .local.store import LocalStore
from .offload import run_blocking
from .repair import LocalRepair
from .tiers import RemoteTier
from .views import CatalogViews

__all__ = ["NodeRestore", "RestoreResult"]

log = logging.getLogger("tierckptd.node")  # the node's restore log lines, as before the split


@dataclass(frozen=True)
class RestoreResult:
    manifest: Manifest
    tier: str
    paths: list[str]
    source_node: str


class NodeRestore:
    """Restores of one node (see :meth:`.node.Node.restore`).

    Args:
        tiers: the node's remote tiers in restore order (the node's own list).
        spawn: starts a background task the node cancels when it stops.
        accepting: whether the node still accepts saves (a stopping node unpins at once).
    """

    def __init__(self, store: LocalStore, tiers: list[RemoteTier], views: CatalogViews, repair: LocalRepair, *,
                 node_id: str, metrics: Any, spawn: Callable[[Coroutine], asyncio.Task],
                 accepting: Callable[[], bool]) -> None:
        self.store, self.tiers, self.views, self.repair = store, tiers, views, repair
        self.node_id = node_id
        self.metrics = metrics
        self._spawn = spawn
        self._accepting = accepting
        # (job, step, rank) -> the fetch in flight: concurrent restores of one rank share it
        # (two fetches would stage the same rank twice and the second would void the first's).
        self._fetching: dict[tuple[str, int, int], asyncio.Task] = {}
        self._progress: dict[tuple[str, int, int], Fetch] = {}  # the tier being tried, per fetch in flight

    async def restore(self, job: str, rank: int, step: int | None, *, local_corrupt: bool = False,
                      corrupt_generation: str = "", lend: bool = True, job_owner: str | None = None) -> RestoreResult:
        """Bring one rank into the local tier and describe it; with ``lend`` (the client maps the
        files) the answer opens a loan that the client ends with :meth:`.node.Node.release`.
        With ``job_owner`` (the caller's identity), only copies that identity saved count, and a
        job this node holds for another owner is PermissionDeniedError."""
        check_job(job)
        t0 = time.perf_counter()
        if job_owner is not None:
            self.store.check_owner(job, job_owner, "restore")
        if step is None:
            step = await self.views.latest(job, job_owner)
            if step is None:
                raise NotFoundError(f"job {job!r} has no complete checkpoint in any tier")
        check_step(step)
        man = self.store.get(job, step, rank)
        if man is not None and job_owner not in (None, man.job_owner):
            man = None  # a copy another identity saved (held from before owners): never served
        errors: list[str] = []
        if man is not None and local_corrupt and corrupt_generation not in ("", man.generation):
            log.info("client reported generation %s of %s step %d rank %d corrupt; it was re-saved since",
                     corrupt_generation, job, step, rank)
        elif man is not None and local_corrupt:
            man = await self.repair.drop_if_corrupt(man, errors)
        tier, source = "local", self.node_id
        if man is None:
            man, tier, source = await self._fetch(job, step, rank, errors, job_owner)
        if rank >= man.world_size:
            raise InvalidArgumentError(f"rank: {rank} is outside world_size {man.world_size}")
        paths = [str(p) for p in (self.store.lend(man) if lend
                                  else (self.store.shard_path(man, s.name) for s in man.shards))]
        if self.metrics:
            self.metrics.restores.labels(tier=tier, result="ok").inc()
            self.metrics.restored_bytes.labels(tier=tier).inc(man.nbytes)
            self.metrics.restore_latency.labels(tier=tier).observe(time.perf_counter() - t0)
        return RestoreResult(man, tier, paths, source)

    async def _fetch(self, job: str, step: int, rank: int, errors: list[str],
                     job_owner: str | None) -> tuple[Manifest, str, str]:
        """The rank fetched from the nearest remote tier holding it: (manifest, tier, source node).
        Restores of a rank that is being fetched wait for that fetch and share its outcome."""
        key = (job, step, rank)
        task = self._fetching.get(key)
        if task is None:
            task = self._fetching[key] = self._spawn(self._fetch_once(job, step, rank, list(errors), job_owner))
            task.add_done_callback(lambda t: self._fetching.pop(key, None) if self._fetching.get(key) is t else None)
        man, tier, source = await asyncio.shield(task)
        if job_owner not in (None, man.job_owner):  # joined another identity's fetch of the rank
            raise NotFoundError(f"{job} step {step} rank {rank}: the copy restored was saved by another owner")
        return man, tier, source

    async def _fetch_once(self, job: str, step: int, rank: int, errors: list[str],
                          job_owner: str | None) -> tuple[Manifest, str, str]:
        # A fetched copy may be older than the newest keep_local complete steps: pin the step
        # (a reason of its own per restore) so the fetch's commit and retention soon after
        # cannot evict it before the client has mapped it; mapped files stay valid after.
        key = (job, step, rank)
        reason = f"restore-{id(asyncio.current_task()):x}-{time.monotonic_ns():x}"
        self.store.pin(job, step, reason)
        man = None
        lost: list[bool] = []
        try:
            with contextlib.ExitStack() as marks:
                for t in self.tiers:
                    marks.enter_context(t.restoring(job, step, rank))
                for t in self.tiers:
                    fetch = self._progress[key] = Fetch(step, t.name)  # each tier tried starts over
                    token = CURRENT.set(fetch)
                    try:
                        man = await t.fetch(job, step, rank, job_owner)
                    except NotFoundError:
                        continue
                    except (DataLossError, UnavailableError) as e:
                        errors.append(f"{t.name}: {e}")
                        lost.append(isinstance(e, DataLossError))
                        continue
                    finally:
                        CURRENT.reset(token)
                    return man, t.name, man.node
        finally:
            self._progress.pop(key, None)
            self._spawn(self._unpin_later(job, step, reason, KNOBS.restore_pin_seconds if man else 0.0))
        if errors:
            # data loss only when every copy tried failed verification; else the copies may come back
            cls = DataLossError if all(lost) else UnavailableError
            raise cls(f"{job} step {step} rank {rank}: every copy failed: " + "; ".join(errors))
        raise NotFoundError(f"{job} step {step} rank {rank} is not held by any tier")

    def progress(self, job: str, rank: int, step: int | None) -> Fetch | None:
        """The fetch in flight of ``rank`` of ``job`` at ``step`` (None: its newest step being fetched)."""
        if step is not None:
            return self._progress.get((job, step, rank))
        steps = [s for (j, s, r) in self._progress if j == job and r == rank]
        return self._progress[(job, max(steps), rank)] if steps else None

    async def _unpin_later(self, job: str, step: int, reason: str, delay: float) -> None:
        await asyncio.sleep(delay if self._accepting() else 0)
        await run_blocking(self.store.unpin, job, step, reason)
