"""Cluster-aware completeness for local retention, from the neighbourhood's cached catalogs.

:class:`.membership.Membership` rebuilds it after every refresh from the catalogs of its live
peers; the local store's retention asks :meth:`Completeness.is_complete` (through
:meth:`.membership.Membership.is_complete`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .membership import PeerInfo

__all__ = ["Completeness"]


class Completeness:
    """Which ranks of each step the live peers in view hold, and which ranks nodes in view own."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._index: dict[tuple[str, int], frozenset[int]] = {}
        self._owned: dict[str, set[int]] = {}
        self._own: dict[str, set[int]] = {}
        self._whole_view = True

    def rebuild(self, peers: Mapping[str, PeerInfo], watched: set[str]) -> bool:
        """Re-read the live ``peers``' catalogs (``watched``: the neighbourhood in view); returns
        whether completeness may have changed."""
        idx: dict[tuple[str, int], set[int]] = collections.defaultdict(set)
        owned: dict[str, set[int]] = collections.defaultdict(set)  # job -> ranks owned by nodes in view
        for p in peers.values():
            if p.up:
                for (job, step, rank), h in p.held.items():
                    idx[(job, step)].add(rank)
                    if h.owner in watched or h.owner == self.node_id:
                        owned[job].add(rank)
        new = {k: frozenset(v) for k, v in idx.items()}
        changed = new != self._index or owned != self._owned
        self._index, self._owned = new, dict(owned)
        self._whole_view = len(watched) == len(peers)
        return changed

    def is_complete(self, job: str, step: int, world_size: int, ranks: set[int]) -> bool:
        """Cluster-aware completeness for local retention.

        When this node watches every peer (small clusters): every rank is held here or by a
        live peer. At scale it sees only its neighbourhood, so a step counts as complete when
        every rank owned by a live node in view (this node's own included) is held for it: as
        complete as this node can tell. A far node that failed to save the step is not seen;
        see the README's "Retention at scale" for what that risks and how per-job retention on
        the persistent tier bounds it.
        """
        present = ranks | self._index.get((job, step), frozenset())
        if len(present) >= world_size:
            return True
        if self._whole_view:
            return False
        owned = self._owned.get(job, set()) | self._own_ranks(job)
        return bool(present) and owned <= present

    def _own_ranks(self, job: str) -> set[int]:
        return self._own.get(job, set())

    def note_own(self, job: str, rank: int) -> None:
        """A rank of ``job`` was saved on this node (its owner); completeness expects it."""
        self._own.setdefault(job, set()).add(rank)
