"""The local tier's in-memory catalog: committed ranks, their bytes, and retention pins.

Not thread-safe by itself: the local store calls it under its lock. The rules deciding what
to evict live in :mod:`tierckptd.local.rules`; this class only answers from its state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tierckpt.errors import PermissionDeniedError

from . import rules
from .links import Ino, Links
from .manifest import Manifest, ShardEntry

__all__ = ["Catalog", "CompletenessFn", "local_complete", "check_job_owner"]

CompletenessFn = Callable[[str, int, int, set[int]], bool]


def check_job_owner(job: str, owners: set[str], job_owner: str, action: str) -> None:
    """A job belongs to the identity that first saved it (DESIGN.md, trust model): raise
    PermissionDeniedError when ``owners`` (of the job's copies held or being saved here) do not
    include ``job_owner``."""
    if owners and job_owner not in owners:
        held = ", ".join(sorted(_who(o) for o in owners))
        raise PermissionDeniedError(f"job: {job!r} is owned by {held} on this node; {_who(job_owner)} may not "
                                    f"{action} it")


def _who(owner: str) -> str:
    return repr(owner) if owner else "the default tenant"


def local_complete(job: str, step: int, world_size: int, ranks: set[int]) -> bool:
    """Default completeness: every rank is held here."""
    return len(ranks) == world_size


class Catalog:
    """job -> step -> rank -> Manifest, with the committed byte count and the pins.

    Files shared with other names (see :mod:`.links`) are charged once, in ``links``; the
    manifests naming them are charged for their other files only."""

    def __init__(self, is_complete: CompletenessFn | None = None) -> None:
        self._jobs: dict[str, dict[int, dict[int, Manifest]]] = {}
        self._pins: dict[tuple[str, int], set[str]] = {}
        self.is_complete: CompletenessFn = is_complete or local_complete
        self.links = Links()
        self.committed_bytes = 0  # charged against the capacity (without the shared inodes: see links)
        self.data_bytes = 0  # bytes of shard data (likewise)

    # -- entries

    def add(self, man: Manifest, charge: int, inodes: Mapping[str, Ino] | None = None) -> Manifest | None:
        """Record a committed rank (``charge`` bytes); returns the manifest it replaced, if any.

        ``inodes``: file name -> inode of its files that other names may share (their bytes are
        charged once, to the inode)."""
        by_rank = self._jobs.setdefault(man.job, {}).setdefault(man.step, {})
        old = by_rank.get(man.rank)
        by_rank[man.rank] = man
        data = man.nbytes
        for s in man.shards:
            ino = (inodes or {}).get(s.file)
            if ino is not None:
                self.links.hold(ino, _holder(man, s), s.size)
                charge -= rules.charge_file(s.size)
                data -= s.size
        self.committed_bytes += charge
        self.data_bytes += data
        return old

    def uncharge(self, man: Manifest, charge: int) -> None:
        """Forget the bytes of a rank the caller removed (a shared file's only with its last name)."""
        data = man.nbytes
        for s in man.shards:
            h = _holder(man, s)
            if self.links.holds(h):
                charge -= rules.charge_file(s.size)
                data -= s.size
                self.links.drop(h)
        self.committed_bytes -= charge
        self.data_bytes -= data

    def share(self, man: Manifest, entry: ShardEntry, ino: Ino, holder: tuple) -> None:
        """``holder`` (an open save's file) links committed file ``entry`` of ``man``: from now on
        the inode, not the manifest, carries its bytes."""
        h = _holder(man, entry)
        if not self.links.holds(h):
            self.committed_bytes -= rules.charge_file(entry.size)
            self.data_bytes -= entry.size
            self.links.hold(ino, h, entry.size)
        self.links.hold(ino, holder, entry.size)

    def is_shared(self, man: Manifest, entry: ShardEntry) -> bool:
        """Whether the file of ``entry`` is a link shared with another step (an unchanged shard)."""
        return self.links.holds(_holder(man, entry))

    def freeable(self, man: Manifest, charge: int) -> int:
        """Bytes that removing ``man`` alone would free (files other names share stay)."""
        return charge - sum(rules.charge_file(s.size) for s in man.shards if self.links.others(_holder(man, s)))

    def get(self, job: str, step: int, rank: int) -> Manifest | None:
        return self._jobs.get(job, {}).get(step, {}).get(rank)

    def pop_rank(self, job: str, step: int, rank: int) -> Manifest | None:
        """Forget one rank (the caller uncharges its bytes); drops the step and job when empty."""
        ranks = self._jobs.get(job, {}).get(step)
        if not ranks or rank not in ranks:
            return None
        man = ranks.pop(rank)
        if not ranks:
            del self._jobs[job][step]
            if not self._jobs[job]:
                del self._jobs[job]
        return man

    def pop_step(self, job: str, step: int) -> dict[int, Manifest]:
        """Forget a whole step (the caller uncharges its bytes); drops the job when empty."""
        ranks = self._jobs.get(job, {}).pop(step, {})
        if job in self._jobs and not self._jobs[job]:
            del self._jobs[job]
        return ranks

    def has_job(self, job: str) -> bool:
        return job in self._jobs

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def steps(self, job: str) -> dict[int, dict[int, Manifest]]:
        """Snapshot: step -> rank -> manifest."""
        return {s: dict(r) for s, r in self._jobs.get(job, {}).items()}

    def owners(self, job: str) -> set[str]:
        """The job owners (manifest ``job_owner``) of the job's ranks held here: one, once a job is
        bound to the identity that first saved it."""
        return {m.job_owner for ranks in self._jobs.get(job, {}).values() for m in ranks.values()}

    def owner(self, job: str) -> str | None:
        """The job's owner here: that of its oldest rank held (None: the job is not held)."""
        mans = [m for ranks in self._jobs.get(job, {}).values() for m in ranks.values()]
        return min(mans, key=lambda m: m.created).job_owner if mans else None

    def complete(self, job: str, job_owner: str | None = None) -> list[int]:
        """The job's complete steps, ascending; with ``job_owner``, only steps saved by that owner."""
        out = []
        for step, ranks in self._jobs.get(job, {}).items():
            if job_owner is not None and any(m.job_owner != job_owner for m in ranks.values()):
                continue
            world = next(iter(ranks.values())).world_size
            if self.is_complete(job, step, world, set(ranks)):
                out.append(step)
        return sorted(out)

    # -- pins

    def pin(self, job: str, step: int, reason: str) -> None:
        self._pins.setdefault((job, step), set()).add(reason)

    def unpin(self, job: str, step: int, reason: str) -> None:
        reasons = self._pins.get((job, step))
        if reasons is not None:
            reasons.discard(reason)
            if not reasons:
                del self._pins[(job, step)]

    def pins(self, job: str, step: int) -> set[str]:
        return set(self._pins.get((job, step), ()))

    def drop_pins(self, job: str, step: int) -> None:
        self._pins.pop((job, step), None)

    # -- what the retention rules say

    def retention_victims(self, job: str, keep_local: int) -> list[int]:
        """Steps retention removes: only the job owner's steps count and go (a step another
        identity wrote never makes the owner's steps older than ``keep_local``)."""
        pinned = {s for (j, s) in self._pins if j == job}
        owner = self.owner(job)
        steps = {s: r for s, r in self._jobs.get(job, {}).items() if all(m.job_owner == owner for m in r.values())}
        return rules.retention_victims(steps, self.complete(job, owner), keep_local, pinned)

    def capacity_order(self, *, allow_pinned: bool) -> list[tuple[str, int]]:
        jobs = {job: {step: min(m.created for m in ranks.values()) for step, ranks in steps.items()}
                for job, steps in self._jobs.items()}
        newest = {job: (c[-1] if (c := self.complete(job, self.owner(job))) else None) for job in self._jobs}
        return rules.capacity_order(jobs, newest, set(self._pins), allow_pinned=allow_pinned)


def _holder(man: Manifest, entry: ShardEntry) -> tuple[str, int, int, str]:
    return (man.job, man.step, man.rank, entry.file)
