"""Data management behind the operator verbs: per-job policy, delete, verify, persist a step.

Every verb is a loop over the node's tiers (local, then the remote tiers in restore order), each
answering through the :class:`~tierckptd.tiers.Tier` contract; nothing here reaches into a tier.

- Policy (SetJobPolicy, GetJobPolicy, a CommitSave carrying one): :mod:`.local.policies`, per node.
- Delete (``tierckpt rm``): the farthest tier first: the persistent tier (every rank's manifest,
  then the data), then every peer's copies (Peer.DeleteStepCopies, ``KNOBS.fanout`` at a time
  within ``KNOBS.fanout_deadline``), then this node's ranks (each rank's manifest before its
  data). No tier is left showing the step complete with ranks whose data is gone. Under mTLS any
  holder of a cluster certificate may ask a node to delete (SECURITY.md: peers are trusted alike).
- Verify (``tierckpt verify``): re-hash local ranks, ask every peer to re-hash its copies
  (Peer.VerifyCopies), download and re-hash the persistent objects (:mod:`.persistent.audit`).
  Mismatches are counted in ``checksum_failures``.
- Persist (``tierckpt persist``): queue the ranks of a step that this node owns into the drain
  queue like selected ones; ranks owned by other nodes are drained by running it there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.common.names import check_job, check_step
from tierckpt.errors import DeadlineExceededError, FailedPreconditionError, NotFoundError

from .local.policies import JobPolicy
from .offload import run_blocking
from .tiers import MISMATCH, Check, Deleted

if TYPE_CHECKING:
    from .node import Node

__all__ = ["DataManagement", "DeleteCounts"]

TIERS = ("local", "peer", "persistent")


@dataclass
class DeleteCounts:
    local: int = 0
    peer: int = 0
    persistent: int = 0
    persistent_objects: int = 0
    unreachable: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, by_tier: dict[str, Deleted]) -> DeleteCounts:
        none = Deleted()
        return cls(local=by_tier.get("local", none).copies, peer=by_tier.get("peer", none).copies,
                   persistent=by_tier.get("persistent", none).copies,
                   persistent_objects=by_tier.get("persistent", none).objects,
                   unreachable=[u for d in by_tier.values() for u in d.unreachable])


class DataManagement:
    """The operator verbs of one node (see the module docstring)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.store = node.store

    # ----------------------------------------------------------------------------- policy

    async def set_policy(self, job: str, policy: JobPolicy, *, reset: bool = False) -> None:
        check_job(job)
        await run_blocking(self.store.policies.update, job, policy, reset=reset)
        await run_blocking(self.store.apply_retention, job)

    async def commit_policy(self, save_id: str, policy: JobPolicy) -> None:
        """A CommitSave carried a policy: apply it to the save's job before the commit."""
        st = self.store.get_staging(save_id)
        await run_blocking(self.store.policies.update, st.job, policy)

    # ----------------------------------------------------------------------------- delete

    async def delete_step(self, job: str, step: int, tiers: set[str], job_owner: str | None = None) -> DeleteCounts:
        """Delete ``job`` step ``step`` from ``tiers``, the farthest first (persistent, then peers,
        then local); with ``job_owner`` (the caller), only the copies that identity saved.

        Raises:
            FailedPreconditionError: only the persistent tier was asked and none is configured.
            UnavailableError: the object store failed (manifests may already be gone).
        """
        check_job(job)
        check_step(step)
        if tiers == {"persistent"} and self.node.tier("persistent") is None:
            raise FailedPreconditionError(f"tier: no persistent tier is configured on node {self.node.node_id}")
        by_tier = {}
        for t in reversed(self.node.every_tier()):
            if t.name in tiers:
                by_tier[t.name] = await t.delete(job, step, job_owner)
        self.node._update_gauges()
        return DeleteCounts.of(by_tier)

    # ----------------------------------------------------------------------------- verify

    async def verify(self, job: str, step: int | None) -> tuple[list[Check], list[str]]:
        """Re-hash every copy of ``job`` (or one step) in every tier; returns (checks, unreachable)."""
        check_job(job)
        if step is not None:
            check_step(step)
        checks: list[Check] = []
        unreachable: list[str] = []
        for t in self.node.every_tier():
            v = await t.verify(job, step)
            checks += v.checks
            unreachable += v.unreachable
        metrics = self.node.metrics
        for c in checks:
            if c.state == MISMATCH and metrics:
                metrics.checksum_failures.labels(tier=c.tier).inc()
        return checks, unreachable

    # ----------------------------------------------------------------------------- persist

    async def persist_step(self, job: str, step: int, *, wait: bool,
                           timeout: float | None) -> tuple[list[int], list[int]]:
        """Queue this node's own ranks of the step for the persistent tier; with ``wait``, wait
        until each is there. Returns (queued ranks, persisted ranks).

        Raises:
            FailedPreconditionError: no persistent tier is configured.
            NotFoundError: this node owns no committed rank of the step.
            DeadlineExceededError: ``wait`` ran out of time.
        """
        check_job(job)
        check_step(step)
        takers = [t for t in self.node.tiers if t.takes_persist]
        if not takers:
            raise FailedPreconditionError(f"tier: no persistent tier is configured on node {self.node.node_id}")
        owned = [m for _, m in sorted(self.store.steps(job).get(step, {}).items()) if m.node == self.node.node_id]
        if not owned:
            raise NotFoundError(f"{job} step {step}: node {self.node.node_id} owns no committed rank of it "
                                "(run `tierckpt persist` on the node that saved the ranks)")
        for t in takers:
            t.persist(owned)
        if not wait:
            return [m.rank for m in owned], []
        try:
            await asyncio.wait_for(asyncio.gather(*(t.wait(job, step, m.rank, timeout)
                                                    for t in takers for m in owned)), timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"{job} step {step} did not reach the persistent tier within "
                                        f"{timeout}s") from None
        return [m.rank for m in owned], [m.rank for m in owned]
