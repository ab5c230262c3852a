"""The local store's catalog queries: the ranks, steps, jobs and owners it holds, each a snapshot
read under the store's lock.

A part of :class:`.store.LocalStore` (its base class), split out by concept like
:class:`.retain.StoreRetention`: it reads the store's catalog and owns no state of its own.
"""

from __future__ import annotations

import threading

from .index import Catalog, check_job_owner
from .manifest import Manifest

__all__ = ["StoreQueries"]


class StoreQueries:
    """What a :class:`.store.LocalStore` holds (the attributes below are the store's)."""

    _lock: threading.RLock
    _catalog: Catalog

    def get(self, job: str, step: int, rank: int) -> Manifest | None:
        with self._lock:
            return self._catalog.get(job, step, rank)

    def jobs(self) -> list[str]:
        with self._lock:
            return self._catalog.jobs()

    def job_owner(self, job: str) -> str | None:
        """The identity that owns ``job`` on this node (None: the node holds none of it)."""
        with self._lock:
            return self._catalog.owner(job)

    def check_owner(self, job: str, job_owner: str, action: str) -> None:
        """PermissionDeniedError when this node holds ``job`` for another identity (see
        :func:`.index.check_job_owner`; ``action`` names what was refused)."""
        with self._lock:
            owners = self._catalog.owners(job)
        check_job_owner(job, owners, job_owner, action)

    def steps(self, job: str) -> dict[int, dict[int, Manifest]]:
        """Snapshot: step -> rank -> manifest."""
        with self._lock:
            return self._catalog.steps(job)

    def complete_steps(self, job: str) -> list[int]:
        with self._lock:
            return self._catalog.complete(job)
