"""Restore from the peer tier: pull a rank from a live holder into the local store.

Candidates are the live holders of the rank (newest generation first, then the owner, then ring
order); each is tried in turn over the bulk channel, verifying checksums on receipt; a corrupt
or unreachable copy falls back to the next holder.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from tierckpt.common.names import check_job, check_step
from tierckpt.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
)
from tierckpt.v1 import peer_pb2 as ppb

from .. import fetchprogress
from ..cluster import ring
from ..cluster.membership import Membership, PeerInfo
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking, run_owning
from . import bulk
from .receiver import Receiver, check_digest
from .transfer import BulkClient, plan_pieces

__all__ = ["Fetcher"]

log = logging.getLogger(__name__)


class Fetcher:
    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, transfer: BulkClient,
                 receiver: Receiver, metrics: Any = None) -> None:
        self.node_id, self.store, self.cluster = node_id, store, cluster
        self.transfer, self.receiver, self.metrics = transfer, receiver, metrics

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None,
                    anywhere: bool = True) -> Manifest:
        """Copy one rank from the best live holder into the local store and return its manifest;
        with ``job_owner``, only a copy that identity saved; without ``anywhere``, only from the
        neighbourhood (O(neighbourhood) calls: the parity tier tries its group before everyone)."""
        check_job(job)
        check_step(step)
        cands = await self._candidates(job, step, rank, self.cluster.watched(), job_owner)
        if not cands and anywhere:  # not in the neighbourhood (a rank that moved to this node): ask everyone
            cands = await self._candidates(job, step, rank, None, job_owner)
        if not cands:
            raise NotFoundError(f"{job} step {step} rank {rank} is not held by any live peer")
        owner = cands[0][1].owner
        order = ring.after(owner, self.cluster.ids())
        cands.sort(key=lambda c: (-c[1].created_unix, c[0].node_id != owner,
                                  order.index(c[0].node_id) if c[0].node_id in order else len(order)))
        self.receiver.restore_begun(1)
        try:
            with self.receiver.fetching_rank((job, step, rank)):
                return await self._first_good([p for p, _ in cands], job, step, rank, job_owner)
        finally:
            self.receiver.restore_begun(-1)

    async def _candidates(self, job: str, step: int, rank: int, nodes: set[str] | None,
                          job_owner: str | None) -> list[tuple[PeerInfo, Any]]:
        answers, _ = await self.cluster.job_catalogs(job, nodes)
        return [(p, e) for p, entries in answers for e in entries
                if e.step == step and e.rank == rank and job_owner in (None, e.job_owner)]

    async def _first_good(self, peers: list[PeerInfo], job: str, step: int, rank: int,
                          job_owner: str | None) -> Manifest:
        errors: list[str] = []
        lost = False
        for p in peers:
            try:
                return await self._pull(p, job, step, rank, job_owner)
            except NotFoundError as e:
                errors.append(f"{p.node_id}: {e}")
            except DataLossError as e:
                lost = True
                errors.append(f"{p.node_id}: {e}")
                log.error("copy of %s step %d rank %d on %s is corrupt; trying the next: %s", job, step, rank,
                          p.node_id, e)
            except (UnavailableError, DeadlineExceededError, FailedPreconditionError) as e:
                errors.append(f"{p.node_id}: {e}")
                log.warning("copy of %s step %d rank %d on %s unavailable; trying the next: %s", job, step, rank,
                            p.node_id, e)
        msg = f"{job} step {step} rank {rank}: every peer copy failed: " + "; ".join(errors)
        raise DataLossError(msg) if lost else UnavailableError(msg)

    async def _pull(self, p: PeerInfo, job: str, step: int, rank: int, job_owner: str | None) -> Manifest:
        """Copy one rank from peer ``p`` into the local store, verifying every checksum."""
        t0 = time.perf_counter()
        resp = await self.cluster.call(p, "OpenRead", ppb.OpenReadRequest(requester=self.node_id, job=job, step=step,
                                                                          rank=rank))
        man = Manifest.from_json(resp.manifest_json)
        if man.key != (job, step, rank):
            raise DataLossError(f"peer {p.node_id} described {man.key} instead of {(job, step, rank)}")
        if job_owner is not None and man.job_owner != job_owner:
            raise NotFoundError(f"the copy on {p.node_id} was saved by another owner")
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        st = await run_owning(self.store.begin, self.store.abort_staging, job, step, rank, man.world_size, specs,
                              prefault=True, job_owner=man.job_owner)
        try:
            files = {n: (functools.partial(self.store.open_staged, st.save_id, n), f.size) for n, f in st.files.items()}
            hashers = {s.name: bulk.OrderedHasher(s.size) for s in man.shards}
            fetchprogress.started(man.nbytes, p.node_id, lambda: sum(h.pos for h in list(hashers.values())))
            await self.transfer.run(p.node_id, p.host, resp.bulk_port, resp.ticket, "get",
                                    plan_pieces([(s.name, s.size) for s in man.shards]), files, hashers, p.tls_name)
            for s in man.shards:
                if not hashers[s.name].complete:
                    raise UnavailableError(f"peer {p.node_id} sent {hashers[s.name].pos} of {s.size} bytes of {s.name}")
                check_digest(man, s.name, hashers[s.name].hexdigest(), f"copy on {p.node_id}", self.metrics)
            local = await self.receiver.commit_copy(st, man)
        except BaseException:
            await run_blocking(self.store.abort, st.save_id)
            raise
        elapsed = time.perf_counter() - t0
        log.info("fetched %s step %d rank %d from %s: %d bytes in %.3fs (%.2f GB/s)", job, step, rank, p.node_id,
                 man.nbytes, elapsed, man.nbytes / max(elapsed, 1e-9) / 1e9)
        self.receiver.announce(local)
        return local
