"""The local tier as the rest of the daemon sees it: the :class:`~tierckptd.tiers.Tier` facade.

:class:`~.store.LocalStore` owns the local dir (staging, commit, catalog, retention, capacity,
recycling, warm pages; see :mod:`.store` for the pieces) and is what the save and restore paths
call. :class:`LocalTier` adds the operator verbs that every tier answers (delete, verify) over
that store and holds no rule or state of its own, so the node and the peer tier's service (a
peer asking this node to delete or re-hash its copies) reach the local dir through one door.
"""

from __future__ import annotations

import functools

from ..offload import run_blocking
from ..tiers import Deleted, Tier, Verified
from .rehash import verify_local
from .store import LocalStore

__all__ = ["LocalTier"]


class LocalTier(Tier):
    """Args:
        store: the opened local store (shared with the save and restore paths).
    """

    name = "local"

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    async def delete(self, job: str, step: int, job_owner: str | None = None, *,
                     reason: str = "deleted on request") -> Deleted:
        """Remove every rank of the step held here (:meth:`.store.LocalStore.remove_step`); with
        ``job_owner``, only the ranks that identity saved."""
        return Deleted(copies=await run_blocking(self.store.remove_step, job, step, reason, job_owner))

    async def verify(self, job: str, step: int | None) -> Verified:
        return Verified(await run_blocking(functools.partial(verify_local, self.store, job, step)))
