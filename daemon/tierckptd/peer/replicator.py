"""The owner side of the peer tier: push every committed rank to its placement.

After a local commit, :meth:`Replicator.ensure` schedules a background task per rank and returns
(``save()`` never waits for peers). Each attempt pushes the rank to every placement target still
lacking it: ``PrepareReplica`` (the target opens a staging area and issues a ticket), the shards
over the bulk channel, then ``CommitReplica`` (the target checks every checksum and publishes
the manifest last). Failed attempts are retried with exponential backoff and full jitter
(``KNOBS.replicate_retry``); a peer that stops answering is marked down, so the next attempt
places the copy on the next node of the ring. ``wait("peer")`` resolves once R live peers hold
the rank's generation, or raises :class:`TierError` naming the failed peers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import DeadlineExceededError, TierckptError, TierError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster import ring
from ..cluster.membership import Membership, PeerInfo
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.rules import retention_floor
from ..local.store import LocalStore
from .transfer import BulkClient, plan_pieces

__all__ = ["Replicator", "Pusher"]

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


def pending_ages(states: Iterable[Any]) -> list[float]:
    """Ages (seconds) of the per-rank states (``since``, ``reached``, ``event``) not yet redundant:
    replicas here, parity in :mod:`tierckptd.parity.encoder`."""
    now = time.monotonic()
    return [now - st.since for st in states if not st.reached and not st.event.is_set()]


def running_tasks(states: Iterable[Any]) -> list[asyncio.Task]:
    """The per-rank states' tasks still running (to cancel at stop)."""
    return [st.task for st in states if st.task and not st.task.done()]


