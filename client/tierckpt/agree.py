"""Agreeing on the step a restarting job resumes from, through the job's own process group.

Each rank asks its own daemon which steps it can restore (:meth:`tierckpt.Client.availability`:
a constant number of calls per daemon, whatever the cluster's size), then the ranks exchange
their answers in one collective and take the newest step that every rank can restore. No
daemon asks every other daemon, and no home-made consensus is involved: the job's process group
is the authority on which ranks exist (as in NVIDIA's local checkpointing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, TierckptError

__all__ = ["newest_common_step", "agree_restore_step", "agreed_step", "restore_same_world"]


def newest_common_step(per_rank: Sequence[Iterable[int]]) -> int | None:
    """The newest step present in every rank's set, or None (pure; the rule the ranks apply)."""
    sets = [set(s) for s in per_rank]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def agree_restore_step(client: Any, job: str, rank: int, *, group: Any = None,
                       world_size: int | None = None) -> int | None:
    """The newest step every rank of the process group can restore (None if there is none).

    Collective: every rank of ``group`` (default: the world) must call it. Without an
    initialised torch.distributed, the answer is this rank's own newest restorable step.

    Args:
        client: a :class:`tierckpt.Client` connected to this rank's daemon.
        job: the job.
        rank: this process's rank in the checkpoint (usually ``dist.get_rank()``).
        group: a torch.distributed process group (gloo or nccl; objects travel via
            ``all_gather_object``).
        world_size: the job's world size now (rank-for-rank formats: ``tierckpt.torch``,
            ``CheckpointManager``): only steps saved with this world size count, and when the
            newest step any rank sees was saved with another one, every rank raises
            :class:`FailedPreconditionError` naming both (resuming from an older step, or from
            nothing, would silently lose progress; loading rank ``r`` of another world size
            would load the wrong shard).

    Raises:
        FailedPreconditionError: see ``world_size``.
    """
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise InvalidArgumentError(f"world_size: {world_size!r} must be a positive integer")
    try:
        import torch.distributed as dist
    except ImportError:  # no torch: a single process
        dist = None  # type: ignore[assignment]
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        seen = [(a.step, a.world_size) for a in client.availability(job, rank)]
        if world_size is None:
            return max((s for s, _ in seen), default=None)
        return agreed_step(job, [seen], world_size, alone=True)
    try:
        mine: Any = [(a.step, a.world_size) for a in client.availability(job, rank)]
    except TierckptError as e:  # every rank must reach the gather: the error travels with it
        mine = e
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for g in gathered:
        if isinstance(g, BaseException):
            raise type(g)(*g.args)
    return agreed_step(job, gathered, world_size)


def agreed_step(job: str, per_rank: Sequence[Iterable[tuple[int, int]]], world_size: int | None,
                alone: bool = False) -> int | None:
    """The rule :func:`agree_restore_step` applies to the gathered ``(step, world size)`` pairs
    (pure). ``alone``: one process decides for itself (no group): only its own answer counts."""
    sets = [set(s) for s in per_rank]
    if world_size is None:
        return newest_common_step([{s for s, _ in pairs} for pairs in sets])
    steps = newest_common_step([{s for s, w in pairs if w == world_size} for pairs in sets]) if not alone else \
        max((s for pairs in sets for s, w in pairs if w == world_size), default=None)
    other = [(s, w) for pairs in sets for s, w in pairs if w != world_size]
    if other:
        s, w = max(other)
        if steps is None or s > steps:
            raise _other_world(job, s, w, world_size)
    return steps


def restore_same_world(client: Any, job: str, rank: int, world_size: int, step: int) -> Any:
    """``client.restore(job, rank, step)`` for a rank-for-rank format: a step saved with another
    world size is refused, never loaded as if it were this rank's.

    Raises:
        FailedPreconditionError: the step was saved with another world size (both are named).
        NotFoundError: the step is not held by any tier.
    """
    try:
        ck = client.restore(job, rank, step)
    except NotFoundError:
        saved = next((a.world_size for a in client.availability(job, 0) if a.step == step), None) if rank else None
        if saved is not None and saved != world_size:
            raise _other_world(job, step, saved, world_size) from None
        raise
    if ck.world_size != world_size:
        ck.close()
        raise _other_world(job, step, ck.world_size, world_size)
    return ck


def _other_world(job: str, step: int, saved: int, current: int) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"{job} step {step} was saved with world size {saved}; this process runs with world size {current}: "
        f"a rank-for-rank checkpoint restores only at the world size it was saved with (restart with {saved} "
        f"ranks, or save with tierckpt.dcp, which reshards)")
