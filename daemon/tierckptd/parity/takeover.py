"""Drain take-over under parity: the rank of a lost owner reconstructed, then drained.

Under ``replicas:R`` a replica holder drains a lost owner's selected rank from its full copy
(:mod:`tierckptd.persistent.takeover`). Under parity no node holds a full copy, so a protector
first rebuilds one: every ``KNOBS.takeover_check_interval`` each node looks at the ranks it
protects (the owners' manifests kept with its slots or rows, O(what it protects)); for a selected
rank whose owner has been down for ``KNOBS.takeover_grace`` seconds, the first live member of the
owner's parity group after the owner on the ring (every other member of a group protects a
chunk, XOR, or a row, Reed-Solomon, of each of its ranks, so each knows the rank) asks the
persistent tier for the rank's manifest; when it is missing (or an older save), it reconstructs
the rank (the restore path: :meth:`.rebuild.Rebuilder.fetch`, XOR for M = 1, Reed-Solomon
decode for M >= 2; every shard checked against the owner's manifest before the copy is
committed) into its local store. The copy arrives like a replica (``notify_ingested``), so the
replica take-over (:class:`~tierckptd.persistent.takeover.TakeOver`) sees a selected copy of a
lost owner held here with no other live holder, and drains it under the owner's object names:
its bookkeeping (the persistent tier's ledger, the check of the remote manifest, nothing done
while the owner is up) applies unchanged, so an owner that comes back first drains the rank
itself, and one that comes back later finds its manifest in place (identical objects).

Only the first live member acts, so a rank is reconstructed once per cluster view; a member
whose view differs may reconstruct it too, and both uploads write identical objects. A member
that lost its parity (replaced) and is first in line does not know the rank: it is not
reconstructed until the owner's group is whole again (its parity re-protected) or the owner is
back. What failed is tried again on the next pass (``takeover_check_interval``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tierckpt.errors import DataLossError, NotFoundError, TierckptError

from ..cluster.ring import first_after
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..persistent.selection import selected
from ..persistent.takeover import watch_owners

__all__ = ["ParityTakeOver"]

log = logging.getLogger(__name__)


class ParityTakeOver:
    """Reconstructs the selected ranks of lost owners that this node is first in line for.

    Args:
        parity: the node's :class:`.facade.Parity` (its stores, group rule and rebuilder).
        persistent: returns the persistent tier, or None when there is none (nothing is taken over).
    """

    def __init__(self, parity: Any, persistent: Callable[[], Any]) -> None:
        self.parity = parity
        self.persistent = persistent
        self.done: dict[tuple[str, int, int], str] = {}  # key -> generation reconstructed or found drained

    def protected(self) -> dict[tuple[str, int, int], Manifest]:
        """The newest save of every other owner's rank protected here (key -> its manifest)."""
        out: dict[tuple[str, int, int], Manifest] = {}
        for text in self.parity.pstore.manifests():
            try:
                man = Manifest.from_json(text)
            except TierckptError:
                continue  # refused (and logged) when it arrived
            old = out.get(man.key)
            if man.node != self.parity.node_id and (old is None or man.created > old.created):
                out[man.key] = man
        return out

    def first_in_line(self, owner: str) -> bool:
        """Whether this node is the first live member of ``owner``'s group after it on the ring."""
        cluster = self.parity.cluster
        live = [n for n in self.parity.group_of(owner) if n != owner and (n == self.parity.node_id
                                                                           or cluster.is_up(n))]
        return bool(live) and first_after(owner, live) == self.parity.node_id

    async def watch(self) -> None:
        """Every ``KNOBS.takeover_check_interval`` seconds (a task)."""
        await watch_owners(self.check, "parity take-over: checking the owners of protected ranks failed")

    def due(self, every: Callable[[str], int]) -> list[Manifest]:
        """The protected ranks this node should reconstruct now (before asking the persistent tier)."""
        cluster, store = self.parity.cluster, self.parity.store
        out, prot = [], self.protected()
        self.done = {k: g for k, g in self.done.items() if k in prot}  # dropped parity: forgotten
        for key, man in prot.items():
            if self.done.get(key) == man.generation or not selected(man, every(man.job)):
                continue
            if cluster.down_for(man.node) < KNOBS.takeover_grace or not self.first_in_line(man.node):
                continue
            local = store.get(*key)
            if local is not None and local.generation == man.generation:
                self.done[key] = man.generation  # already held whole: the replica take-over drains it
                continue
            out.append(man)
        return out

    async def check(self) -> None:
        tier = self.persistent()
        if tier is None:
            return
        for man in self.due(tier.persist_every):  # one at a time: each holds k blocks per chunk
            await self._take_over(tier, man)

    async def _take_over(self, tier: Any, man: Manifest) -> None:
        try:
            remote: Manifest | None = await tier.catalog_cache.read_manifest(*man.key)
        except (NotFoundError, DataLossError):
            remote = None
        except TierckptError as err:
            log.warning("parity take-over of %s step %d rank %d postponed: %s", man.job, man.step, man.rank, err)
            return
        if remote is not None and (remote.generation == man.generation or remote.created >= man.created):
            self.done[man.key] = man.generation  # drained by its owner (or a newer save is there)
            return
        if self.parity.cluster.is_up(man.node):
            return  # back meanwhile: it drains its own rank
        log.warning("parity take-over: reconstructing %s step %d rank %d to drain it to %s: its owner %s has been "
                    "down for %.0fs and it is not in the persistent tier", man.job, man.step, man.rank, tier.url,
                    man.node, self.parity.cluster.down_for(man.node))
        try:
            local = await self.parity.rebuilder.fetch(man.job, man.step, man.rank, man.job_owner)
        except TierckptError as err:
            log.error("parity take-over of %s step %d rank %d: reconstruction failed, tried again later: %s",
                      man.job, man.step, man.rank, err)
            return
        self.done[man.key] = local.generation
        if local.generation != man.generation:
            log.warning("parity take-over of %s step %d rank %d: reconstructed generation %s, not %s", man.job,
                        man.step, man.rank, local.generation, man.generation)
