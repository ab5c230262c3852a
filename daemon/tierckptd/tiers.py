"""The plug-in point for background tiers (peer replication, persistent drain).

A :class:`RemoteTier` is driven by the :class:`~tierckptd.node.Node`. Call order:

0. ``bind(host)`` once, when the node is built: the tier keeps ``host`` to announce copies it
   committed into the local store (``host.notify_ingested(manifest)``).
   ``add_to_server(server)`` once, before the gRPC server starts (a tier that serves an RPC
   service of its own registers it here; the default registers nothing).
1. ``start()`` once, after the local store is open.
2. ``commit_pin(job, step, persist)`` just before a local save commits (a pin reason or None);
   ``on_commit(manifest)`` after every local commit (including copies ingested from other
   tiers, flagged by ``ingested=True``); it must not block: schedule background work and return.
   ``on_evict(eviction)`` after local retention or capacity evicted a step (on the event loop).
3. Concurrently: ``catalog(job)`` (what this tier holds; ``catalog_with_gaps`` also names the
   sources that did not answer), ``rank_catalog(job, rank)`` (one rank, cheaply), ``fetch(job, step, rank)`` (bring a
   rank into the local store, verifying checksums), ``wait(job, step, rank, timeout)`` (until a
   committed rank reached this tier), ``status()``.
4. ``stop(timeout)`` once, on shutdown: finish or persist in-flight work within the timeout.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .manifest import Manifest
from .store import Eviction

__all__ = ["RemoteTier", "RankCopy", "TierHost"]


@dataclass(frozen=True)
class RankCopy:
    """Where one committed rank of a step is held in a tier."""

    world_size: int
    nodes: tuple[str, ...] = ()  # node ids (peer tier) or empty (persistent)
    nbytes: int = 0
    created: float = 0.0


class TierHost(Protocol):
    """What a tier may call back on the node that drives it."""

    def notify_ingested(self, manifest: Manifest) -> None:
        """A tier committed a copy into the local store (a replica, a fetch, a download)."""


class _NoHost:
    def notify_ingested(self, manifest: Manifest) -> None:
        pass


class RemoteTier(abc.ABC):
    """A tier beyond the local one. ``name`` is "peer" or "persistent"."""

    name: str = ""
    host: TierHost = _NoHost()

    def bind(self, host: TierHost) -> None:
        """Called once by the node that drives this tier."""
        self.host = host

    def add_to_server(self, server: Any) -> None:
        """Register this tier's own gRPC services on the daemon's TCP server (default: none)."""

    async def start(self) -> None:
        """Begin background work (connect, resume queues)."""

    def commit_pin(self, job: str, step: int, persist: bool) -> str | None:
        """A pin reason if a save of (job, step) must be kept from retention until this tier has
        taken it; the store pins it atomically with the commit. Called before ``on_commit``."""
        return None

    def on_begin(self, job: str, rank: int, sizes: Sequence[int]) -> None:
        """A local save of (job, rank) with these shard sizes began (its bytes do not exist yet).
        Non-blocking; a hint that must never fail the save."""

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        """A rank was committed locally. Non-blocking."""

    def on_evict(self, eviction: Eviction) -> None:
        """Local retention or capacity evicted a step. Non-blocking."""

    @abc.abstractmethod
    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        """step -> rank -> copy for the committed ranks this tier holds for ``job``."""

    async def catalog_with_gaps(self, job: str) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        """:meth:`catalog` plus the sources that did not answer in time (default: none)."""
        return await self.catalog(job), []

    async def rank_catalog(self, job: str, rank: int) -> dict[int, RankCopy]:
        """step -> copy of one rank held by this tier, as cheaply as the tier can answer it (the
        peer tier asks only this node's ring neighbourhood). Default: filter :meth:`catalog`."""
        return {step: ranks[rank] for step, ranks in (await self.catalog(job)).items() if rank in ranks}

    @abc.abstractmethod
    async def fetch(self, job: str, step: int, rank: int) -> Manifest:
        """Copy one rank into the local store (verified) and return its local manifest.

        Raises:
            NotFoundError: no copy exists in this tier.
            DataLossError / UnavailableError: every copy failed (each failure logged and counted).
        """

    @abc.abstractmethod
    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        """Wait until the rank is committed in this tier; returns the nodes/locations holding it.

        Raises:
            TierError: it failed after retries (the message names what failed).
            DeadlineExceededError: not done within ``timeout``.
        """

    def status(self) -> dict:
        """Figures for the Status RPC and metrics."""
        return {}

    async def stop(self, timeout: float) -> None:
        """Finish or persist in-flight work within ``timeout`` seconds."""
