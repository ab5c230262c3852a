"""The owner side of parity: after a local commit, have each chunk of the rank protected.

:meth:`Encoder.ensure` schedules one background task per rank and returns (a save never waits).
The task asks each protector (:func:`.layout.protectors`) with ``ProtectRank``; the protector
pulls its chunk from this node, XORs it into a slot and commits before answering. Failed
attempts are retried with ``KNOBS.replicate_retry``. ``wait("peer")`` resolves once every
chunk's parity is committed, or raises :class:`TierError` naming the protectors that failed. A
protector that restarted since it answered (its instance changed: a replaced node lost its
parity) is asked again at the next catch-up; the request is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import TierckptError, TierError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.rules import retention_floor
from ..local.store import LocalStore
from ..peer.replicator import pending_ages, running_tasks
from . import layout

__all__ = ["Encoder"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Prot:
    man: Manifest
    holders: list[str]
    since: float = field(default_factory=time.monotonic)
    acked: dict[str, str] = field(default_factory=dict)  # holder -> its instance when it answered
    failures: dict[str, str] = field(default_factory=dict)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: TierError | None = None
    task: asyncio.Task | None = None

    @property
    def reached(self) -> bool:
        return bool(self.holders) and all(h in self.acked for h in self.holders)


class Encoder:
    """Protection of the ranks this node owns (groups of ``size`` = K + 1 nodes)."""

    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, size: int, metrics: Any = None) -> None:
        self.node_id, self.store, self.cluster, self.size, self.metrics = node_id, store, cluster, size, metrics
        self._prots: dict[tuple[str, int, int], _Prot] = {}
        self._sem = asyncio.Semaphore(KNOBS.max_parallel_ranks)
        self.shape = (size - 1, 1)  # (K, M), told to the protectors in every ProtectRank
        self.wants: Callable[[str], bool] = lambda job: True
        """Whether this code protects ``job``'s ranks (its policy may choose another K+M, or
        replicas): set by :class:`.shapes.ParityShapes`; :meth:`catch_up` skips other jobs."""

    def protectors(self) -> list[str]:
        return layout.protectors(self.node_id, self.cluster.ids(), self.size)

    def holder_nodes(self) -> set[str]:
        """The nodes holding parity of this node's ranks."""
        return set(self.protectors())

    def ensure(self, man: Manifest) -> _Prot:
        st = self._prots.get(man.key)
        if st is None or st.man.generation != man.generation:
            if st is not None and st.task and not st.task.done():
                st.task.cancel()
            st = self._prots[man.key] = _Prot(man, self.protectors())
        stale = [h for h, inst in st.acked.items()
                 if (p := self.cluster.get(self.node_of(h))) and p.instance and p.instance != inst]
        for h in stale:
            del st.acked[h]
        if (st.task is None or st.task.done()) and not st.reached:
            if st.event.is_set():  # failed before: a fresh round for new waiters
                st.event, st.error = asyncio.Event(), None
            st.task = asyncio.create_task(self._protect(st))
        return st

    @staticmethod
    def node_of(target: str) -> str:
        """The node of a protection target (here the node itself; see :class:`.rsencoder.RsEncoder`)."""
        return target

    def protected(self, man: Manifest) -> bool:
        st = self._prots.get(man.key)
        return st is not None and st.man.generation == man.generation and st.reached

    async def wait(self, man: Manifest) -> list[str]:
        st = self._prots.get(man.key)
        if st is None or st.man.generation != man.generation or (st.event.is_set() and not st.reached):
            st = self.ensure(man)
        if st.reached:
            return sorted(st.holders)
        await st.event.wait()
        if st.reached:
            return sorted(st.holders)
        assert st.error is not None
        raise st.error

    def forget(self, job: str, step: int, ranks: Any, reason: str) -> None:
        for rank in ranks:
            st = self._prots.pop((job, step, rank), None)
            if st is None:
                continue
            if st.task and not st.task.done():
                st.task.cancel()
            if not st.event.is_set():
                self._finish(st, TierError(f"{job} step {step} rank {rank} was evicted ({reason}) before its parity "
                                           "was committed"))

    def catch_up(self) -> None:
        """Every owned rank in the retention window whose parity is missing or may be lost."""
        for job in self.store.jobs():
            if not self.wants(job):
                continue
            floor = retention_floor(self.store.complete_steps(job), self.store.policies.keep_local(job))
            for step, ranks in self.store.steps(job).items():
                if step >= floor:
                    for man in ranks.values():
                        if man.node == self.node_id:
                            self.ensure(man)

    def reconcile(self, job: str, answered: set[str], held: set[tuple[str, int, int, str, int]]) -> None:
        """``held``: (protector, step, rank, generation, chunk) the ``answered`` protectors hold of
        ``job``; an own rank a protector acknowledged but no longer holds (its slot was dropped
        after a crash) is protected again."""
        for st in list(self._prots.values()):
            if st.man.job != job or st.man.node != self.node_id:
                continue
            lost = [h for h in st.acked if h in answered
                    and (h, st.man.step, st.man.rank, st.man.generation, st.holders.index(h)) not in held]
            for h in lost:
                log.warning("parity of %s step %d rank %d is no longer on %s: protecting it again", job, st.man.step,
                            st.man.rank, h)
                del st.acked[h]
            if lost:
                self.ensure(st.man)

    def pending(self) -> list[float]:
        return pending_ages(self._prots.values())

    def cancel_all(self) -> list[asyncio.Task]:
        return running_tasks(self._prots.values())

    # ------------------------------------------------------------------------------ one rank

    def _finish(self, st: _Prot, error: TierError | None) -> None:
        if error is None:
            if self.metrics:
                self.metrics.replication_latency.observe(time.monotonic() - st.since)
        else:
            st.error = error
            log.error("%s", error)
        st.event.set()

    async def _protect(self, st: _Prot) -> None:
        retry = KNOBS.replicate_retry
        man = st.man
        if not st.holders:
            self._finish(st, TierError(f"{man.job} step {man.step} rank {man.rank}: no node protects {self.node_id} "
                                       "(its parity group has no other member)"))
            return
        for attempt in range(1, retry.max_attempts + 1):
            cur = self.store.get(*man.key)
            if cur is None or cur.generation != man.generation:
                return self._finish(st, TierError(f"{man.job} step {man.step} rank {man.rank} was evicted or "
                                                  "re-saved before its parity was committed"))
            missing = [h for h in st.holders if h not in st.acked]
            async with (contextlib.nullcontext() if self._may_share(man) else self._sem):
                outcomes = await asyncio.gather(*(self._ask(man, h, st.holders.index(h), len(st.holders))
                                                  for h in missing), return_exceptions=True)
            for h, out in zip(missing, outcomes):
                if isinstance(out, asyncio.CancelledError):
                    raise out
                if isinstance(out, BaseException):
                    if not isinstance(out, (TierckptError, OSError)):
                        log.error("parity of %s on %s failed unexpectedly", man.key, h, exc_info=out)
                    st.failures[h] = str(out)
                    log.warning("parity of %s step %d rank %d on %s failed (attempt %d): %s", man.job, man.step,
                                man.rank, h, attempt, out)
                else:
                    st.acked[h] = out
                    st.failures.pop(h, None)
            if st.reached:
                return self._finish(st, None)
            if attempt < retry.max_attempts:
                await asyncio.sleep(retry.delay(attempt))
        failed = ", ".join(f"{h} ({st.failures.get(h, 'not answered')})" for h in st.holders if h not in st.acked)
        self._finish(st, TierError(f"{man.job} step {man.step} rank {man.rank}: parity committed on "
                                   f"{len(st.acked)} of {len(st.holders)} protectors; failed: {failed}"))

    def _may_share(self, man: Manifest) -> bool:
        """Whether the rank has an earlier step here: its protectors may then hold its chunks
        while the other members of their base slots claim theirs (:mod:`.share`), so it does not
        take one of the ``max_parallel_ranks`` places, or ranks waiting for each other's claims
        could hold them all (more ranks per node than places) until ``parity_share_wait``. The
        protectors still pull one chunk at a time each."""
        return any(s < man.step and man.rank in ranks for s, ranks in self.store.steps(man.job).items())

    async def _ask(self, man: Manifest, holder: str, chunk: int, chunks: int) -> str:
        """Have ``holder`` protect chunk ``chunk``; returns its instance."""
        p = self.cluster.peers[holder]
        t0 = time.perf_counter()
        resp = await self.cluster.call(p, "ProtectRank", ppb.ProtectRankRequest(
            sender=self.node_id, manifest_json=man.to_json().decode(), chunk=chunk, chunks=chunks,
            parity_k=self.shape[0], parity_m=self.shape[1]),
            max(KNOBS.commit_timeout, KNOBS.rpc_timeout))
        if not resp.already:
            log.info("parity of %s step %d rank %d chunk %d/%d committed on %s in %.3fs (slot %d bytes)", man.job,
                     man.step, man.rank, chunk, chunks, holder, time.perf_counter() - t0, resp.parity_bytes)
        return p.instance
