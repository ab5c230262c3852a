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

__all__ = ["newest_common_step", "agree_restore_step"]


def newest_common_step(per_rank: Sequence[Iterable[int]]) -> int | None:
    """The newest step present in every rank's set, or None (pure; the rule the ranks apply)."""
    sets = [set(s) for s in per_rank]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def agree_restore_step(client: Any, job: str, rank: int, *, group: Any = None) -> int | None:
    """The newest step every rank of the process group can restore (None if there is none).

    Collective: every rank of ``group`` (default: the world) must call it. Without an
    initialised torch.distributed, the answer is this rank's own newest restorable step.

    Args:
        client: a :class:`tierckpt.Client` connected to this rank's daemon.
        job: the job.
        rank: this process's rank in the checkpoint (usually ``dist.get_rank()``).
        group: a torch.distributed process group (gloo or nccl; objects travel via
            ``all_gather_object``).
    """
    steps = [a.step for a in client.availability(job, rank)]
    try:
        import torch.distributed as dist
    except ImportError:  # no torch: a single process
        return max(steps) if steps else None
    if not (dist.is_available() and dist.is_initialized()):
        return max(steps) if steps else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, steps, group=group)
    return newest_common_step(gathered)