@dataclass(eq=False)
class _Rep:
    """Replication state of one owned rank (one generation)."""

    man: Manifest
    since: float = field(default_factory=time.monotonic)
    acked_at: dict[str, float] = field(default_factory=dict)  # peer -> monotonic time of its ack
    failures: dict[str, str] = field(default_factory=dict)
    fail_count: collections.Counter = field(default_factory=collections.Counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    reached: bool = False
    holders: list[str] = field(default_factory=list)
    error: TierError | None = None
    attempts: int = 0
    task: asyncio.Task | None = None
    again: bool = False  # asked for while a round ran (a peer came back): one more round if it fails


class Pusher:
    """Copies one local rank to one peer (prepare, bulk put, verified commit)."""

    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, transfer: BulkClient, spawn: Spawn,
                 drops_sent: Callable[[str, str], Awaitable[None]], metrics: Any = None) -> None:
        self.node_id, self.store, self.cluster, self.transfer = node_id, store, cluster, transfer
        self._spawn, self.metrics = spawn, metrics
        self.drops_sent = drops_sent
        """Waits until the drops of the job's evicted steps asked of a peer are answered, so that
        a push never races the drop it follows (see :class:`.redundancy.Drops`)."""

    async def push(self, man: Manifest, p: PeerInfo) -> None:
        t0 = time.perf_counter()
        await self.drops_sent(p.node_id, man.job)
        # From the peer's prepare to its commit, background page work here (pool warming, the
        # reserve's refill, both kicked by the commit that started this push) waits: see
        # tierckptd.local.warm. Touching pages costs 1-2 s of CPU per GiB in a VM.
        with self.store.warm.sending():
            sent = await self._push(man, p)
        if sent is None:
            return
        elapsed = time.perf_counter() - t0
        log.info("replicated %s step %d rank %d to %s: %d bytes in %.3fs (%.2f GB/s; %d bytes linked there)",
                 man.job, man.step, man.rank, p.node_id, sent, elapsed, sent / max(elapsed, 1e-9) / 1e9,
                 man.nbytes - sent)
        if self.metrics:
            self.metrics.saves.labels(tier="peer", result="ok").inc()
            self.metrics.saved_bytes.labels(tier="peer").inc(man.nbytes)

    async def _push(self, man: Manifest, p: PeerInfo) -> int | None:
        """Prepare, transfer and commit one copy; the bytes sent (None: the peer had it already)."""
        prep = await self.cluster.call(p, "PrepareReplica", ppb.PrepareReplicaRequest(
            sender=self.node_id, manifest_json=man.to_json().decode(), skips_linked=True))
        if prep.already_committed:
            return None
        try:
            linked = set(prep.linked)  # the peer holds these bytes already (linked them): not sent
            send = [s for s in man.shards if s.name not in linked]
            files = {s.name: (functools.partial(self.store.open_shard, man, s.name), s.size) for s in send}
            pieces = plan_pieces([(s.name, s.size) for s in send])
            await self.transfer.run(p.node_id, p.host, prep.bulk_port, prep.ticket, "put", pieces, files, {},
                                    p.tls_name)
            await self.cluster.call(p, "CommitReplica",
                                    ppb.CommitReplicaRequest(ticket=prep.ticket, sender=self.node_id),
                                    KNOBS.commit_timeout)
        except BaseException:
            self._spawn(self._abort_remote(p, prep.ticket))
            raise
        return sum(s.size for s in send)

    async def push_all(self, man: Manifest, targets: list[str]) -> list[BaseException | None]:
        """Push to every target at once; one outcome (None = done) per target."""
        results = await asyncio.gather(*(self.push(man, self.cluster.peers[t]) for t in targets),
                                       return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def _abort_remote(self, p: PeerInfo, ticket: str) -> None:
        try:
            await self.cluster.call(p, "AbortReplica", ppb.AbortReplicaRequest(ticket=ticket, sender=self.node_id))
        except TierckptError as e:
            log.debug("abort of replica ticket on %s failed (its staging expires): %s", p.node_id, e)


class Replicator:
    """Replication of the ranks this node owns.

    Args:
        replicas: R, the copies wanted of every rank (:meth:`replicas_for` is the one place that
            decides it for a rank).
    """

    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, pusher: Pusher, replicas: int,
                 metrics: Any = None) -> None:
        self.node_id, self.store, self.cluster, self.pusher = node_id, store, cluster, pusher
        self.replicas = replicas
        self.per_job: Callable[[str], int] | None = None
        self.metrics = metrics
        self._reps: dict[tuple[str, int, int], _Rep] = {}
        self._sem = asyncio.Semaphore(KNOBS.max_parallel_ranks)

    def replicas_for(self, man: Manifest) -> int:
        """Peer copies wanted of ``man``'s rank: its job's ``redundancy`` policy at this node
        (:attr:`per_job`, set by the peer tier), else R."""
        return self.per_job(man.job) if self.per_job is not None else self.replicas

    # ------------------------------------------------------------------------------ scheduling

    def ensure(self, man: Manifest) -> _Rep:
        """The replication state of an owned rank, with a task checking/pushing its copies."""
        st = self._reps.get(man.key)
        if st is None or st.man.generation != man.generation:
            if st is not None and st.task and not st.task.done():
                st.task.cancel()
            st = self._reps[man.key] = _Rep(man)
        if st.task is None or st.task.done():
            if st.event.is_set() and not st.reached:  # failed before: a fresh round for new waiters
                st.event, st.error = asyncio.Event(), None
            st.fail_count.clear()
            st.task = asyncio.create_task(self._replicate(st))
        elif not st.reached:
            st.again = True
        return st

    def catch_up(self) -> None:
        """Check every owned rank in the retention window (a peer came back, or periodically)."""
        for job in self.store.jobs():
            floor = retention_floor(self.store.complete_steps(job), self.store.policies.keep_local(job))
            for step, ranks in self.store.steps(job).items():
                if step >= floor:
                    for man in ranks.values():
                        if man.node == self.node_id and self.replicas_for(man):
                            self.ensure(man)

    def forget(self, job: str, step: int, ranks: Collection[int], reason: str) -> None:
        """The ranks were evicted locally: stop replicating them; waiters get TierError."""
        for rank in ranks:
            st = self._reps.pop((job, step, rank), None)
            if st is None:
                continue
            if st.task and not st.task.done():
                st.task.cancel()
            if not st.event.is_set():
                self._finish(st, TierError(f"{job} step {step} rank {rank} was evicted ({reason}) before "
                                           f"reaching {self.replicas_for(st.man)} peers"))

    async def wait(self, man: Manifest) -> list[str]:
        """Until the rank's generation reached its copies; returns the holders. Raises TierError."""
        st = self._reps.get(man.key)
        if st is None or st.man.generation != man.generation or (st.event.is_set() and not st.reached):
            st = self.ensure(man)
        await st.event.wait()
        if st.reached:
            return list(st.holders)
        assert st.error is not None
        raise st.error

    def pending(self) -> list[float]:
        """Ages (seconds) of the ranks still short of their copies."""
        return pending_ages(self._reps.values())

    def cancel_all(self) -> list[asyncio.Task]:
        return running_tasks(self._reps.values())

    # ------------------------------------------------------------------------------ one rank

    def _finish(self, st: _Rep, error: TierError | None) -> None:
        if error is None:
            st.reached = True
            if self.metrics:
                self.metrics.replication_latency.observe(time.monotonic() - st.since)
        else:
            st.error = error
            log.error("%s", error)
        st.event.set()

    def _holders(self, st: _Rep) -> list[str]:
        """Live peers holding this generation: per their last catalog, or acked since it."""
        return sorted(n for n, p in self.cluster.peers.items()
                      if p.up and (p.holds(st.man.key, st.man.generation) or st.acked_at.get(n, -2.0) > p.refreshed))

    def _targets(self, st: _Rep) -> list[str]:
        """The placement, skipping peers that failed this rank repeatedly while others can take
        the copy instead (with no alternative, a failing peer is tried again)."""
        wanted = self.replicas_for(st.man)
        up = self.cluster.up_ids()
        excluded = {n for n, c in st.fail_count.items() if c >= KNOBS.max_fails_per_peer}
        targets = ring.placement(self.node_id, self.cluster.ids(), up - excluded, wanted)
        if len(targets) < wanted:
            targets = ring.placement(self.node_id, self.cluster.ids(), up, wanted)
        return targets

    async def _replicate(self, st: _Rep) -> None:
        """Rounds of attempts until the copies are placed; a round that fails after a peer came
        back during it (``again``) is followed by one more, so a healed partition does not wait
        for the periodic catch-up."""
        while True:
            st.again = False
            await self._round(st)
            if st.reached or st.event.is_set() or not st.again or not self._still_current(st):
                break
            st.fail_count.clear()
        if not st.reached and not st.event.is_set():
            self._finish(st, TierError(self._failure_message(st)))

    async def _round(self, st: _Rep) -> None:
        retry = KNOBS.replicate_retry
        wanted = self.replicas_for(st.man)
        for attempt in range(1, retry.max_attempts + 1):
            st.attempts = attempt
            if not self._still_current(st):
                return
            targets = self._targets(st)
            missing = [t for t in targets if t not in self._holders(st)]
            if missing:
                async with self._sem:
                    outcomes = await self.pusher.push_all(st.man, missing)
                for t, err in zip(missing, outcomes):
                    if err is not None:
                        await self._push_failed(st, self.cluster.peers[t], err, attempt)
                    else:
                        st.acked_at[t] = time.monotonic()
                        st.failures.pop(t, None)
            holders = self._holders(st)
            if len(holders) >= wanted and not st.reached:
                st.holders = holders
                self._finish(st, None)
            if len(targets) >= wanted and all(t in holders for t in targets):
                return  # converged on the preferred placement
            if attempt < retry.max_attempts:
                await asyncio.sleep(retry.delay(attempt))

    def _still_current(self, st: _Rep) -> bool:
        job, step, rank = st.man.key
        cur = self.store.get(job, step, rank)
        if cur is not None and cur.generation == st.man.generation:
            return True
        if self._reps.get(st.man.key) is st:
            del self._reps[st.man.key]
        if not st.event.is_set():
            self._finish(st, TierError(f"{job} step {step} rank {rank} was evicted or re-saved "
                                       f"before reaching {self.replicas_for(st.man)} peers"))
        return False

    async def _push_failed(self, st: _Rep, p: PeerInfo, err: BaseException, attempt: int) -> None:
        if isinstance(err, asyncio.CancelledError):
            raise err
        if not isinstance(err, (TierckptError, OSError)):
            log.error("replication of %s to %s failed unexpectedly", st.man.key, p.node_id, exc_info=err)
        st.fail_count[p.node_id] += 1
        st.failures[p.node_id] = str(err)
        log.warning("replicating %s step %d rank %d to %s failed (attempt %d): %s",
                    st.man.job, st.man.step, st.man.rank, p.node_id, attempt, err)
        if self.metrics:
            self.metrics.replication_failures.labels(peer=p.node_id).inc()
            self.metrics.saves.labels(tier="peer", result="error").inc()
        if isinstance(err, (UnavailableError, DeadlineExceededError)):
            await self.cluster.refresh_peer(p)  # down for real, or a transient break?

    def _failure_message(self, st: _Rep) -> str:
        job, step, rank = st.man.key
        holders = self._holders(st)
        parts = []
        for n in ring.after(self.node_id, self.cluster.ids()):
            if n in holders:
                continue
            if n in st.failures:
                parts.append(f"{n} ({st.failures[n]})")
            elif not self.cluster.peers[n].up:
                parts.append(f"{n} (down: {self.cluster.peers[n].last_error})")
        return (f"{job} step {step} rank {rank}: {len(holders)} of {self.replicas_for(st.man)} peer copies "
                f"committed after {st.attempts} attempts; failed peers: "
                f"{', '.join(parts) or 'none (too few peers configured)'}")


