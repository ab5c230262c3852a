"""The node: domain logic behind the gRPC servicer.

It owns the local store and the remote tiers (peer, persistent), runs saves through the commit
protocol, answers catalog questions over all tiers and restores from the nearest tier. The
servicer only validates and translates; everything here raises tierckpt exceptions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

from tierckpt.common.names import check_job, check_step
from tierckpt.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    TierckptError,
)

from .fetchprogress import Fetch
from .knobs import KNOBS
from .local.manifest import Manifest
from .local.store import Eviction, LocalStore, Staging
from .local.tier import LocalTier
from .offload import run_blocking, run_owning
from .repair import LocalRepair
from .restore import NodeRestore, RestoreResult
from .tiers import RemoteTier, Tier
from .views import CatalogViews

__all__ = ["Node", "RestoreResult"]

log = logging.getLogger(__name__)



class Node:
    """Args:
        store: the opened local store.
        tiers: remote tiers in restore order (peer before persistent).
        metrics: optional :class:`tierckptd.metrics.Metrics`.
    """

    def __init__(self, store: LocalStore, tiers: Sequence[RemoteTier] = (), *, node_id: str,
                 staging_timeout: float = 600.0, metrics=None) -> None:
        self.store = store
        self.local = LocalTier(store)
        self.tiers = list(tiers)
        store.safe_elsewhere = lambda man: any(t.holds_copy(man) for t in self.tiers)
        self.node_id = node_id
        self.staging_timeout = staging_timeout
        self.metrics = metrics
        self.accepting = True
        self.started = time.time()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._reaper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        for t in self.tiers:
            t.bind(self)
        self.views = CatalogViews(store, self.tiers, node_id)
        if metrics:  # warming runs in the background: read at scrape time
            metrics.local_warm_bytes.set_function(lambda: store.usage().warm)
            metrics.local_reserve_bytes.set_function(lambda: store.usage().reserve_charged)
            metrics.local_reserve_taken_bytes.set_function(lambda: store.usage().reserve_taken)
            metrics.local_quarantined.inc(store.counters.get("quarantined", 0))  # by the start-up scan
        self.repair = LocalRepair(store, lambda: self.tier("peer"), metrics)
        self._restores = NodeRestore(store, self.tiers, self.views, self.repair, node_id=node_id, metrics=metrics,
                                     spawn=self._spawn, accepting=lambda: self.accepting)

    @property
    def fs_token(self) -> str:
        """Token of the local dir's filesystem (a client that sees the same token shares it)."""
        return self.store.fs_token

    @property
    def local_dir(self) -> str:
        return str(self.store.root)

    def tier(self, name: str) -> RemoteTier | None:
        """The remote tier called ``name``, or None when it is not configured."""
        return next((t for t in self.tiers if t.name == name), None)

    def every_tier(self) -> list[Tier]:
        """The local tier, then the remote tiers in restore order (the operator verbs loop over it)."""
        return [self.local, *self.tiers]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for t in self.tiers:
            await t.start()
        self._reaper = asyncio.create_task(self._reap_staging())
        self._update_gauges()

    async def stop(self, timeout: float) -> None:
        """Stop accepting saves, wait for in-flight commits, then stop the tiers."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.warning("shutdown: %d saves still in flight after %.0fs", self._inflight, timeout)
        for t in self.tiers:
            await t.stop(max(0.0, deadline - time.monotonic()))
        if self._reaper:
            self._reaper.cancel()
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------------- saving

    def _enter(self) -> None:
        if not self.accepting:
            raise FailedPreconditionError("daemon is shutting down; not accepting new saves")
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def begin_save(self, job: str, step: int, rank: int, world_size: int,
                         specs: Sequence[tuple[str, int, str, Sequence[int]]], stream: bool,
                         evictable: Callable[[str], bool] | None = None,
                         share: tuple[int, str, Sequence[str]] | None = None, job_owner: str = "") -> Staging:
        """Begin a save (see :meth:`.store.LocalStore.begin`); ``share``: (base_step,
        base_generation or "", unchanged shards); ``job_owner``: the caller's identity (a job
        another identity saved here is PermissionDeniedError)."""
        self._enter()
        base_step, base_gen, unchanged = share if share is not None else (None, "", ())
        try:
            st = await run_owning(self.store.begin, self.store.abort_staging, job, step, rank, world_size, specs,
                                  stream=stream, evictable=evictable, base_step=base_step, unchanged=unchanged,
                                  base_generation=base_gen or None, job_owner=job_owner)
        finally:
            self._leave()
        shared = sum(f.size for f in st.files.values() if f.shared)
        if shared and self.metrics:
            self.metrics.shared_bytes.labels(tier="local").inc(shared)
        self._update_gauges()
        sizes = [f.size for f in st.files.values()]
        for t in self.tiers:
            t.on_begin(job, rank, sizes)
        return st

    async def commit_save(self, save_id: str, digests: dict[str, str], metadata_json: str,
                          persist: bool) -> tuple[Manifest, float]:
        self._enter()
        t0 = time.perf_counter()
        try:
            st = self.store.get_staging(save_id)
            pin = next((r for r in (t.commit_pin(st.job, st.step, persist) for t in self.tiers) if r), None)
            man, _ = await run_blocking(self.store.commit, save_id, digests, metadata_json, persist=persist,
                                             pin=pin)
        except TierckptError:
            if self.metrics:
                self.metrics.saves.labels(tier="local", result="error").inc()
            raise
        finally:
            self._leave()
        elapsed = time.perf_counter() - t0
        if self.metrics:
            self.metrics.saves.labels(tier="local", result="ok").inc()
            self.metrics.saved_bytes.labels(tier="local").inc(man.nbytes)
            self.metrics.commit_latency.observe(elapsed)
            self.metrics.save_latency.observe(max(0.0, time.time() - st.begun_wall))
        self._update_gauges()
        self._committed(man, ingested=False)
        return man, elapsed

    def _committed(self, man: Manifest, *, ingested: bool) -> None:
        for t in self.tiers:
            t.on_commit(man, ingested=ingested)

    def notify_ingested(self, man: Manifest) -> None:
        """Called by a tier that committed a copy into the local store (replica, download)."""
        self._update_gauges()
        self._committed(man, ingested=True)

    def evicted(self, ev: Eviction) -> None:
        """Store callback (any thread): count it (an operator's deletion is not an eviction) and
        forward it to the tiers on the event loop."""
        if self.metrics and ev.reason != "deleted":
            self.metrics.evictions.labels(reason=ev.reason).inc()
        if self._loop is not None and not self._loop.is_closed():
            for t in self.tiers:
                self._loop.call_soon_threadsafe(t.on_evict, ev)

    async def write_stream(self, chunks: AsyncIterator[tuple[str, str, int, bytes]]) -> int:
        """Write streamed shard bytes (``(save_id, shard, offset, data)`` pieces) into staging files;
        returns the bytes written. Counts as a save in flight, so shutdown waits for it."""
        self._enter()
        fds: dict = {}
        total = 0
        try:
            async for save_id, shard, offset, data in chunks:
                await run_blocking(self.store.write_chunk, save_id, shard, offset, data, fds)
                total += len(data)
        finally:
            await run_blocking(_close_all, list(fds.values()))
            self._leave()
        return total

    async def read_shard(self, job: str, step: int, rank: int, shard: str) -> AsyncIterator[tuple[int, bytes]]:
        """Yield ``(offset, data)`` pieces of a locally committed shard (for streaming clients).

        Raises:
            NotFoundError: the rank or shard is not in the local tier, or it was evicted.
        """
        man = self.store.get(job, step, rank)
        entry = None if man is None else next((s for s in man.shards if s.name == shard), None)
        if man is None or entry is None:
            raise NotFoundError(f"{job} step {step} rank {rank} shard {shard!r} is not in the local tier "
                                "(call Restore first)")
        fd = await run_blocking(self.store.open_shard, man, entry.name)  # NotFoundError: evicted since
        try:
            offset = 0
            while offset < entry.size:
                data = await run_blocking(os.pread, fd, min(KNOBS.stream_chunk, entry.size - offset), offset)
                if not data:
                    break
                yield offset, data
                offset += len(data)
        finally:
            os.close(fd)

    async def abort_save(self, save_id: str) -> None:
        await run_blocking(self.store.abort, save_id)
        self._update_gauges()

    async def wait_tier(self, job: str, step: int, rank: int, tier: str, timeout: float | None) -> list[str]:
        check_job(job)
        check_step(step)
        if tier == "local":
            if self.store.get(job, step, rank) is None:
                raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
            return [self.node_id]
        t = self.tier(tier)
        if t is None:
            raise FailedPreconditionError(f"tier: the {tier} tier is not configured on node {self.node_id}")
        if self.store.get(job, step, rank) is None and tier == "peer":
            raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
        try:
            return await asyncio.wait_for(t.wait(job, step, rank, timeout), timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{job} step {step} rank {rank} did not reach the {tier} tier within {timeout}s"
            ) from None

    # ------------------------------------------------------------------------- catalog

    # ------------------------------------------------------------------------- restore

    async def restore(self, job: str, rank: int, step: int | None, *, local_corrupt: bool = False,
                      corrupt_generation: str = "", lend: bool = True, job_owner: str | None = None) -> RestoreResult:
        """Bring one rank into the local tier and describe it; with ``lend`` (the client maps the
        files) the answer opens a loan that the client ends with :meth:`release`; ``job_owner``:
        the caller's identity (only its copies count). See :mod:`.restore`."""
        return await self._restores.restore(job, rank, step, local_corrupt=local_corrupt,
                                            corrupt_generation=corrupt_generation, lend=lend, job_owner=job_owner)

    def restore_progress(self, job: str, rank: int, step: int | None) -> Fetch | None:
        """The fetch behind a restore of the rank in flight, or None (see :mod:`.fetchprogress`)."""
        return self._restores.progress(job, rank, step)

    async def release(self, job: str, step: int, rank: int, generation: str) -> bool:
        """A client unmapped the files of one Restore (see :meth:`.store.LocalStore.release`)."""
        return await run_blocking(self.store.release, job, step, rank, generation)

    async def repair_local(self, man: Manifest) -> bool:
        """:class:`~.tiers.TierHost`: replace a corrupt local copy of ``man``'s save with a
        verified peer copy (the drain calls it); see :meth:`.repair.LocalRepair.from_peer`."""
        return await self.repair.from_peer(man)

    # ------------------------------------------------------------------------- housekeeping

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _reap_staging(self) -> None:
        interval = max(0.05, min(10.0, self.staging_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                n = await run_blocking(self.store.reclaim_expired, self.staging_timeout)
            except Exception:  # task boundary: keep reaping after an unexpected error
                log.exception("reclaiming expired staging failed")
                continue
            if n:
                if self.metrics:
                    self.metrics.staging_reclaimed.inc(n)
                self._update_gauges()

    def _update_gauges(self) -> None:
        if not self.metrics:
            return
        u = self.store.usage()
        self.metrics.set_local_usage(u.capacity, u.charged)

    def status(self) -> dict:
        u = self.store.usage()
        jobs = []
        for job in self.store.jobs():
            steps = self.store.steps(job)
            complete = self.store.complete_steps(job)
            jobs.append({
                "job": job, "steps": len(steps), "latest": complete[-1] if complete else None,
                "bytes": sum(m.nbytes for r in steps.values() for m in r.values()),
            })
        out = {"node_id": self.node_id, "usage": u, "jobs": jobs, "uptime": time.time() - self.started}
        for t in self.tiers:
            out[t.name] = t.status()
        return out


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)

