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

The operator verbs (``tierckpt rm``, ``verify``, ``persist`` and the health probe) are on the
contract too, so :mod:`tierckptd.datamgmt` loops over tiers and never reaches into one:
``delete(job, step)`` and ``verify(job, step)`` are shared with the local tier
(:class:`Tier`); ``persist(manifests)`` queues ranks (only a tier with ``takes_persist``);
``probe()`` is called in the background by the daemon's health checks when ``needs_probe``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierckpt.errors import FailedPreconditionError

from .local.manifest import Manifest
from .local.store import Eviction

__all__ = ["Check", "Deleted", "MISMATCH", "MISSING", "OK", "RankCopy", "RemoteTier", "Tier", "TierHost",
           "Verified"]

OK, MISMATCH, MISSING = "ok", "mismatch", "missing"


@dataclass(frozen=True)
class Check:
    """The outcome of re-hashing one copy of a rank (``tierckpt verify``)."""

    step: int
    rank: int
    tier: str
    node: str   # holder (local, peer) or the persistent URL
    state: str  # OK | MISMATCH | MISSING
    detail: str = ""


@dataclass
class Deleted:
    """What one tier removed of a step (``tierckpt rm``)."""

    copies: int = 0   # ranks (local, persistent: manifests) or replica copies (peer)
    objects: int = 0  # objects removed from the object store (persistent)
    unreachable: list[str] = field(default_factory=list)  # holders that did not answer


@dataclass
class Verified:
    """What one tier re-hashed of a job (``tierckpt verify``)."""

    checks: list[Check] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # holders that did not answer (named why)


@dataclass(frozen=True)
class RankCopy:
    """Where one committed rank of a step is held in a tier."""

    world_size: int
    nodes: tuple[str, ...] = ()  # node ids (peer tier) or empty (persistent)
    nbytes: int = 0
    created: float = 0.0
    job_owner: str = ""  # who saved it (Manifest.job_owner)


def owned(copies: dict[int, dict[int, RankCopy]], job_owner: str | None) -> dict[int, dict[int, RankCopy]]:
    """The copies saved by ``job_owner`` (all with None); steps left without a rank are dropped."""
    if job_owner is None:
        return copies
    out = {step: {r: c for r, c in ranks.items() if c.job_owner == job_owner} for step, ranks in copies.items()}
    return {step: ranks for step, ranks in out.items() if ranks}


class TierHost(Protocol):
    """What a tier may call back on the node that drives it."""

    def notify_ingested(self, manifest: Manifest) -> None:
        """A tier committed a copy into the local store (a replica, a fetch, a download)."""

    async def repair_local(self, manifest: Manifest) -> bool:
        """Replace a corrupt local copy of ``manifest``'s save with a verified copy from another
        tier; True when the local tier holds a verified copy of the same save afterwards."""


class _NoHost:
    def notify_ingested(self, manifest: Manifest) -> None:
        pass

    async def repair_local(self, manifest: Manifest) -> bool:
        return False


class Tier(abc.ABC):
    """What every tier answers to the operator verbs. ``name`` is "local", "peer" or "persistent"."""

    name: str = ""

    @abc.abstractmethod
    async def delete(self, job: str, step: int, job_owner: str | None = None) -> Deleted:
        """Remove every copy of ``job`` step ``step`` this tier holds (each rank's manifest before
        its data, so no reader sees the step complete with data gone); with ``job_owner``, only
        the copies that identity saved (a tier holding the job for another owner refuses).

        Raises:
            UnavailableError: the tier's storage failed (some manifests may already be gone).
        """

    @abc.abstractmethod
    async def verify(self, job: str, step: int | None) -> Verified:
        """Re-hash every copy of ``job`` (or of one step) this tier holds; changes nothing stored."""


class RemoteTier(Tier):
    """A tier beyond the local one. ``name`` is "peer" or "persistent"."""

    host: TierHost = _NoHost()
    needs_probe: bool = False
    """Whether the daemon's health checks call :meth:`probe` (in the background, repeatedly)."""
    takes_persist: bool = False
    """Whether :meth:`persist` queues ranks here (``tierckpt persist``)."""

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

    def holds_copy(self, manifest: Manifest) -> bool:
        """Whether this tier holds a copy of the committed rank ``manifest`` elsewhere than the
        local store, as far as it knows now (called under the store's lock: no I/O, no waiting).
        Capacity eviction by another job's reservation takes only steps safe here."""
        return False

    def on_evict(self, eviction: Eviction) -> None:
        """Local retention or capacity evicted a step. Non-blocking."""

    def restoring(self, job: str, step: int, rank: int) -> contextlib.AbstractContextManager:
        """Held while a restore brings the rank into the local store from any tier: a tier that
        stages ranks there on its own (the peer tier's inbound replicas) holds off meanwhile."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        """step -> rank -> copy for the committed ranks this tier holds for ``job``."""

    async def catalog_with_gaps(self, job: str, job_owner: str | None = None
                                ) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        """:meth:`catalog` plus the sources that did not answer in time (default: none); with
        ``job_owner``, only the copies that identity saved."""
        return owned(await self.catalog(job), job_owner), []

    async def rank_catalog(self, job: str, rank: int, job_owner: str | None = None) -> dict[int, RankCopy]:
        """step -> copy of one rank held by this tier, as cheaply as the tier can answer it (the
        peer tier asks only this node's ring neighbourhood); with ``job_owner``, only the copies
        that identity saved. Default: filter :meth:`catalog`."""
        return {step: ranks[rank] for step, ranks in owned(await self.catalog(job), job_owner).items()
                if rank in ranks}

    @abc.abstractmethod
    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        """Copy one rank into the local store (verified) and return its local manifest; with
        ``job_owner``, only a copy that identity saved (another is NotFoundError).

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

    async def probe(self) -> None:
        """Check that the tier can do its work (credentials, reachability), once, without retries.
        Called only when ``needs_probe``.

        Raises:
            BackendError: it cannot; the message says why.
        """

    def persist(self, manifests: Sequence[Manifest]) -> None:
        """Queue these committed local ranks for this tier now, selected or not (only where
        ``takes_persist``; wait for each with :meth:`wait`).

        Raises:
            FailedPreconditionError: this tier takes no persist requests.
        """
        raise FailedPreconditionError(f"tier: the {self.name} tier takes no persist requests")
