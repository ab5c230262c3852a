"""Keeping the right number of copies: lost owners' ranks, surplus and retired replicas.

Lost owners: when an owner has been down for ``KNOBS.owner_grace`` seconds (this node's view),
its own copy counts as gone, so its ranks in the retention window should have R + 1 copies among
the live nodes (a stand-in for the owner's copy plus R replicas): the first live holder of a
rank on the ring after the owner pushes it (the replicator's push path) to the first R + 1 live
nodes after the owner that lack it. While an owner is down (any duration), or up without the
rank (a replacement that has not restored it), garbage collection also counts R + 1 copies, so
it never drops those; once the owner holds the rank again, placement is R again and the copies
beyond it are surplus and dropped by the usual rule. Hysteresis against ping-pong: copies are
pushed only after the grace, but kept as soon as the owner is down; nothing here pushes while
the owner is up, so garbage collection and re-replication never undo each other.

Garbage: a replica is surplus once the placement holds its copies without this node, and
retired once its owner is up, no longer holds it and ``keep_local`` newer steps are complete.
Replicas also follow the owner's retention: the owner's evictions send ``DropReplicas``, and a
push of the same job to that peer waits for the answer (the copy then recycles the dropped files).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from tierckpt.errors import DeadlineExceededError, TierckptError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster import ring
from ..cluster.membership import Membership, PeerInfo
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.rules import retention_floor
from ..local.store import Eviction, LocalStore
from ..offload import run_blocking
from .replicator import Pusher, Replicator

__all__ = ["Redundancy"]

log = logging.getLogger(__name__)

Key = tuple[str, int, int]


class Drops:
    """DropReplicas calls in flight, by (peer, job): a push of the job to that peer waits for them
    (:meth:`sent`), so the peer's copy of the next step takes the evicted step's files from its
    recycle pool (pages already in use) instead of new memory."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, str], set[asyncio.Task]] = {}  # (peer, job) -> DropReplicas in flight

    def track(self, peer: str, job: str, task: asyncio.Task) -> None:
        key = (peer, job)
        self._tasks.setdefault(key, set()).add(task)
        task.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        tasks = self._tasks.get(key)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[key]

    async def sent(self, peer: str, job: str) -> None:
        """Until the drops of ``job``'s evicted steps already asked of ``peer`` are answered
        (bounded by ``KNOBS.rpc_timeout``; a drop that fails is garbage-collected later)."""
        tasks = self._tasks.get((peer, job))
        if tasks:
            await asyncio.wait(set(tasks), timeout=KNOBS.rpc_timeout)

    def cancel(self) -> None:
        for tasks in self._tasks.values():
            for t in tasks:
                t.cancel()


