"""Data management calls of :class:`tierckpt.Client`: per-job policy, delete, verify, persist."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .common.names import check_job, check_step
from .errors import InvalidArgumentError
from .v1 import tierckpt_pb2 as pb

__all__ = ["JobPolicy", "CopyCheck", "DeleteResult", "VerifyResult", "DataManagementMixin"]

_TIERS = {"local": pb.TIER_LOCAL, "peer": pb.TIER_PEER, "persistent": pb.TIER_PERSISTENT}
_TIER_NAMES = {v: k for k, v in _TIERS.items()}
_STATES = {pb.COPY_STATE_OK: "ok", pb.COPY_STATE_MISMATCH: "mismatch", pb.COPY_STATE_MISSING: "missing"}
_FIELDS = ("keep_local", "keep_persistent", "persist_every", "redundancy")
_REDUNDANCY_RE = re.compile(r"^(replicas:\d{1,2}|parity:\d{1,3}\+\d{1,2})$")


@dataclass(frozen=True)
class JobPolicy:
    """A job's data-management policy (DESIGN.md, Policies); ``None`` keeps the daemon's flag.

    Attributes:
        keep_local: newest complete steps kept in the local tier (>= 1).
        keep_persistent: newest complete steps kept in the persistent tier (0 = all).
        persist_every: every Nth step goes to the persistent tier (0 = none beyond ``persist=True``).
        redundancy: peer redundancy of the job's ranks on this node, ``"replicas:R"`` or
            ``"parity:K+M"`` (the daemon checks the bounds: R peers, K + M nodes in the cluster).
    """

    keep_local: int | None = None
    keep_persistent: int | None = None
    persist_every: int | None = None
    redundancy: str | None = None

    def to_pb(self) -> pb.JobPolicy:
        out: dict[str, Any] = {}
        for k in _FIELDS:
            v = getattr(self, k)
            if v is None:
                continue
            if k == "redundancy":
                if not isinstance(v, str) or not _REDUNDANCY_RE.fullmatch(v):
                    raise InvalidArgumentError(f"policy.redundancy: {v!r} must be replicas:R or parity:K+M")
                out[k] = v
                continue
            low = 1 if k == "keep_local" else 0
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 1 << 31:
                raise InvalidArgumentError(f"policy.{k}: {v!r} must be an integer >= {low}")
            out[k] = v
        return pb.JobPolicy(**out)

    @classmethod
    def from_pb(cls, p: pb.JobPolicy) -> JobPolicy:
        return cls(**{k: getattr(p, k) for k in _FIELDS if p.HasField(k)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class CopyCheck:
    step: int
    rank: int
    tier: str
    node: str
    state: str  # "ok" | "mismatch" | "missing"
    detail: str = ""


@dataclass(frozen=True)
class DeleteResult:
    local: int
    peer: int
    persistent: int
    persistent_objects: int
    unreachable: tuple[str, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    copies: tuple[CopyCheck, ...]
    mismatches: int
    unreachable: tuple[str, ...] = ()


class DataManagementMixin:
    """Methods of :class:`tierckpt.Client` (they use its ``_call`` and ``_stub``)."""

    _stub: Any

    def _call(self, method: Any, request: Any, what: str, timeout: float | None = -1.0) -> Any:
        raise NotImplementedError

    def set_job_policy(self, job: str, policy: JobPolicy | None = None, *, reset: bool = False,
                       **fields: Any) -> tuple[JobPolicy, JobPolicy]:
        """Set ``job``'s policy on this node (``policy`` or keyword fields); persisted by the
        daemon. Returns (the job's overrides, the effective policy). Idempotent.

        Raises:
            InvalidArgumentError: a field is out of range or unknown.
        """
        check_job(job)
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise InvalidArgumentError(f"policy: unknown fields {sorted(unknown)}")
        pol = (policy or JobPolicy()).__class__(**{**_as_dict(policy), **fields})
        resp = self._call(self._stub.SetJobPolicy, pb.SetJobPolicyRequest(job=job, policy=pol.to_pb(), reset=reset),
                          "SetJobPolicy")
        return JobPolicy.from_pb(resp.policy), JobPolicy.from_pb(resp.effective)

    def get_job_policy(self, job: str) -> tuple[JobPolicy, JobPolicy]:
        """(``job``'s overrides on this node, the effective policy)."""
        check_job(job)
        resp = self._call(self._stub.GetJobPolicy, pb.GetJobPolicyRequest(job=job), "GetJobPolicy")
        return JobPolicy.from_pb(resp.policy), JobPolicy.from_pb(resp.effective)

    def delete_step(self, job: str, step: int, tiers: Iterable[str] = ()) -> DeleteResult:
        """Delete one step from ``tiers`` (default all): this node's ranks, the peers' copies and
        the persistent tier (every manifest before any data). Idempotent."""
        check_job(job)
        check_step(step)
        enums = []
        for t in tiers:
            if t not in _TIERS:
                raise InvalidArgumentError(f"tier: {t!r} must be local, peer or persistent")
            enums.append(_TIERS[t])
        r = self._call(self._stub.DeleteStep, pb.DeleteStepRequest(job=job, step=step,
                                                                    tiers=pb.TierSelection(tiers=enums)), "DeleteStep")
        return DeleteResult(r.local_ranks, r.peer_ranks, r.persistent_ranks, r.persistent_objects,
                            tuple(r.unreachable))

    def verify_job(self, job: str, step: int | None = None) -> VerifyResult:
        """Re-hash every copy of ``job`` (or one step) in every tier."""
        check_job(job)
        if step is not None:
            check_step(step)
        r = self._call(self._stub.Verify, pb.VerifyRequest(job=job, has_step=step is not None, step=step or 0),
                       "Verify", timeout=None)
        return VerifyResult(tuple(CopyCheck(c.step, c.rank, _TIER_NAMES.get(c.tier, "?"), c.node,
                                            _STATES.get(c.state, "missing"), c.detail) for c in r.copies),
                            r.mismatches, tuple(r.unreachable))

    def persist_step(self, job: str, step: int, *, wait: bool = False,
                     timeout: float | None = None) -> tuple[list[int], list[int]]:
        """Drain a step that was not selected (the ranks this node owns); with ``wait``, until it
        is in the persistent tier. Returns (queued ranks, persisted ranks)."""
        check_job(job)
        check_step(step)
        req = pb.PersistStepRequest(job=job, step=step, wait=wait, timeout_seconds=timeout or 0)
        r = self._call(self._stub.PersistStep, req, "PersistStep",
                       timeout=None if (wait and timeout is None) else (timeout or 0) + 30 if wait else -1.0)
        return list(r.queued), list(r.persisted)


def _as_dict(p: JobPolicy | None) -> dict[str, Any]:
    return {} if p is None else {k: getattr(p, k) for k in _FIELDS if getattr(p, k) is not None}
