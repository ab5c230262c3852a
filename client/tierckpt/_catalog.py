"""Catalog calls of :class:`tierckpt.Client`: which steps exist, where, and the daemon's status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common.names import check_job
from .errors import InvalidArgumentError
from .v1 import tierckpt_pb2 as pb

__all__ = ["CatalogMixin", "CheckpointInfo", "RankLocation", "StepAvailability", "TIER_NAMES", "TIER_ENUM"]

TIER_NAMES = {pb.TIER_LOCAL: "local", pb.TIER_PEER: "peer", pb.TIER_PERSISTENT: "persistent"}
TIER_ENUM = {v: k for k, v in TIER_NAMES.items()}


@dataclass(frozen=True)
class RankLocation:
    rank: int
    tiers: tuple[str, ...]
    nodes: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class StepAvailability:
    """A step that one rank can restore, and from where (nearest tier first)."""

    step: int
    world_size: int
    tiers: tuple[str, ...]
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    world_size: int
    complete: bool
    tiers: tuple[str, ...]  # tiers in which every rank is held
    ranks: tuple[RankLocation, ...]
    created: float


class CatalogMixin:
    """Methods of :class:`tierckpt.Client` (they use its ``_call`` and ``_stub``)."""

    _stub: Any
    _node_id: str | None

    def _call(self, method: Any, request: Any, what: str, timeout: float | None = -1.0) -> Any:
        raise NotImplementedError

    def availability(self, job: str, rank: int) -> list[StepAvailability]:
        """Steps that ``rank`` of ``job`` can restore through this daemon, oldest first.

        The daemon answers from its local tier, its ring neighbourhood (the nodes holding its
        replicas) and the persistent catalog: a constant number of calls whatever the cluster's
        size. This is what a restarting job at scale should use: every rank asks its own daemon,
        and the ranks agree on the newest step all of them can restore through their process
        group (:func:`tierckpt.agree.newest_common_step`, used by ``tierckpt.torch`` and
        ``tierckpt.dcp``).
        """
        check_job(job)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank: {rank!r} must be a non-negative integer")
        resp = self._call(self._stub.Availability, pb.AvailabilityRequest(job=job, rank=rank), "Availability")
        return [StepAvailability(a.step, a.world_size, tuple(TIER_NAMES[t] for t in a.tiers), tuple(a.nodes))
                for a in resp.steps]

    def latest(self, job: str) -> int | None:
        """Newest step complete (every rank held) in some tier, or None.

        It asks every node of the cluster (with bounded concurrency and a deadline; nodes that do
        not answer in time are left out and logged by the daemon): right for operators
        (``tierckpt ls``/``latest``) and small clusters. A restarting job of hundreds of nodes
        should instead agree through its process group on what :meth:`availability` reports
        (``tierckpt.torch`` and ``tierckpt.dcp`` do when torch.distributed is initialised).
        """
        check_job(job)
        resp = self._call(self._stub.Latest, pb.LatestRequest(job=job), "Latest")
        return resp.step if resp.found else None

    def list(self, job: str) -> list[CheckpointInfo]:
        """Every known step of ``job``, oldest first, with where each rank is held."""
        check_job(job)
        resp = self._call(self._stub.List, pb.ListRequest(job=job), "List")
        return [
            CheckpointInfo(
                step=c.step, world_size=c.world_size, complete=c.complete,
                tiers=tuple(TIER_NAMES[t] for t in c.tiers), created=c.created_unix,
                ranks=tuple(RankLocation(r.rank, tuple(TIER_NAMES[t] for t in r.tiers), tuple(r.nodes), r.bytes)
                            for r in c.ranks),
            )
            for c in resp.checkpoints
        ]

    def status(self) -> pb.StatusResponse:
        """The daemon's status (tiers, capacity, backlog, peers) as the protobuf message."""
        resp = self._call(self._stub.Status, pb.StatusRequest(), "Status")
        self._node_id = resp.node_id
        return resp
