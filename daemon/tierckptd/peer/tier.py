"""The peer tier facade: copies of every committed rank on R other daemons, and restore from them.

Parts (one concept each): :mod:`~tierckptd.cluster.membership` (who the peers are and what they
hold), :mod:`.replicator` (push owned ranks to their placement), :mod:`.redundancy` (lost
owners, surplus and retired replicas), :mod:`.receiver` (inbound replicas, read tickets, bulk
server), :mod:`.fetcher` (restore from a holder), :mod:`.transfer` and :mod:`.bulk` (the data
channel), :mod:`.service` (the Peer gRPC service). This class wires them and runs the
maintenance loop: every ``KNOBS.refresh_interval`` it refreshes the membership, restores
redundancy, catches up owned ranks (a peer came back, or every ``catch_up_interval``), collects
garbage (every ``gc_interval``) and expires stale inbound state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import secrets
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from tierckpt.errors import NotFoundError, PermissionDeniedError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..cluster.changelog import ChangeLog
from ..cluster.membership import Membership, PeerInfo
from ..config import ConfigError, DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..local.tier import LocalTier
from ..offload import run_blocking
from ..rpc import add_service
from ..tiers import Check, Deleted, RankCopy, RemoteTier, Verified
from . import bulk
from .fetcher import Fetcher
from .guard import PeerGuard
from .hints import WarmHints
from .receiver import Receiver
from .redundancy import Drops, Redundancy
from .replicator import Pusher, Replicator
from .service import PeerServicer
from .transfer import BulkClient

__all__ = ["PeerTier"]

log = logging.getLogger(__name__)


class PeerTier(RemoteTier):
    """Replicas on peer daemons.

    Args:
        config: the daemon configuration (replicas, listen, tls_*, staging_timeout).
        store: the opened local store.
        cluster: the membership (built first, because the store's retention reads its completeness).
        metrics: optional :class:`tierckptd.metrics.Metrics`.

    Raises:
        ConfigError: no TCP listener (peers could not reach this node).
    """

    name = "peer"

    def __init__(self, config: DaemonConfig, store: LocalStore, cluster: Membership, metrics: Any = None) -> None:
        if not config.listen:
            raise ConfigError("listen: the peer tier needs a TCP listener (peers connect to it)")
        self.config, self.store, self.cluster, self.metrics = config, store, cluster, metrics
        self.node_id = config.node_id
        self.instance = secrets.token_hex(8)
        self._pool = cf.ThreadPoolExecutor(KNOBS.max_parallel_ranks * KNOBS.bulk_streams * 2,
                                           thread_name_prefix="tierckpt-peer")
        ssl_client = ssl_server = None
        self._tls_source: Any = None
        if config.tls_enabled:
            from .. import tls

            source = self._tls_source = tls.reloader(config)
            ssl_client, ssl_server = source.client_ssl_context, source.server_ssl_context()
        self._tls = ssl_client is not None
        self.guard = PeerGuard(config, cluster, config.replicas)
        self.receiver = Receiver(self.node_id, store, self._announce, config.staging_timeout, metrics,
                                 check_identity=self._check_bulk_identity if config.tls_enabled else None)
        self.local = LocalTier(store)  # what a peer's delete and verify requests reach
        self._bulk = bulk.BulkServer(config.listen.rpartition(":")[0].strip("[]"), ssl_server,
                                     self.receiver.serve_bulk, self._bulk_authenticate, self._bulk_still_valid)
        transfer = BulkClient(self._pool, ssl_client)
        drops = Drops()
        self.pusher = Pusher(self.node_id, store, cluster, transfer, self._spawn, drops.sent, metrics)
        self.replicator = Replicator(self.node_id, store, cluster, self.pusher, config.replicas, metrics)
        self.redundancy = Redundancy(self.node_id, store, cluster, self.replicator, self.pusher, drops)
        self.hints = WarmHints(self.node_id, cluster, config.replicas, self._spawn)
        self.fetcher = Fetcher(self.node_id, store, cluster, transfer, self.receiver, metrics)
        self._changes = ChangeLog(self._snapshot)
        self._maintainer: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        if config.replicas > len(cluster.peers) and not config.peers_dns:
            log.warning("replicas=%d but only %d peers are configured: wait('peer') will fail",
                        config.replicas, len(cluster.peers))

    def _check_bulk_identity(self, sock: Any, node_id: str) -> None:
        """A ticket is used only by the node it was issued to (its certificate's node id)."""
        from .. import tls

        msg = tls.check_node_role(tls.ssl_peer_role(sock), node_id, self.config)
        if msg is not None:
            raise PermissionDeniedError(f"ticket: {msg}")

    def _bulk_authenticate(self, sock: Any) -> tuple[str, int, frozenset[str]]:
        """A new bulk connection (TLS): a node certificate of a cluster member, not denied.
        Returns what :meth:`_bulk_still_valid` re-checks: (node id, TLS generation, names)."""
        from .. import tls

        node = self.guard.check_bulk(sock)
        role = tls.ssl_peer_role(sock)
        return node, self._tls_source.generation, frozenset(role.all_names if role else ())

    def _bulk_still_valid(self, info: Any) -> bool:
        """An open bulk connection stays while the TLS files are those it was authenticated under
        and its certificate is not denied (:mod:`tierckptd.revocation`)."""
        if info is None or self._tls_source is None:
            return True
        from .. import revocation

        _node, generation, names = info
        if generation != self._tls_source.generation:
            return False
        try:
            revocation.check_names(self.config, set(names))
        except PermissionDeniedError:
            return False
        return True

    def _announce(self, man: Manifest) -> None:
        self.host.notify_ingested(man)

    def add_to_server(self, server: Any) -> None:
        add_service(ppb_grpc.add_PeerServicer_to_server, PeerServicer(self), server)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        port = await run_blocking(self._bulk.start)
        self.receiver.bulk_port = port
        log.info("peer tier: bulk channel on port %d%s, %d peers configured, replicas=%d", port,
                 " (mTLS)" if self._tls else "", len(self.cluster.peers), self.config.replicas)
        self.cluster.connect_all()
        self._maintainer = asyncio.create_task(self._maintain())

    async def stop(self, timeout: float) -> None:
        if self._maintainer:
            self._maintainer.cancel()
        pending = self.replicator.cancel_all()
        if pending:
            log.info("peer tier: waiting up to %.0fs for %d replications", timeout, len(pending))
            _, late = await asyncio.wait(pending, timeout=max(0.01, timeout))
            for t in late:
                t.cancel()
            if late:
                log.warning("peer tier: %d replications unfinished at shutdown (caught up after restart)", len(late))
        for t in self._background:
            t.cancel()
        self.redundancy.cancel()
        await run_blocking(self._bulk.stop)
        self.receiver.blobs.close()
        await self.cluster.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    async def _maintain(self) -> None:
        last_catch_up = last_gc = time.monotonic()
        first = True
        while True:
            try:
                came_back, changed = await self.cluster.refresh()
                if changed:
                    await run_blocking(self._apply_retention)
                self.redundancy.restore()
                now = time.monotonic()
                if first or came_back or now - last_catch_up > KNOBS.catch_up_interval:
                    first, last_catch_up = False, now
                    self.replicator.catch_up()
                if now - last_gc > KNOBS.gc_interval:
                    last_gc = now
                    await self.redundancy.collect_garbage()
                if self.metrics:
                    self.metrics.replication_lag.set(max(self.replicator.pending(), default=0.0))
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep maintaining
                log.exception("peer tier maintenance failed")
            try:  # on its own: a failure above must not keep dead senders' staging areas alive
                await run_blocking(self.receiver.expire)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("expiring inbound replicas failed")
            await asyncio.sleep(KNOBS.refresh_interval)

    def _apply_retention(self) -> None:
        for job in self.store.jobs():
            self.store.apply_retention(job)

    # ------------------------------------------------------------------------------ RemoteTier

    def on_begin(self, job: str, rank: int, sizes: Sequence[int]) -> None:
        self.hints.on_begin(job, rank, sizes)

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        # Copies of other owners' ranks (replicas) are not replicated further; an own rank
        # fetched back after a node replacement is checked (its copies usually exist already).
        if manifest.node == self.node_id:
            self.cluster.note_own(manifest.job, manifest.rank)
            if self.replicator.replicas_for(manifest):
                self.replicator.ensure(manifest)

    def restoring(self, job: str, step: int, rank: int) -> contextlib.AbstractContextManager:
        return self.receiver.fetching_rank((job, step, rank))

    def holds_copy(self, manifest: Manifest) -> bool:
        """A live peer holds this generation, or (a replica held here) its owner is up and holds it."""
        key = manifest.key
        if self.cluster.live_holders(key, manifest.generation):
            return True
        return manifest.node != self.node_id and self.cluster.owner_holds(manifest.node, key)

    def on_evict(self, eviction: Eviction) -> None:
        self.replicator.forget(eviction.job, eviction.step, eviction.ranks, eviction.reason)
        if eviction.reason == "retention":
            self.redundancy.drop_everywhere(eviction)

    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        return (await self.catalog_with_gaps(job))[0]

    async def catalog_with_gaps(self, job: str, job_owner: str | None = None
                                ) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        """Every peer's committed ranks of ``job`` (bounded fan-out; an operator question); with
        ``job_owner``, those that identity saved."""
        answers, missed = await self.cluster.job_catalogs(job)
        return merge_catalogs(answers, job_owner), missed

    async def rank_catalog(self, job: str, rank: int, job_owner: str | None = None) -> dict[int, RankCopy]:
        """Copies of one rank in the ring neighbourhood (its deltas refreshed first: O(R) calls)."""
        watched = self.cluster.watched()
        await asyncio.gather(*(self.cluster.refresh_peer(self.cluster.peers[n]) for n in sorted(watched)))
        out: dict[int, RankCopy] = {}
        for n in sorted(watched):
            p = self.cluster.peers[n]
            if not p.up:
                continue
            for (j, step, r), h in p.held.items():
                if j == job and r == rank and job_owner in (None, h.job_owner):
                    old = out.get(step)
                    nodes = tuple(sorted(set(old.nodes if old else ()) | {n}))
                    created = min(old.created, h.created) if old else h.created
                    out[step] = RankCopy(h.world_size, nodes, h.nbytes, created, h.job_owner)
        return out

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        return await self.fetcher.fetch(job, step, rank, job_owner)

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
        if not self.replicator.replicas_for(man):
            return []
        return await self.replicator.wait(man)

    # ------------------------------------------------------------------------------ operator verbs

    async def delete(self, job: str, step: int, job_owner: str | None = None) -> Deleted:
        """Ask every known peer to delete its copies of the step (Peer.DeleteStepCopies,
        ``KNOBS.fanout`` at a time within ``KNOBS.fanout_deadline``); with ``job_owner``, the
        copies that identity saved."""
        req = ppb.DeleteStepCopiesRequest(requester=self.node_id, job=job, step=step,
                                          has_job_owner=job_owner is not None, job_owner=job_owner or "")
        answers, missed = await self.cluster.fan_out("DeleteStepCopies", req)
        return Deleted(copies=sum(r.removed for _, r in answers), unreachable=missed)

    async def verify(self, job: str, step: int | None) -> Verified:
        """Ask every known peer to re-hash its copies of ``job`` (Peer.VerifyCopies)."""
        req = ppb.VerifyCopiesRequest(requester=self.node_id, job=job, has_step=step is not None, step=step or 0)
        answers, missed = await self.cluster.fan_out("VerifyCopies", req)
        states = {1: "ok", 2: "mismatch", 3: "missing"}
        return Verified([Check(c.step, c.rank, "peer", p.node_id, states.get(c.state, "missing"), c.detail)
                         for p, resp in answers for c in resp.copies], missed)

    def status(self) -> dict:
        pending = self.replicator.pending()
        return {
            "peers": self.cluster.status(),
            "replicas": self.config.replicas,
            "pending_ranks": len(pending),
            "lag_seconds": max(pending, default=0.0),
            "bulk_port": self._bulk.port,
        }

    # ------------------------------------------------------------------------------ service side

    def hello(self) -> ppb.HelloResponse:
        """Identity of this daemon (Hello RPC)."""
        return ppb.HelloResponse(node_id=self.node_id, instance=self.instance, bulk_port=self._bulk.port,
                                 replicas=self.config.replicas)

    def local_catalog(self, job: str, since_version: int = 0, since_instance: str = "") -> ppb.CatalogResponse:
        """Committed ranks held here, own and replicas, for ``job`` or every job (Catalog RPC);
        for every job, a delta since ``since_version`` of this instance when it can be given."""
        resp = ppb.CatalogResponse(node_id=self.node_id, instance=self.instance, bulk_port=self._bulk.port,
                                   now_unix=time.time())
        if job:
            resp.entries.extend(self._entries(job).values())
            return resp
        since = since_version if since_instance == self.instance else 0
        resp.version, resp.delta, entries, removed = self._changes.since(since)
        resp.entries.extend(entries)
        resp.removed.extend(ppb.RankKey(job=j, step=s, rank=r) for j, s, r in removed)
        return resp

    def _entries(self, job: str) -> dict[tuple[str, int, int], ppb.CatalogEntry]:
        return {m.key: ppb.CatalogEntry(job=job, step=step, rank=m.rank, world_size=m.world_size, owner=m.node,
                                        generation=m.generation, bytes=m.nbytes, created_unix=m.created,
                                        job_owner=m.job_owner)
                for step, ranks in self.store.steps(job).items() for m in ranks.values()}

    def _snapshot(self) -> dict[tuple[str, int, int], ppb.CatalogEntry]:
        out: dict[tuple[str, int, int], ppb.CatalogEntry] = {}
        for job in self.store.jobs():
            out.update(self._entries(job))
        return out

    async def drop_replicas(self, owner: str, job: str, step: int, ranks: Sequence[int], reason: str) -> int:
        """Remove the replicas of ``owner``'s ranks of a step (DropReplicas RPC); returns how many."""
        if KNOBS.debug_drop_delay:
            await asyncio.sleep(KNOBS.debug_drop_delay)
        removed = 0
        for rank in ranks:
            man = self.store.get(job, step, rank)
            if man is not None and man.node == owner != self.node_id:
                removed += await run_blocking(self.store.remove_rank, job, step, rank,
                                              f"replica dropped by its owner {owner} ({reason})")
        return removed


def merge_catalogs(answers: list[tuple[PeerInfo, list[Any]]],
                   job_owner: str | None = None) -> dict[int, dict[int, RankCopy]]:
    """step -> rank -> copy over the peers' answers (nodes merged, oldest creation time kept);
    with ``job_owner``, only the copies that identity saved."""
    merged: dict[int, dict[int, RankCopy]] = {}
    for p, entries in answers:
        for e in entries:
            if job_owner is not None and e.job_owner != job_owner:
                continue
            old = merged.setdefault(e.step, {}).get(e.rank)
            nodes = tuple(sorted(set(old.nodes if old else ()) | {p.node_id}))
            merged[e.step][e.rank] = RankCopy(e.world_size, nodes, e.bytes,
                                              min(old.created, e.created_unix) if old else e.created_unix,
                                              e.job_owner)
    return merged
