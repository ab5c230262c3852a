"""What the peer tier calls when ``redundancy = "parity:K+M"``: one object holding the parity
held here (:class:`.slots.ParityStore`), the owner side (:class:`.encoder.Encoder`), the holder
side (:class:`.protector.Protector`) and reconstruction (:class:`.rebuild.Rebuilder`); for
M >= 2 (Reed-Solomon) their ``rs*`` siblings (:class:`.rsslots.RsStore`,
:class:`.rsencoder.RsEncoder`, :class:`.rsprotector.RsProtector`, :class:`.rsrebuild.RsRebuilder`).

Semantics on the peer tier's contract: ``wait("peer")`` resolves once the parity of every chunk
of the rank is committed on its protectors; ``fetch`` reconstructs a rank no live peer holds in
full; catalogs list a rank as held by its protectors; a step evicted by retention has its
parity dropped on the protectors (``DropParity``, the whole step: retention evicts a complete
step on every node alike).

Unchanged shards (a save that links shards of its base step) share their parity with the base
step (:mod:`.share`): slots (XOR) and lanes (Reed-Solomon) take the place their members had in
the base step, and a slot or row whose every member is unchanged is hard-linked from the base
step's instead of pulled and encoded again: a step whose shards are all unchanged costs the
peer tier no network and no new parity bytes. A slot or row with one changed member is encoded
anew (all its members pulled, as for a fresh step): issue 32 item 4, bench/README.md, "Parity
instead of copies".
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from tierckpt.errors import FailedPreconditionError, InvalidArgumentError, TierckptError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..config import DaemonConfig
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..offload import run_blocking
from ..tiers import RankCopy
from . import layout, rslayout
from .encoder import Encoder
from .farside import FarDecoder
from .protector import Protector
from .rebuild import Rebuilder
from .rsencoder import RsEncoder, target
from .rsfar import RsFarDecoder
from .rsprotector import RsProtector, check_row
from .rsrebuild import RsRebuilder
from .rsslots import RsStore
from .slots import ParityStore

__all__ = ["Parity"]

log = logging.getLogger(__name__)


class Parity:
    def __init__(self, config: DaemonConfig, store: LocalStore, cluster: Membership, receiver: Any,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task], metrics: Any = None,
                 transfer: Any = None, *,
                 shape: tuple[int, int] | None = None, root: str | os.PathLike | None = None) -> None:
        """``transfer``: the peer tier's bulk transfers (rebuilds pull over the bulk channel);
        ``shape``: the (K, M) of this code (default: the daemon's ``redundancy``); ``root``: the
        directory its parity is kept under (default: the local dir; :mod:`.shapes` gives the codes
        that jobs chose a directory of their own)."""
        shape = shape or config.parity
        assert shape is not None
        k, m = shape
        root = store.root if root is None else root
        self.k, self.m, self.size = k, m, k + m
        self.node_id, self.store, self.cluster, self._spawn = config.node_id, store, cluster, spawn
        self.receiver = receiver
        fsync = config.fsync == "always"
        self.pstore: Any
        self.encoder: Any
        self.protector: Any
        self.rebuilder: Any
        self.far: FarDecoder
        if m == 1:
            self.pstore = ParityStore(root, fsync=fsync)
            self.encoder = Encoder(self.node_id, store, cluster, self.size, metrics)
            self.protector = Protector(self.node_id, store, self.pstore, cluster, self.size, metrics)
            if receiver is not None:
                self.protector.restoring = receiver.restoring
            self.rebuilder = Rebuilder(self.node_id, store, cluster, self.size, receiver, self.protector, metrics,
                                      transfer)
            self.far = FarDecoder(self.node_id, self.protector, self.rebuilder.pulls, metrics)
        else:
            self.pstore = RsStore(root, fsync=fsync)
            self.encoder = RsEncoder(self.node_id, store, cluster, self.size, metrics, k=k, m=m)
            self.protector = RsProtector(self.node_id, store, self.pstore, cluster, k, m, metrics)
            if receiver is not None:
                self.protector.restoring = receiver.restoring
            self.rebuilder = RsRebuilder(self.node_id, store, cluster, self.size, receiver, self.protector, metrics,
                                        transfer)
            self.far = RsFarDecoder(self.node_id, self.protector, self.rebuilder.pulls, metrics, self.rebuilder)

    def group(self) -> list[str]:
        return self.group_of(self.node_id)

    def group_of(self, node: str) -> list[str]:
        """The parity group of ``node`` (its protectors and the members it protects)."""
        if self.m > 1:
            return rslayout.group(node, self.cluster.ids(), self.k, self.m)
        return layout.group_of(node, self.cluster.ids(), self.size)

    async def start(self) -> None:
        await run_blocking(self.pstore.open)
        log.info("peer tier: parity over group %s (K=%d, M=%d%s), %d parity bytes held", ",".join(self.group()),
                 self.k, self.m, "" if self.m == 1 else f", Reed-Solomon on {self.protector.codec(self.k).impl.name}",
                 self.pstore.nbytes())

    # ------------------------------------------------------------------------------ the holder's RPCs

    async def protect(self, req: ppb.ProtectRankRequest) -> ppb.ProtectRankResponse:
        if self.m == 1:
            if req.row or req.lane:
                raise InvalidArgumentError(f"row/lane: node {self.node_id} uses XOR parity (parity:{self.k}+1)")
            return await self.protector.protect(req.sender, req.manifest_json, req.chunk, req.chunks)
        return await self.protector.protect(req.sender, req.manifest_json, req.chunk, req.chunks, req.row, req.lane)

    def read_row(self, req: ppb.ReadParityRowRequest) -> Any:
        self._check_row_request(req)
        return self.protector.read_row(req.job, req.step, req.stripe, req.lane, req.row)

    async def open_rebuilt_chunk(self, req: ppb.RebuildChunkRequest) -> ppb.OpenSlotReadResponse:
        """Decode a chunk here for a restoring node and issue a bulk ticket (:mod:`.farside`; Reed-Solomon:
        :mod:`.rsfar`)."""
        return await self.far.open(req, self.receiver)

    async def open_row_read(self, req: ppb.ReadParityRowRequest) -> ppb.OpenSlotReadResponse:
        self._check_row_request(req)
        return await self.protector.open_row_read(req, self.receiver)

    def _check_row_request(self, req: ppb.ReadParityRowRequest) -> None:
        if self.m == 1:
            raise FailedPreconditionError(f"redundancy: node {self.node_id} uses XOR parity: it keeps no rows")
        check_row(req.row, self.m)
        rslayout.check_lane(req.lane, 1)
        if req.stripe >= 2 * self.size:
            raise InvalidArgumentError(f"stripe: {req.stripe} is not a stripe of a group of at most "
                                       f"{2 * self.size} nodes")

    # ------------------------------------------------------------------------------ owner side

    def on_commit(self, man: Manifest) -> None:
        if man.node == self.node_id:
            self.encoder.ensure(man)

    def catch_up(self) -> None:
        self.encoder.catch_up()

    async def audit(self) -> None:
        """Ask this node's protectors what they hold of its jobs (O(jobs x K) calls) and protect
        again what one of them lost."""
        prot = self.encoder.holder_nodes()
        for job in self.store.jobs():
            if not self.encoder.wants(job):
                continue
            answers, _ = await self.cluster.fan_out("ParityLookup", ppb.ParityLookupRequest(
                requester=self.node_id, job=job, parity_k=self.k, parity_m=self.m), prot)
            held = set()
            for p, resp in answers:
                for r in resp.ranks:
                    try:
                        man = Manifest.from_json(r.manifest_json)
                    except TierckptError:
                        continue
                    if man.node == self.node_id and r.parity_rows > 1:
                        held.add((target(p.node_id, r.chunk, r.row), man.step, man.rank, man.generation, 0))
                    elif man.node == self.node_id:
                        held.add((p.node_id, man.step, man.rank, man.generation, r.chunk))
            self.encoder.reconcile(job, {p.node_id for p, _ in answers}, held)

    def on_evict(self, eviction: Eviction) -> None:
        self.encoder.forget(eviction.job, eviction.step, eviction.ranks, eviction.reason)
        if eviction.reason == "retention":
            self._spawn(self._drop_remote(eviction.job, eviction.step))

    async def _drop_remote(self, job: str, step: int) -> None:
        req = ppb.DropParityRequest(requester=self.node_id, job=job, step=step)
        _, missed = await self.cluster.fan_out("DropParity", req, self.encoder.holder_nodes())
        if missed:
            log.info("parity of %s step %d: drop not answered by %s (dropped at their own retention)", job, step,
                     ",".join(missed))

    # ------------------------------------------------------------------------------ holder side

    async def drop_local(self, job: str, step: int) -> int:
        self.protector.board.forget(lambda ident: ident[:2] == (job, step))
        return await run_blocking(self.pstore.drop, job, step)

    # ------------------------------------------------------------------------------ catalogs

    async def copies(self, job: str, nodes: set[str] | None, rank: int | None = None,
                     job_owner: str | None = None) -> dict[int, dict[int, RankCopy]]:
        """step -> rank -> copy for the ranks protected on ``nodes`` (None: every peer)."""
        try:
            found = await self.rebuilder.locate(job, None, rank, nodes)
        except TierckptError as e:
            log.info("parity lookup of %s failed: %s", job, e)
            return {}
        out: dict[int, dict[int, RankCopy]] = {}
        for holder, man, _chunk, _chunks in found:
            if job_owner not in (None, man.job_owner):
                continue
            old = out.setdefault(man.step, {}).get(man.rank)
            nodes_ = tuple(sorted(set(old.nodes if old else ()) | {holder}))
            out[man.step][man.rank] = RankCopy(man.world_size, nodes_, man.nbytes,
                                               min(old.created, man.created) if old else man.created, man.job_owner)
        return out

    def status(self) -> dict:
        pending = self.encoder.pending()
        return {"redundancy": f"parity:{self.k}+{self.m}", "parity_group": self.group(),
                "parity_bytes": self.pstore.nbytes(), "parity_pending_ranks": len(pending)}
