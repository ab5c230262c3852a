"""Take-over: draining the selected copies of owners that are gone.

A node remembers (in memory; rebuilt from the local store at start) the selected copies it holds
of other owners' ranks. When the cluster has seen the owner down for ``KNOBS.takeover_grace``
seconds (``cluster.down_for(owner)``) and the rank's manifest is still missing from the
persistent tier (or only an older save of it is there), the first node on the ring after the
owner (:func:`~tierckptd.cluster.ring.first_after`) among this node and the live peers holding
the same generation queues the copy in its durable queue and drains it the normal way (pin,
shards, manifest last); the others keep waiting, and take over in turn if that node goes down
too. A taken-over rank is uploaded under the owner's object names (``<shard>.<generation>``, the
owner's save id) with the owner's manifest unchanged, so the objects and manifest it writes are
byte for byte those the owner writes: a recovering owner that drains the same save concurrently,
or two nodes that both decided to take over (their health views differ), only overwrite
identical objects, and neither's stale-object cleanup removes what the other's manifest names.
Selection of a copy uses this node's ``persist_every`` (the same on every node of a cluster) and
the save's ``persist`` flag. Without a cluster view (no peer tier) nothing is taken over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tierckpt.errors import DataLossError, NotFoundError, UnavailableError

from ..cluster import ClusterView
from ..cluster.ring import first_after
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from .catalog import Catalog
from .drainer import Drainer
from .ledger import Bounded, Ledger
from .selection import selected

__all__ = ["TakeOver"]

log = logging.getLogger(__name__)


class TakeOver:
    """Watches the owners of the selected copies held here and drains those of lost owners.

    Args:
        node_id: this node.
        persist_every: the selection rule's ``persist_every`` of a job (its policy).
        store: the local store.
        cluster: the cluster as this node sees it, or None (nothing is taken over).
        ledger: the in-memory state of drains (a queued copy is not watched).
        catalog: reads the store's manifests.
        drainer: queues a copy taken over.
    """

    def __init__(self, node_id: str, persist_every: Callable[[str], int], store: LocalStore,
                 cluster: ClusterView | None,
                 ledger: Ledger, catalog: Catalog, drainer: Drainer) -> None:
        self.node_id = node_id
        self.persist_every = persist_every
        self.store = store
        self.cluster = cluster
        self.ledger = ledger
        self.catalog = catalog
        self.drainer = drainer
        self.copies: Bounded = Bounded(65536)  # key -> selected copy of another owner's rank held here

    def note_copy(self, man: Manifest) -> None:
        """A copy of another owner's rank was committed here (or found at start)."""
        if man.key in self.ledger.pending:  # taken over: follow a re-save as the owner would
            self.drainer.select(man)
        elif selected(man, self.persist_every(man.job)):
            self.copies[man.key] = man
        else:
            self.copies.pop(man.key, None)

    def note_store(self) -> None:
        """Note every copy of another owner's rank in the local store (start-up)."""
        for job in self.store.jobs():
            for ranks in self.store.steps(job).values():
                for man in ranks.values():
                    if man.node != self.node_id and man.key not in self.ledger.pending:
                        self.note_copy(man)

    def on_evict(self, eviction: Eviction) -> None:
        """Evicted copies are not watched any more."""
        for rank in eviction.ranks:
            self.copies.pop((eviction.job, eviction.step, rank), None)

    async def watch(self) -> None:
        """Look at the owners every ``KNOBS.takeover_check_interval`` seconds (a task)."""
        if self.cluster is None:
            return
        await watch_owners(self.check, "persistent tier: checking the owners of held copies failed")

    def _first_holder(self, cluster: ClusterView, man: Manifest) -> bool:
        """Whether this node is the first holder of the copy after its owner on the ring."""
        holders = [n for n in (self.node_id, *cluster.live_holders(man.key, man.generation)) if n != man.node]
        return first_after(man.node, holders) == self.node_id

    async def check(self) -> None:
        """Take over the drain of the copies whose owner is lost and whose first holder is this node."""
        cluster = self.cluster
        if cluster is None:
            return
        due = []
        for key, man in list(self.copies.items()):
            if cluster.down_for(man.node) < KNOBS.takeover_grace:
                continue
            local = self.store.get(*key)
            if key in self.ledger.pending or local is None or local.generation != man.generation:
                self.copies.pop(key, None)
                continue
            if self._first_holder(cluster, man):
                due.append(man)
        if due:
            await asyncio.gather(*(self._take_over(cluster, man) for man in due))

    async def _take_over(self, cluster: ClusterView, man: Manifest) -> None:
        try:
            remote: Manifest | None = await self.catalog.read_manifest(*man.key)
        except (NotFoundError, DataLossError):  # missing, or corrupt: a fresh upload replaces it
            remote = None
        except UnavailableError as err:
            log.warning("take-over of %s step %d rank %d postponed: %s", man.job, man.step, man.rank, err)
            return
        if self.copies.get(man.key) is not man or man.key in self.ledger.pending or cluster.is_up(man.node):
            return  # changed meanwhile; looked at again on the next pass
        del self.copies[man.key]
        if remote is not None and (remote.generation == man.generation or remote.created >= man.created):
            return  # drained by its owner (or a newer save is there)
        local = self.store.get(*man.key)
        if local is None or local.generation != man.generation:
            return
        log.warning("taking over the drain of %s step %d rank %d to %s: its owner %s has been down for %.0fs "
                    "and it is not in the persistent tier", man.job, man.step, man.rank, self.catalog.url, man.node,
                    cluster.down_for(man.node))
        self.drainer.enqueue(local, time.time(), durable=True)


async def watch_owners(check: Callable[[], Awaitable[None]], failed: str) -> None:
    """Run ``check`` every ``KNOBS.takeover_check_interval`` seconds for ever (a task's body, for
    the replica and the parity take-over): a failed check is logged with ``failed`` and the next
    one still runs."""
    while True:
        await asyncio.sleep(KNOBS.takeover_check_interval)
        try:
            await check()
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: keep watching
            log.exception(failed)
