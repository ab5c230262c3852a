"""Repairs of the local tier: re-verify a copy reported corrupt, replace one from a peer.

Nothing here is believed without hashing: a client's report that a local copy is corrupt is
checked against the manifest's checksums before the copy is dropped, and a replacement comes
from the peer tier's fetch, which verifies every byte on receipt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tierckpt.errors import TierckptError

from .local.manifest import Manifest
from .local.rehash import corrupt_shards
from .local.store import LocalStore
from .offload import run_blocking
from .tiers import RemoteTier

__all__ = ["LocalRepair"]

log = logging.getLogger(__name__)


class LocalRepair:
    """Args:
        store: the local store.
        peer_tier: returns the peer tier (None when the node has none).
        metrics: optional metrics (``checksum_failures``).
    """

    def __init__(self, store: LocalStore, peer_tier: Callable[[], RemoteTier | None], metrics: Any = None) -> None:
        self.store = store
        self.peer_tier = peer_tier
        self.metrics = metrics

    async def drop_if_corrupt(self, man: Manifest, errors: list[str]) -> Manifest | None:
        """A client reported the local copy corrupt: re-hash it here and drop it only if it is.

        Returns:
            The local manifest to serve, or None when the copy was dropped (``errors`` says why).
        """
        job, step, rank = man.key
        bad = await run_blocking(corrupt_shards, self.store, man)
        if not bad:
            log.warning("a client reported the local copy of %s step %d rank %d corrupt, but it verifies; "
                        "keeping it (damaged in the client's memory or in transit?)", job, step, rank)
            return man
        errors.append(f"local: checksum mismatch in {', '.join(bad)}")
        log.error("local copy of %s step %d rank %d is corrupt (%s); dropping it", job, step, rank, ", ".join(bad))
        if self.metrics:
            self.metrics.checksum_failures.labels(tier="local").inc()
        removed = await run_blocking(self.store.remove_rank, job, step, rank, "checksum failure",
                                     generation=man.generation)
        return None if removed else self.store.get(job, step, rank)

    async def from_peer(self, man: Manifest) -> bool:
        """Replace the local copy of ``man``'s save with a verified copy from a peer.

        Returns:
            True when the local tier holds a verified copy of the same save afterwards.
        """
        peer = self.peer_tier()
        current = self.store.get(*man.key)
        if peer is None or current is None or current.generation != man.generation:
            return False
        try:
            fetched = await peer.fetch(*man.key)
        except TierckptError as e:
            log.error("no verified peer copy of %s step %d rank %d to repair the local one: %s",
                      man.job, man.step, man.rank, e)
            return False
        return fetched.generation == man.generation
