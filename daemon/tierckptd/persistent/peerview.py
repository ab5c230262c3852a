"""Transitional: a :class:`~tierckptd.cluster.ClusterView` read from the peer tier.

Until the cluster membership is built by ``main`` and handed to both remote tiers, the
persistent tier reads the peer tier's health view through this adapter (the peer tier answers
``is_up`` and ``live_holders(manifest)``; the time an owner has been seen down is measured here,
from the first question that found it down). Delete this module once ``build_tiers`` receives
the cluster view.
"""

from __future__ import annotations

import time
import types
from typing import Any

from ..cluster import Key

__all__ = ["PeerTierView"]


class PeerTierView:
    """A ClusterView over a :class:`~tierckptd.peer.PeerTier`.

    Args:
        node_id: this node.
        peer: the peer tier (``is_up(node)``, ``live_holders(manifest)``).
    """

    def __init__(self, node_id: str, peer: Any) -> None:
        self.node_id = node_id
        self._peer = peer
        self._down_since: dict[str, float] = {}

    def is_up(self, node_id: str) -> bool:
        return bool(self._peer.is_up(node_id))

    def down_for(self, node_id: str) -> float:
        now = time.monotonic()
        if self.is_up(node_id):
            self._down_since.pop(node_id, None)
            return 0.0
        return now - self._down_since.setdefault(node_id, now)

    def live_holders(self, key: Key, generation: str) -> list[str]:
        return list(self._peer.live_holders(types.SimpleNamespace(key=key, generation=generation)))
