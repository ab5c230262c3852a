"""The cluster kernel: the one home of every rule about other nodes.

- :mod:`.ring`: pure placement rules (who holds copies of whose ranks, who acts for a lost owner,
  how many copies are wanted, which nodes form a node's neighbourhood).
- :mod:`.membership`: the peer set as this node sees it (discovery, health, down-since, the
  cached catalogs of the neighbourhood).
- :mod:`.completeness`: cluster-aware completeness for local retention, from those catalogs.

Both remote tiers read the cluster through :class:`ClusterView` only.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ClusterView", "Key"]

Key = tuple[str, int, int]
"""(job, step, rank)"""


class ClusterView(Protocol):
    """What a tier may ask about the cluster (implemented by :class:`.membership.Membership`)."""

    node_id: str

    def is_up(self, node_id: str) -> bool:
        """Whether ``node_id`` is a peer that answered its last health check (this node's view)."""

    def down_for(self, node_id: str) -> float:
        """Seconds ``node_id`` has been continuously seen down (0.0 while up). A node this node
        does not know counts as down from the first time it is asked about."""

    def live_holders(self, key: Key, generation: str) -> list[str]:
        """Live peers whose last known catalog lists this generation of the rank (sorted ids)."""