class Redundancy:
    """Re-replication of lost owners' ranks, and garbage collection of replicas held here."""

    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, replicator: Replicator,
                 pusher: Pusher, drops: Drops) -> None:
        self.node_id, self.store, self.cluster = node_id, store, cluster
        self.replicator, self.pusher = replicator, pusher
        self._sem = asyncio.Semaphore(KNOBS.max_parallel_ranks)
        self.tasks: dict[Key, asyncio.Task] = {}  # lost owners' ranks being pushed
        self._backoff: dict[Key, tuple[int, float]] = {}  # key -> (fails, not before)
        self.drops = drops

    def copies_wanted(self, man: Manifest) -> int:
        """Copies of a replica's rank wanted besides the owner's (see :func:`ring.copies_wanted`)."""
        return ring.copies_wanted(self.replicator.replicas_for(man), self.cluster.owner_holds(man.node, man.key))

    # ------------------------------------------------------------------------------ lost owners

    def restore(self) -> None:
        """Push copies of lost owners' ranks held here to live nodes lacking them (each maintenance pass)."""
        lost = {n for n in self.cluster.peers if self.cluster.down_for(n) >= KNOBS.owner_grace}
        if not lost:
            self._backoff.clear()
            return
        seen: set[Key] = set()
        for man in self._window():
            seen.add(man.key)
            if man.node in lost and man.key not in self.tasks and self.replicator.replicas_for(man):
                self._consider(man)
        for key in [k for k in self._backoff if k not in seen]:
            del self._backoff[key]

    def _window(self) -> list[Manifest]:
        """Every rank held here in its job's retention window."""
        out: list[Manifest] = []
        for job in self.store.jobs():
            floor = retention_floor(self.store.complete_steps(job), self.store.policies.keep_local(job))
            for step, ranks in self.store.steps(job).items():
                if step >= floor:
                    out.extend(ranks.values())
        return out

    def _consider(self, man: Manifest) -> None:
        fails, not_before = self._backoff.get(man.key, (0, 0.0))
        if time.monotonic() < not_before:
            return
        if self.cluster.newer_elsewhere(man.key, man.created):
            return  # a newer save of the rank lives elsewhere: its holders act
        holders = self.cluster.live_holders(man.key, man.generation)
        if ring.first_after(man.node, [self.node_id, *holders]) != self.node_id:
            return  # only the first live holder after the owner on the ring acts
        up = self.cluster.up_ids(include_self=True)
        missing = [t for t in ring.placement(man.node, self.cluster.ids(), up, self.replicator.replicas_for(man) + 1)
                   if t != self.node_id and t not in holders]
        if missing:
            self.tasks[man.key] = asyncio.create_task(self._rereplicate(man, missing, fails))

    async def _rereplicate(self, man: Manifest, targets: list[str], fails: int) -> None:
        """Push a lost owner's rank held here to ``targets``; failures back off (the retry policy's delays)."""
        try:
            log.warning("owner %s of %s step %d rank %d is down for over %.0fs: copying it to %s to restore "
                        "redundancy", man.node, man.job, man.step, man.rank, KNOBS.owner_grace, ",".join(targets))
            async with self._sem:
                outcomes = await self.pusher.push_all(man, targets)
            failed = False
            for t, err in zip(targets, outcomes):
                if isinstance(err, asyncio.CancelledError):
                    raise err
                if err is not None:
                    failed = True
                    log.warning("copying %s step %d rank %d (owner %s down) to %s failed: %s",
                                man.job, man.step, man.rank, man.node, t, err)
                    if isinstance(err, (UnavailableError, DeadlineExceededError)):
                        await self.cluster.refresh_peer(self.cluster.peers[t])
            retry = KNOBS.replicate_retry
            if failed:
                fails = min(fails + 1, retry.max_attempts)
                self._backoff[man.key] = (fails, time.monotonic() + retry.delay(fails))
            else:
                self._backoff.pop(man.key, None)
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: retried on a later pass
            log.exception("re-replication of %s failed unexpectedly", man.key)
        finally:
            self.tasks.pop(man.key, None)

    # ------------------------------------------------------------------------------ garbage

    async def collect_garbage(self) -> None:
        """Drop surplus replicas (placement holds their copies without us) and retired ones."""
        drop = [(man, why) for man in self._replicas() if (why := self._why_drop(man))]
        for man, reason in drop:
            await run_blocking(self.store.remove_rank, man.job, man.step, man.rank, reason)

    def _replicas(self) -> list[Manifest]:
        return [man for job in self.store.jobs() for ranks in self.store.steps(job).values()
                for man in ranks.values() if man.node != self.node_id]

    def _why_drop(self, man: Manifest) -> str:
        wanted = self.copies_wanted(man)
        placement = ring.placement(man.node, self.cluster.ids(), self.cluster.up_ids(include_self=True), wanted)
        confirmed = [n for n in placement if n != self.node_id and self.cluster.peers[n].holds(man.key, man.generation)]
        if self.node_id not in placement and self.replicator.replicas_for(man) and len(confirmed) >= wanted:
            return f"surplus copy: held by {','.join(confirmed)}"
        owner = self.cluster.get(man.node)
        newer = sum(1 for s in self.store.complete_steps(man.job) if s > man.step)
        keep = self.store.policies.keep_local(man.job)
        if owner is not None and owner.up and man.key not in owner.held and newer >= keep:
            return f"retired: owner {man.node} evicted it"
        return ""

    def drop_everywhere(self, ev: Eviction) -> None:
        """Replicas follow the owner's retention: ask every live peer to drop our copies of the step.

        One call per peer, in the background. A push of the same job to that peer waits for it
        first (:meth:`Drops.sent`), so the peer's copy of the next step takes the evicted step's
        files from its recycle pool (pages already in use) instead of new memory."""
        req = ppb.DropReplicasRequest(owner=self.node_id, requester=self.node_id, job=ev.job, step=ev.step,
                                      ranks=list(ev.ranks),
                                      reason=ev.reason)
        for p in self.cluster.peers.values():
            if p.up:
                self.drops.track(p.node_id, ev.job, asyncio.create_task(self._drop_on(p, req)))

    async def _drop_on(self, p: PeerInfo, req: ppb.DropReplicasRequest) -> None:
        try:
            await self.cluster.call(p, "DropReplicas", req)
        except TierckptError as e:
            log.info("could not drop replicas of %s step %d on %s (garbage-collected later): %s",
                     req.job, req.step, p.node_id, e)

    def cancel(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        self.drops.cancel()
