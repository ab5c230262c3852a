"""The peer tier with parity instead of replicas (``redundancy = "parity:K+1"``): the
:class:`~tierckptd.peer.tier.PeerTier` (membership, bulk channel, full-copy fetches of ranks a
peer still holds) plus :class:`.facade.Parity` on each step of the tier contract. ``replicas``
is 0 under parity, so the replicator pushes no full copies."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tierckpt.errors import DataLossError, NotFoundError, UnavailableError

from ..cluster.membership import Membership
from ..config import DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..peer.tier import PeerTier
from ..tiers import RankCopy
from .facade import Parity
from .takeover import ParityTakeOver

__all__ = ["ParityPeerTier", "merge_copies"]

log = logging.getLogger(__name__)

Copies = dict[int, dict[int, RankCopy]]


class ParityPeerTier(PeerTier):
    def __init__(self, config: DaemonConfig, store: LocalStore, cluster: Membership, metrics: Any = None) -> None:
        super().__init__(config, store, cluster, metrics)
        self.parity = Parity(config, store, cluster, self.receiver, self._spawn, metrics, self.fetcher.transfer)
        self._catching_up: asyncio.Task | None = None
        self.takeover = ParityTakeOver(self.parity, self._persistent)

    async def start(self) -> None:
        await self.parity.start()
        await super().start()
        self._catching_up = asyncio.create_task(self._catch_up_loop())
        self._spawn(self.takeover.watch())  # lost owners' selected ranks: reconstructed and drained

    async def stop(self, timeout: float) -> None:
        if self._catching_up:
            self._catching_up.cancel()
        late = self.parity.encoder.cancel_all()
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
                self.parity.catch_up()
                if time.monotonic() - last_audit > KNOBS.catch_up_interval:
                    last_audit = time.monotonic()
                    await self.parity.audit()
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep catching up
                log.exception("parity catch-up failed")

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        super().on_commit(manifest, ingested=ingested)
        self.parity.on_commit(manifest)

    def holds_copy(self, manifest: Manifest) -> bool:
        return super().holds_copy(manifest) or self.parity.encoder.protected(manifest)

    def on_evict(self, eviction: Eviction) -> None:
        super().on_evict(eviction)
        self.parity.on_evict(eviction)

    async def catalog_with_gaps(self, job: str, job_owner: str | None = None) -> tuple[Copies, list[str]]:
        merged, missed = await super().catalog_with_gaps(job, job_owner)
        return merge_copies(merged, await self.parity.copies(job, None, None, job_owner)), missed

    async def rank_catalog(self, job: str, rank: int, job_owner: str | None = None) -> dict[int, RankCopy]:
        """The neighbourhood's full copies, and the ranks protected in this node's group (O(group))."""
        out = await super().rank_catalog(job, rank, job_owner)
        near = await self.parity.copies(job, self.parity.rebuilder.near(), rank, job_owner)
        return merge_copies({0: out}, {0: {s: r[rank] for s, r in near.items() if rank in r}})[0]

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        """A full copy from a live peer if one holds it, else the rank reconstructed from parity."""
        try:
            return await super().fetch(job, step, rank, job_owner)
        except (NotFoundError, UnavailableError, DataLossError) as e:
            log.info("%s step %d rank %d: no full peer copy (%s); reconstructing from parity", job, step, rank, e)
            return await self.parity.rebuilder.fetch(job, step, rank, job_owner)

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        """Until the parity of every chunk of the rank is committed on its protectors."""
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
        return await self.parity.encoder.wait(man)

    def status(self) -> dict:
        out = super().status()
        pending = self.parity.encoder.pending()
        out["pending_ranks"] += len(pending)
        out["lag_seconds"] = max([out["lag_seconds"], *pending])
        return {**out, **self.parity.status()}


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
