"""Warm-page hints for a peer's first copy of a rank (WarmReplica).

A replica's first round writes into pages its receiver must allocate: on tmpfs, 0.3-0.45 s per
GiB on the benchmark machines, about as long as the transfer itself. The sizes of the coming copy
are known as soon as the owner's trainer begins the save, seconds before its bytes exist. So when
a save of an owned rank begins, the owner tells each peer of the rank's placement that has not
had a copy of it from this owner yet; the peer allocates pool files of those sizes in free
capacity, at the lowest CPU priority (:meth:`tierckptd.local.warm.WarmPages.expect`), while the
trainer is still copying. The copy then takes those files like recycled ones.

From the second round on, a receiver recycles the files of the copy it evicts, so the owner
sends a hint once per (peer, job, rank) and process (the receiver also ignores a hint for a rank
it already holds a step of). A hint is never allowed to fail or delay a save: it is sent in the
background, with a short deadline, and every error is only logged (a peer of an older version
answers UNIMPLEMENTED).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tierckpt.errors import TierckptError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster import ring
from ..cluster.membership import Membership
from ..knobs import KNOBS

__all__ = ["WarmHints"]

log = logging.getLogger(__name__)

_REMEMBERED = 4096
"""(peer, job, rank) triples remembered as hinted; the oldest are forgotten first (a forgotten
one is hinted again, which the receiver ignores if it holds the rank)."""


class WarmHints:
    """The owner's side: which peers to hint, once each."""

    def __init__(self, node_id: str, cluster: Membership, replicas: int,
                 spawn: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.node_id, self.cluster, self.replicas, self._spawn = node_id, cluster, replicas, spawn
        self._sent: collections.OrderedDict[tuple[str, str, int], None] = collections.OrderedDict()
        self.sent = 0  # hints sent (for tests and status)

    def on_begin(self, job: str, rank: int, sizes: Sequence[int]) -> None:
        """A save of an owned rank began: hint the placement peers not hinted yet for it."""
        if self.replicas <= 0 or not sizes:
            return
        targets = ring.placement(self.node_id, self.cluster.ids(), self.cluster.up_ids(), self.replicas)
        for t in targets:
            key = (t, job, rank)
            if key in self._sent:
                continue
            self._sent[key] = None
            while len(self._sent) > _REMEMBERED:
                self._sent.popitem(last=False)
            self._spawn(self._send(t, job, rank, list(sizes)))

    async def _send(self, target: str, job: str, rank: int, sizes: list[int]) -> None:
        p = self.cluster.peers.get(target)
        if p is None:
            return
        req = ppb.WarmReplicaRequest(sender=self.node_id, job=job, rank=rank, sizes=sizes)
        try:
            resp = await self.cluster.call(p, "WarmReplica", req, KNOBS.warm_hint_timeout)
        except TierckptError as e:  # a hint: the copy works without it
            log.debug("warm hint for %s rank %d to %s not taken: %s", job, rank, target, e)
            return
        self.sent += 1
        log.debug("warm hint for %s rank %d to %s: %d bytes ahead", job, rank, target, resp.bytes)
