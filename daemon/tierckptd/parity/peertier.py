"""The peer tier with parity as well as replicas: the :class:`~tierckptd.peer.tier.PeerTier`
(membership, bulk channel, full copies, restore from a peer that holds one) plus the parity codes
of :class:`.shapes.ParityShapes` on each step of the tier contract.

Every daemon with peers runs this tier: its ``redundancy`` is the default of its jobs, and a job's
policy (``redundancy = "replicas:R"`` or ``"parity:K+M"``) chooses for the ranks this node owns.
``replicas`` is 0 under a parity daemon (and for a job that chose parity), so the replicator
pushes no full copies of those ranks; a replicas daemon with no job choosing parity holds no
parity code and behaves as the plain peer tier (one lookup more per catalog and per missed fetch:
a restore cannot know whether a lost owner's job chose parity)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tierckpt.errors import DataLossError, InvalidArgumentError, NotFoundError, TierckptError, UnavailableError

from ..cluster.membership import Membership
from ..config import DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..peer.tier import PeerTier
from ..tiers import RankCopy
from .facade import Parity
from .shapes import ParityShapes
from .takeover import ParityTakeOver

__all__ = ["ParityPeerTier", "merge_copies"]

log = logging.getLogger(__name__)

Copies = dict[int, dict[int, RankCopy]]
Choice = tuple[int, tuple[int, int] | None]


class ParityPeerTier(PeerTier):
    def __init__(self, config: DaemonConfig, store: LocalStore, cluster: Membership, metrics: Any = None) -> None:
        super().__init__(config, store, cluster, metrics)
        self.parities = ParityShapes(config, store, cluster, self.receiver, self._spawn, metrics,
                                     lambda job: self.choice(job)[1], self._persistent, self.fetcher.transfer)
        self.replicator.per_job = lambda job: self.choice(job)[0]
        store.policies.check_redundancy = self.check_choice
        self._catching_up: asyncio.Task | None = None

    @property
    def parity(self) -> Parity | None:
        """The code of the daemon's own ``redundancy`` (None on a replicas daemon)."""
        return self.parities.get(self.parities.own)

    @property
    def takeover(self) -> ParityTakeOver | None:
        return self.parities.takeovers.get(self.parities.own)  # type: ignore[arg-type]

    def choice(self, job: str) -> Choice:
        """(R, None) or (0, (K, M)): the job's policy, else the daemon's ``redundancy``."""
        try:
            over = self.store.policies.redundancy(job)
        except TierckptError:
            over = None
        return over if over is not None else (self.config.replicas, self.config.parity)

    def check_choice(self, r: int, shape: tuple[int, int] | None) -> None:
        """A job's ``redundancy`` this cluster can serve (INVALID_ARGUMENT naming the field):
        ``replicas:R`` with R <= the daemons' ``replicas`` (at least 1: a peer accepts a replica
        only from an owner whose placement under its own R includes it) and R <= the peers; a
        ``parity:K+M`` group no larger than the cluster."""
        if shape is None:
            cap = min(max(1, self.config.replicas), len(self.cluster.peers))
            if r > cap:
                raise InvalidArgumentError(f"policy.redundancy: replicas:{r}: at most replicas:{cap} here (the "
                                           f"daemons' replicas = {self.config.replicas}, {len(self.cluster.peers)} "
                                           "peers)")
            return
        try:
            self.parities.check(shape, "policy.redundancy")
        except TierckptError as e:
            raise InvalidArgumentError(str(e)) from None

    async def start(self) -> None:
        await self.parities.start()
        await super().start()
        self._catching_up = asyncio.create_task(self._catch_up_loop())

    async def stop(self, timeout: float) -> None:
        if self._catching_up:
            self._catching_up.cancel()
        late = self.parities.cancel_all()
        if late:
            _, pending = await asyncio.wait(late, timeout=max(0.01, timeout / 2))
            for t in pending:
                t.cancel()
        await super().stop(timeout / 2)

    def _persistent(self) -> Any:
        """The node's persistent tier, or None (no host bound, or no persistent tier)."""
        tier = getattr(getattr(self, "host", None), "tier", None)
        return tier("persistent") if tier is not None else None

    async def _catch_up_loop(self) -> None:
        """Owned ranks whose parity is missing, or on a protector that restarted (a replaced node
        lost the parity it held): protected again; cheap when nothing changed. Every
        ``KNOBS.catch_up_interval`` the protectors are also asked what they hold (a slot dropped
        after a crash during its XOR)."""
        last_audit = time.monotonic()
        while True:
            await asyncio.sleep(KNOBS.refresh_interval)
            try:
                self.parities.catch_up()
                if time.monotonic() - last_audit > KNOBS.catch_up_interval:
                    last_audit = time.monotonic()
                    await self.parities.audit()
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep catching up
                log.exception("parity catch-up failed")

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        super().on_commit(manifest, ingested=ingested)
        self.parities.on_commit(manifest)

    def holds_copy(self, manifest: Manifest) -> bool:
        return super().holds_copy(manifest) or self.parities.protected(manifest)

    def on_evict(self, eviction: Eviction) -> None:
        super().on_evict(eviction)
        self.parities.on_evict(eviction)

    async def catalog_with_gaps(self, job: str, job_owner: str | None = None) -> tuple[Copies, list[str]]:
        merged, missed = await super().catalog_with_gaps(job, job_owner)
        return merge_copies(merged, await self.parities.copies(job, None, None, job_owner)), missed

    def near(self) -> set[str]:
        """The groups of the codes held here and the watched neighbourhood (O(groups) nodes)."""
        out = set(self.cluster.watched())
        for p in self.parities.codes():
            out |= p.rebuilder.near()
        return out - {self.node_id}

    async def rank_catalog(self, job: str, rank: int, job_owner: str | None = None) -> dict[int, RankCopy]:
        """The neighbourhood's full copies, and the ranks protected in this node's groups (O(groups))."""
        out = await super().rank_catalog(job, rank, job_owner)
        near = await self.parities.copies(job, self.near(), rank, job_owner)
        return merge_copies({0: out}, {0: {s: r[rank] for s, r in near.items() if rank in r}})[0]

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        """A full copy from a live peer of the neighbourhood if one holds it, else the rank
        reconstructed from parity (in the code its protectors say it was protected under, its
        group first), else a full copy anywhere: a lost rank costs O(neighbourhood + group) calls,
        not one per node (under parity no replica exists, so the replica path's ask-everyone
        fallback would find nothing, N - 1 calls later)."""
        try:
            return await self.fetcher.fetch(job, step, rank, job_owner, anywhere=False)
        except (NotFoundError, UnavailableError, DataLossError) as e:
            log.info("%s step %d rank %d: no full peer copy (%s); reconstructing from parity", job, step, rank, e)
            try:
                return await self.parities.fetch(job, step, rank, job_owner, otherwise=e)
            except (NotFoundError, UnavailableError, DataLossError) as e2:
                log.info("%s step %d rank %d: %s; asking every peer for a full copy", job, step, rank, e2)
                try:
                    return await super().fetch(job, step, rank, job_owner)
                except NotFoundError:
                    raise e2 from None

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        """Replicas: until R peers hold a copy; parity: until the parity of every chunk of the
        rank is committed on its protectors."""
        if self.choice(job)[1] is None:
            return await super().wait(job, step, rank, timeout)
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
        return await self.parities.wait(man)

    def status(self) -> dict:
        out = super().status()
        pending = self.parities.pending()
        out["pending_ranks"] += len(pending)
        out["lag_seconds"] = max([out["lag_seconds"], *pending])
        return {**out, **self.parities.status()}


def merge_copies(a: Copies, b: Copies) -> Copies:
    """step -> rank -> copy of both (nodes merged, the first's figures kept where both have a rank)."""
    out = {step: dict(ranks) for step, ranks in a.items()}
    for step, ranks in b.items():
        for rank, c in ranks.items():
            old = out.setdefault(step, {}).get(rank)
            nodes = tuple(sorted(set(old.nodes if old else ()) | set(c.nodes)))
            out[step][rank] = c if old is None else RankCopy(old.world_size, nodes, old.nbytes,
                                                             min(old.created, c.created), old.job_owner)
    return out
