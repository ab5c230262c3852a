"""Data management behind the operator verbs: per-job policy, delete, verify, persist a step.

- Policy (SetJobPolicy, GetJobPolicy, a CommitSave carrying one): :mod:`.policies`, per node.
- Delete (``tierckpt rm``): the persistent tier first (every rank's manifest, then the data),
  then every peer's copies (Peer.DeleteStepCopies, ``KNOBS.fanout`` at a time within
  ``KNOBS.fanout_deadline``), then this node's ranks (each rank's manifest before its data). No
  tier is left showing the step complete with ranks whose data is gone. Under mTLS any holder of
  a cluster certificate may ask a node to delete (SECURITY.md: peers are trusted alike).
- Verify (``tierckpt verify``): re-hash local ranks, ask every peer to re-hash its copies
  (Peer.VerifyCopies), download and re-hash the persistent objects (:mod:`.copycheck`).
  Mismatches are counted in ``checksum_failures``.
- Persist (``tierckpt persist``): queue the ranks of a step that this node owns into the drain
  queue like selected ones; ranks owned by other nodes are drained by running it there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierckpt.common.names import check_job, check_step
from tierckpt.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
)

from .backends import BackendError
from .copycheck import MISMATCH, Check, verify_local, verify_persistent
from .offload import run_blocking
from .policies import JobPolicy

if TYPE_CHECKING:
    from .node import Node

__all__ = ["DataManagement", "DeleteCounts", "remove_step"]

TIERS = ("local", "peer", "persistent")


@dataclass
class DeleteCounts:
    local: int = 0
    peer: int = 0
    persistent: int = 0
    persistent_objects: int = 0
    unreachable: list[str] = field(default_factory=list)


def remove_step(store: Any, job: str, step: int, reason: str) -> int:
    """Remove every rank of ``job`` step ``step`` held in the local store (blocking)."""
    ranks = store.steps(job).get(step, {})
    return sum(1 for rank in sorted(ranks) if store.remove_rank(job, step, rank, reason))


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

    # ----------------------------------------------------------------------------- fan-out

    def _cluster(self) -> Any:
        peer = self.node.tier("peer")
        return getattr(peer, "cluster", None)

    async def _fan_out(self, method: str, request: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """Call ``method`` on every known peer (bounded, within the fan-out deadline); returns
        (answers by node, nodes that did not answer)."""
        cluster = self._cluster()
        if cluster is None:
            return [], []
        answers, missed = await cluster.fan_out(method, request)
        return [(p.node_id, res) for p, res in answers], missed

    # ----------------------------------------------------------------------------- delete

    async def delete_step(self, job: str, step: int, tiers: set[str]) -> DeleteCounts:
        """Delete ``job`` step ``step`` from ``tiers`` (persistent, then peers, then local).

        Raises:
            FailedPreconditionError: only the persistent tier was asked and none is configured.
            UnavailableError: the object store failed (manifests may already be gone).
        """
        from tierckpt.v1 import peer_pb2 as ppb

        check_job(job)
        check_step(step)
        out = DeleteCounts()
        pt: Any = self.node.tier("persistent")
        if "persistent" in tiers and pt is not None:
            try:
                out.persistent, out.persistent_objects = await pt.drainer.retention.delete_step(job, step)
            except BackendError as e:
                raise UnavailableError(f"persistent tier {pt.url}: {e}") from e
        elif tiers == {"persistent"}:
            raise FailedPreconditionError(f"tier: no persistent tier is configured on node {self.node.node_id}")
        if "peer" in tiers:
            req = ppb.DeleteStepCopiesRequest(requester=self.node.node_id, job=job, step=step)
            answers, out.unreachable = await self._fan_out("DeleteStepCopies", req)
            out.peer = sum(r.removed for _, r in answers)
        if "local" in tiers:
            out.local = await run_blocking(remove_step, self.store, job, step, "deleted on request")
        self.node._update_gauges()
        return out

    # ----------------------------------------------------------------------------- verify

    async def verify(self, job: str, step: int | None) -> tuple[list[Check], list[str]]:
        """Re-hash every copy of ``job`` (or one step) in every tier; returns (checks, unreachable)."""
        from tierckpt.v1 import peer_pb2 as ppb

        check_job(job)
        if step is not None:
            check_step(step)
        checks = await run_blocking(verify_local, self.store, job, step)
        req = ppb.VerifyCopiesRequest(requester=self.node.node_id, job=job, has_step=step is not None,
                                      step=step or 0)
        answers, unreachable = await self._fan_out("VerifyCopies", req)
        states = {1: "ok", 2: "mismatch", 3: "missing"}
        for node, resp in answers:
            checks += [Check(c.step, c.rank, "peer", node, states.get(c.state, "missing"), c.detail)
                       for c in resp.copies]
        pt: Any = self.node.tier("persistent")
        if pt is not None:
            try:
                checks += await verify_persistent(pt, self.store, job, step)
            except (BackendError, UnavailableError) as e:
                unreachable.append(f"persistent ({e})")
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
        pt: Any = self.node.tier("persistent")
        if pt is None:
            raise FailedPreconditionError(f"tier: no persistent tier is configured on node {self.node.node_id}")
        owned = [m for _, m in sorted(self.store.steps(job).get(step, {}).items()) if m.node == self.node.node_id]
        if not owned:
            raise NotFoundError(f"{job} step {step}: node {self.node.node_id} owns no committed rank of it "
                                "(run `tierckpt persist` on the node that saved the ranks)")
        for man in owned:
            pt.drainer.force(man)
        if not wait:
            return [m.rank for m in owned], []
        try:
            await asyncio.wait_for(asyncio.gather(*(pt.wait(job, step, m.rank, timeout) for m in owned)), timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"{job} step {step} did not reach the persistent tier within "
                                        f"{timeout}s") from None
        return [m.rank for m in owned], [m.rank for m in owned]
