"""Retention and capacity-eviction rules of the local tier, as pure functions.

This is the one home of the retention window: the local store applies it, and the peer tier
asks it which steps are still inside the window (:func:`retention_floor`). Nothing here does
I/O or takes a lock; the callers pass snapshots of their catalog.

Rules (DESIGN.md, Policies):

- Retention keeps the ``keep_local`` newest *complete* steps of a job, and every step newer than
  the oldest of them (possibly still being saved). Older steps go, complete or not (with
  cluster-wide completeness, other nodes' retention may already have made them partial), unless
  pinned (e.g. waiting to be drained, or being restored).
- Capacity may evict, oldest (by creation time) first, any step older than its job's newest
  complete step: first steps that are not pinned, then (forced, logged and counted) pinned ones.
  It never evicts a job's newest complete step nor anything newer, and a job without a complete
  step loses nothing.
- Capacity is decided before anything is evicted: a reservation that cannot fit even after
  every evictable step and the recycle pool are gone evicts nothing (:func:`plan_room`).
- Every file is charged at least :data:`MIN_CHARGE` bytes, every manifest its size (its
  metadata included) and at least :data:`MIN_CHARGE` (:func:`charge_rank`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Eviction", "retention_floor", "retention_victims", "capacity_order", "RoomPlan", "plan_room",
           "MIN_CHARGE", "charge_file", "charge_rank"]


@dataclass(frozen=True)
class Eviction:
    job: str
    step: int
    ranks: tuple[int, ...]
    reason: str  # "retention" | "capacity" | "capacity_undrained" | "replaced" | "deleted" (tierckpt rm)


def retention_floor(complete_steps: Sequence[int], keep_local: int) -> int:
    """The oldest step still inside the retention window, or -1 when every step is.

    Args:
        complete_steps: the job's complete steps, sorted ascending.
        keep_local: newest complete steps kept (>= 1).
    """
    if keep_local < 1 or len(complete_steps) < keep_local:
        return -1
    return complete_steps[-keep_local]


def retention_victims(steps: Iterable[int], complete_steps: Sequence[int], keep_local: int,
                      pinned: Collection[int] = ()) -> list[int]:
    """Steps that retention evicts, ascending: older than the floor and not pinned."""
    floor = retention_floor(complete_steps, keep_local)
    return [s for s in sorted(steps) if s < floor and s not in pinned]


def capacity_order(jobs: Mapping[str, Mapping[int, float]], newest_complete: Mapping[str, int | None],
                   pinned: Collection[tuple[str, int]], *, allow_pinned: bool) -> list[tuple[str, int]]:
    """Steps that capacity may evict, oldest first.

    Args:
        jobs: job -> step -> creation time (the oldest of its ranks).
        newest_complete: job -> its newest complete step (None: no complete step).
        pinned: (job, step) pairs that retention must keep.
        allow_pinned: include pinned steps (the forced second round).
    """
    cands: list[tuple[float, str, int]] = []
    for job, steps in jobs.items():
        newest = newest_complete.get(job)
        if newest is None:
            continue
        for step, created in steps.items():
            if step >= newest or (not allow_pinned and (job, step) in pinned):
                continue
            cands.append((created, job, step))
    return [(j, s) for _, j, s in sorted(cands)]


MIN_CHARGE = 4096
"""Every file and every manifest is charged at least this many bytes against the capacity, so
that zero-byte shards cannot fill the local dir with inodes for free."""


def charge_file(size: int) -> int:
    """Bytes one data file of ``size`` bytes is charged."""
    return max(size, MIN_CHARGE)


def charge_rank(sizes: Iterable[int], manifest_bytes: int = 0) -> int:
    """Bytes one rank (its data files and its manifest of ``manifest_bytes``) is charged."""
    return sum(charge_file(s) for s in sizes) + charge_file(manifest_bytes)
@dataclass(frozen=True)
class RoomPlan:
    """What :func:`plan_room` decided: ``fits`` and, if so, the steps to evict in order."""

    fits: bool
    evict: tuple[tuple[str, int], ...] = ()
    reclaimable: int = 0  # bytes that evicting everything evictable (and the pool) would free


def plan_room(need: int, capacity: int, used: int, recycle: int,
              candidates: Sequence[tuple[tuple[str, int], int]]) -> RoomPlan:
    """Decide, before touching anything, whether ``need`` bytes fit and which steps must go.

    The recycle pool is dropped first; then ``candidates`` ((job, step), bytes) are taken in
    order until the reservation fits. Each evicted step frees its bytes (its files may pass
    through the recycle pool, which is dropped as needed).

    Returns:
        ``RoomPlan(fits=False)`` when even evicting every candidate and the whole pool leaves too
        little room (then nothing may be evicted), else the prefix of candidates to evict.
    """
    if need > capacity:
        return RoomPlan(False)
    over = used + need - capacity
    if over <= 0:
        return RoomPlan(True)
    freed = recycle
    chosen: list[tuple[str, int]] = []
    for key, nbytes in candidates:
        if freed >= over:
            break
        chosen.append(key)
        freed += nbytes
    if freed < over:
        return RoomPlan(False, reclaimable=freed)
    return RoomPlan(True, tuple(chosen), freed)
