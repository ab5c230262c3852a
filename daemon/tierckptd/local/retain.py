"""The local store's retention and removal: pins, keep_local, room for a reservation, and the
removal of ranks and steps, with every eviction reported to the tiers.

A part of :class:`.store.LocalStore` (its base class), split out by concept: it works on the
store's catalog and evictor under the store's lock, and owns no state of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from .eviction import Evictor
from .index import Catalog
from .manifest import Manifest
from .policies import JobPolicies
from .rules import Eviction

__all__ = ["StoreRetention"]


class StoreRetention:
    """Retention and removal of a :class:`.store.LocalStore` (the attributes below are the store's)."""

    _lock: threading.RLock
    _catalog: Catalog
    _evictor: Evictor
    _on_evict: Callable[[Eviction], None] | None
    policies: JobPolicies
    capacity: int
    safe_elsewhere: Callable[[Manifest], bool]

    def _used_locked(self) -> int:
        raise NotImplementedError

    # ----------------------------------------------------------------------------- retention

    def pin(self, job: str, step: int, reason: str) -> None:
        """Protect a step from retention (e.g. "drain" while waiting for the persistent tier)."""
        with self._lock:
            self._catalog.pin(job, step, reason)

    def unpin(self, job: str, step: int, reason: str) -> None:
        with self._lock:
            self._catalog.unpin(job, step, reason)
            evictions = self._retain_locked(job)
        self._notify(evictions)

    def apply_retention(self, job: str) -> list[Eviction]:
        with self._lock:
            evictions = self._retain_locked(job)
        self._notify(evictions)
        return evictions

    def _retain_locked(self, job: str) -> list[Eviction]:
        return self._evictor.retain(job, self.policies.keep_local(job))

    def make_room(self, need: int, job: str = "") -> None:
        """Evict until ``need`` more bytes fit, as for a save of ``job`` (its own older steps, other
        jobs' steps safe elsewhere): the room for bytes charged through ``external_charge``
        (a parity chunk) before they are written.

        Raises:
            CapacityError: they do not fit even after every possible eviction.
        """
        with self._lock:
            self._make_room_locked(need, None, job)

    def _make_room_locked(self, need: int, evictable: Callable[[str], bool] | None = None, job: str = "") -> None:
        """Make room for a reservation of ``job`` (:meth:`.eviction.Evictor.make_room_for`)."""
        evictions = self._evictor.make_room_for(job, need, self.capacity, self._used_locked(), evictable,
                                                self.safe_elsewhere)
        if evictions:
            threading.Thread(target=self._notify, args=(evictions,), daemon=True).start()

    def remove_rank(self, job: str, step: int, rank: int, reason: str, *, generation: str | None = None) -> bool:
        """Remove one committed rank (e.g. a replica whose owner evicted the step); with
        ``generation``, only if the committed copy is still that save."""
        with self._lock:
            return self._evictor.remove_rank(job, step, rank, reason, generation=generation)

    def remove_step(self, job: str, step: int, reason: str, job_owner: str | None = None) -> int:
        """Remove every rank of ``job`` step ``step`` held here (``tierckpt rm``), each rank's
        manifest before its data (with ``job_owner``: only the ranks that identity saved); the
        tiers hear of it as an eviction with reason "deleted" (queued drains of it are
        cancelled). Returns the ranks removed."""
        with self._lock:
            ranks = tuple(r for r, m in sorted(self._catalog.steps(job).get(step, {}).items())
                          if job_owner in (None, m.job_owner) and self._evictor.remove_rank(job, step, r, reason))
        if ranks:
            self._notify([Eviction(job, step, ranks, "deleted")])
        return len(ranks)

    def _notify(self, evictions: Iterable[Eviction]) -> None:
        if self._on_evict is not None:
            for ev in evictions:
                self._on_evict(ev)
