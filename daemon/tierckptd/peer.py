"""The peer tier: copies of every committed rank on R other daemons, and restore from them.

Placement (:func:`ring_placement`): node ids, this node's included, form a ring in sorted order.
The copies of a rank saved on node O go to the next R nodes after O on the ring that are up,
skipping nodes that are down or that failed this rank twice in a row. Every node computes the
same placement from the same health view; no coordinator is involved.

Replication (owner side): after a local commit, :meth:`PeerTier.on_commit` schedules a
background task per rank and returns (``save()`` never waits for peers). Each attempt pushes the
rank to every placement target still lacking it: ``PrepareReplica`` (gRPC; the target opens a
staging area and issues a ticket), the shards over the bulk channel (:mod:`tierckptd.bulk`,
several connections in parallel, sendfile from the local tier; the target hashes every shard
in byte order as it arrives), then ``CommitReplica`` (the target checks every checksum and
publishes the manifest last, the local commit protocol).
Failed attempts are retried with exponential backoff and full jitter; a peer that stops
answering is marked down, so the next attempt places the copy on the next node of the ring.
``wait("peer")`` resolves once R live peers hold the rank's generation, or raises
:class:`TierError` naming the failed peers when the retries are spent.

Catch-up and garbage collection: a peer that comes back (or restarts, seen as a new instance id)
triggers a catch-up of the owner's ranks in the retention window, so the preferred placement is
restored; a copy left on a fallback node becomes surplus once the placement holds R copies and
the holder drops it. Replicas follow the owner's retention: the owner's retention evictions send
``DropReplicas``, every node's own retention counts cluster-wide completeness, and a replica
whose owner is up, no longer holds it and has ``keep_local`` newer complete steps is dropped.

Lost owners: when an owner has been down for :data:`OWNER_GRACE` seconds (this node's view), its
own copy counts as gone, so its ranks in the retention window should have R + 1 copies among the
live nodes (a stand-in for the owner's copy plus R replicas): the first live holder of a rank on
the ring after the owner pushes it (same push path) to the first R + 1 live nodes after the owner
that lack it. While an owner is down (any duration), or up without the rank (a replacement that
has not restored it), garbage collection also counts R + 1 copies, so it never drops those; once
the owner holds the rank again (restarted, or a replacement that restored it), placement is R
again and the copies beyond it are surplus and dropped by the usual rule.

Catalog: every node polls its peers' ``Catalog`` every :data:`REFRESH_INTERVAL` seconds (the
health check); ``catalog(job)`` asks the live peers directly, so ``latest()`` counts a step
complete when, for every rank, some live node holds a committed copy. The cached catalogs back
the cluster-aware completeness used by local retention (``LocalStore.is_complete``).

Restore after node replacement: :meth:`PeerTier.fetch` pulls a rank from a live holder (newest
generation first, then the owner, then ring order) over the bulk channel into the local store,
verifying checksums on receipt; a corrupt or unreachable copy falls back to the next holder.

Discovery: ``--peers ID=HOST:PORT,...``, or ``--peers-dns NAME:PORT``: the A/AAAA records of
NAME are resolved every refresh and each new address is asked for its node id (``Hello``). With
mTLS, DNS-discovered peers are verified against NAME (their certificates must carry it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import functools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from tierckpt.common.names import check_job, check_node, check_step
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
    TierError,
    UnavailableError,
)
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from . import bulk
from .config import ConfigError, DaemonConfig
from .manifest import Manifest
from .retry import RetryPolicy
from .server import _rpc
from .store import Eviction, LocalStore, Staging
from .tiers import RankCopy, RemoteTier

__all__ = ["PeerServicer", "PeerTier", "plan_pieces", "ring_placement"]

log = logging.getLogger(__name__)

REFRESH_INTERVAL = 1.0
"""Seconds between polls of every peer's catalog (the health check)."""
CATCH_UP_INTERVAL = 30.0
"""Seconds between full checks that every owned rank in the retention window has its copies."""
GC_INTERVAL = 5.0
"""Seconds between sweeps for surplus and retired replicas."""
OWNER_GRACE = 15.0
"""Seconds an owner must stay down (this node's view) before its ranks' copies are re-replicated
to restore redundancy (see :meth:`PeerTier._restore_redundancy`)."""
RPC_TIMEOUT = 5.0
BULK_STREAMS = max(2, min(4, (os.cpu_count() or 2) // 2))
"""Parallel bulk connections per rank transfer: loopback and NIC throughput of Python sockets is
CPU-bound on both ends, so more streams than half the cores only add contention (measured)."""
MIN_PIECE = 32 << 20
"""A shard is split over several connections only into pieces at least this large."""
MAX_PARALLEL_RANKS = 4
"""Ranks replicated at once (each uses up to BULK_STREAMS connections)."""
MAX_FAILS_PER_PEER = 2
"""Failed attempts of one rank on one peer before placement skips that peer for the rank."""
RETRY = RetryPolicy(initial_delay=0.25, max_delay=5.0, multiplier=2.0, max_attempts=6, deadline=None)
"""Backoff between replication attempts of a rank; after the last one, waiters get TierError."""
READ_TICKET_TTL = 600.0
COMMIT_TIMEOUT = 60.0
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# ----------------------------------------------------------------------------------- planning

def ring_placement(owner: str, nodes: Iterable[str], up: Collection[str], replicas: int) -> list[str]:
    """The nodes that should hold copies of ``owner``'s ranks, in order of preference.

    Args:
        owner: the node that saved the rank.
        nodes: every known node id (the owner may or may not be among them).
        up: the ids that may receive a copy now (live and not excluded).
        replicas: R.

    Returns:
        The first ``replicas`` ids of ``up`` after ``owner`` on the ring of sorted ids (fewer if
        not enough are up); never the owner.
    """
    ring = sorted(set(nodes) | {owner})
    start = ring.index(owner)
    out: list[str] = []
    for k in range(1, len(ring)):
        node = ring[(start + k) % len(ring)]
        if len(out) >= replicas:
            break
        if node in up:
            out.append(node)
    return out


def plan_pieces(shards: Sequence[tuple[str, int]], streams: int = BULK_STREAMS, min_piece: int = MIN_PIECE,
                chunk: int = bulk.CHUNK) -> list[tuple[str, int, int, int]]:
    """Split shards into ``(name, offset, chunk, stride)`` pieces for ``streams`` connections.

    Shards travel whole (one run) unless there are fewer shards than streams; then a large shard
    is split into k <= ``streams`` pieces (at least ``min_piece`` bytes each) of interleaved
    ``chunk``-byte runs, so the receiver can hash it in order as the k connections deliver it.
    Largest first, so connections finish together.
    """
    split = len(shards) < streams
    pieces: list[tuple[str, int, int, int]] = []
    for name, size in sorted(shards, key=lambda s: -s[1]):
        k = max(1, min(streams, size // max(1, min_piece))) if split else 1
        if k == 1:
            pieces.append((name, 0, max(size, 1), max(size, 1)))
        else:
            pieces.extend((name, j * chunk, chunk, k * chunk) for j in range(k))
    return pieces


# ----------------------------------------------------------------------------------- state

class _Held(NamedTuple):
    world_size: int
    owner: str
    generation: str
    nbytes: int
    created: float


@dataclass(eq=False)
class _Peer:
    node_id: str
    host: str
    port: int
    tls_name: str | None = None  # name to verify the certificate against (DNS-discovered peers)
    channel: Any = None
    stub: Any = None
    up: bool = False
    last_seen: float = 0.0
    last_error: str = "not contacted yet"
    instance: str = ""
    bulk_port: int = 0
    refreshed: float = -1.0  # monotonic time of the last catalog received
    held: dict[tuple[str, int, int], _Held] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(eq=False)
class _Rep:
    """Replication state of one owned rank (one generation)."""

    man: Manifest
    since: float = field(default_factory=time.monotonic)
    acked_at: dict[str, float] = field(default_factory=dict)  # peer -> monotonic time of its ack
    failures: dict[str, str] = field(default_factory=dict)
    fail_count: collections.Counter = field(default_factory=collections.Counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    reached: bool = False
    holders: list[str] = field(default_factory=list)
    error: TierError | None = None
    attempts: int = 0
    task: asyncio.Task | None = None


@dataclass(eq=False)
class _Inbound:
    """A replica being received: its staging area and the pieces that arrived."""

    ticket: str
    man: Manifest
    staging: Staging
    sender: str
    hashers: dict[str, bulk.OrderedHasher]
    created: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Reader:
    man: Manifest
    created: float


# ----------------------------------------------------------------------------------- tier

class PeerTier(RemoteTier):
    """Replicas on peer daemons. See the module docstring for placement and protocols.

    Args:
        config: the daemon configuration (peers, peers_dns, replicas, listen, tls_*).
        store: the opened local store; its ``is_complete`` is replaced by a cluster-aware one.
        metrics: optional :class:`tierckptd.metrics.Metrics`.

    Raises:
        ConfigError: no TCP listener (peers could not reach this node).
    """

    name = "peer"

    def __init__(self, config: DaemonConfig, store: LocalStore, metrics=None) -> None:
        if not config.listen:
            raise ConfigError("listen: the peer tier needs a TCP listener (peers connect to it)")
        self.config = config
        self.store = store
        self.metrics = metrics
        self.node_id = config.node_id
        self.replicas = config.replicas
        self.instance = secrets.token_hex(8)
        self.node = None
        self._peers: dict[str, _Peer] = {p.node_id: _Peer(p.node_id, p.host, p.port) for p in config.other_peers()}
        self._dns: tuple[str, int] | None = None
        if config.peers_dns:
            name, _, port = config.peers_dns.rpartition(":")
            self._dns = (name, int(port))
        self._self_addrs: set[str] = set()
        self._reps: dict[tuple[str, int, int], _Rep] = {}
        self._inbound: dict[str, _Inbound] = {}
        self._readers: dict[str, _Reader] = {}
        self._lock = threading.Lock()  # guards _inbound and _readers (bulk threads use them)
        self._restoring = 0  # fetches in progress: inbound replicas give way to them
        self._fetching: set[tuple[str, int, int]] = set()  # ranks being fetched (not to be staged twice)
        self._restore_cv = threading.Condition()
        self._index: dict[tuple[str, int], frozenset[int]] = {}
        self._pool = cf.ThreadPoolExecutor(MAX_PARALLEL_RANKS * BULK_STREAMS * 2, thread_name_prefix="tierckpt-peer")
        self._creds = self._ssl_client = None
        ssl_server = None
        if config.tls_enabled:
            from . import tls

            self._creds = tls.channel_credentials(config)
            self._ssl_client = tls.client_ssl_context(config)
            ssl_server = tls.server_ssl_context(config)
        self._bulk = bulk.BulkServer(config.listen.rpartition(":")[0].strip("[]"), ssl_server, self._serve_bulk)
        self._sem: asyncio.Semaphore | None = None
        self._maintainer: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._down_since: dict[str, float] = {}  # peer id -> monotonic time first seen down
        self._rereps: dict[tuple[str, int, int], asyncio.Task] = {}  # lost owners' ranks being pushed
        self._rerep_backoff: dict[tuple[str, int, int], tuple[int, float]] = {}  # key -> (fails, not before)
        store._is_complete = self._is_complete  # interim: the membership supplies it (next commit)
        if self.replicas > len(self._peers) and not self._dns:
            log.warning("replicas=%d but only %d peers are configured: wait('peer') will fail",
                        self.replicas, len(self._peers))

    def attach(self, node) -> None:
        """Called by main once the Node exists (to announce ingested copies)."""
        self.node = node

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve the daemon-to-daemon Peer service on the daemon's gRPC server."""
        ppb_grpc.add_PeerServicer_to_server(PeerServicer(self), server)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._sem = asyncio.Semaphore(MAX_PARALLEL_RANKS)
        port = await asyncio.to_thread(self._bulk.start)
        log.info("peer tier: bulk channel on port %d%s, %d peers configured, replicas=%d", port,
                 " (mTLS)" if self._ssl_client else "", len(self._peers), self.replicas)
        for p in self._peers.values():
            self._connect(p)
        self._maintainer = asyncio.create_task(self._maintain())

    async def stop(self, timeout: float) -> None:
        if self._maintainer:
            self._maintainer.cancel()
        pending = [st.task for st in self._reps.values() if st.task and not st.task.done()]
        if pending:
            log.info("peer tier: waiting up to %.0fs for %d replications", timeout, len(pending))
            _, late = await asyncio.wait(pending, timeout=max(0.01, timeout))
            for t in late:
                t.cancel()
            if late:
                log.warning("peer tier: %d replications unfinished at shutdown (caught up after restart)", len(late))
        for t in [*self._background, *self._rereps.values()]:
            t.cancel()
        self._bulk.stop()
        for p in self._peers.values():
            if p.channel is not None:
                await p.channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _connect(self, p: _Peer) -> None:
        opts = list(_CHANNEL_OPTIONS) + [("grpc.max_receive_message_length", self.config.max_message_bytes),
                                         ("grpc.max_send_message_length", self.config.max_message_bytes)]
        if self._creds is not None:
            if p.tls_name:
                opts.append(("grpc.ssl_target_name_override", p.tls_name))
            p.channel = grpc.aio.secure_channel(p.address, self._creds, options=opts)
        else:
            p.channel = grpc.aio.insecure_channel(p.address, options=opts)
        p.stub = ppb_grpc.PeerStub(p.channel)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    # ------------------------------------------------------------------------------ health

    async def _call(self, p: _Peer, method, request, timeout: float | None):
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"peer {p.node_id} ({p.address})") from None

    def _mark_up(self, p: _Peer) -> None:
        if not p.up:
            log.info("peer %s (%s) is up", p.node_id, p.address)
            p.last_error = ""
        p.up, p.last_seen = True, time.time()
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(1)

    def _mark_down(self, p: _Peer, err: BaseException) -> None:
        p.last_error = str(err)
        if p.up:
            log.warning("peer %s (%s) is down: %s", p.node_id, p.address, err)
        p.up = False
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(0)

    async def _refresh_peer(self, p: _Peer) -> bool:
        """Poll one peer's catalog; returns True if it came back or restarted."""
        try:
            resp = await self._call(p, p.stub.Catalog, ppb.CatalogRequest(node_id=self.node_id), RPC_TIMEOUT)
        except TierckptError as e:
            self._mark_down(p, e)
            return False
        if resp.node_id != p.node_id:
            self._mark_down(p, FailedPreconditionError(f"{p.address} answers as node {resp.node_id!r}"))
            return False
        came_back = not p.up or (p.instance and p.instance != resp.instance)
        p.held = {(e.job, e.step, e.rank): _Held(e.world_size, e.owner, e.generation, e.bytes, e.created_unix)
                  for e in resp.entries}
        p.instance, p.bulk_port, p.refreshed = resp.instance, resp.bulk_port, time.monotonic()
        self._mark_up(p)
        return bool(came_back)

    async def _refresh(self) -> bool:
        """Poll every peer; re-run retention if cluster completeness changed."""
        results = await asyncio.gather(*(self._refresh_peer(p) for p in list(self._peers.values())))
        if self._rebuild_index():
            await asyncio.to_thread(self._apply_retention)
        return any(results)

    def _rebuild_index(self) -> bool:
        idx: dict[tuple[str, int], set[int]] = collections.defaultdict(set)
        for p in self._peers.values():
            if p.up:
                for job, step, rank in p.held:
                    idx[(job, step)].add(rank)
        new = {k: frozenset(v) for k, v in idx.items()}
        changed = new != self._index
        self._index = new
        return changed

    def _is_complete(self, job: str, step: int, world_size: int, ranks: set[int]) -> bool:
        """Cluster-aware completeness for local retention: every rank held by this node or a live peer."""
        if len(ranks) >= world_size:
            return True
        return len(ranks | self._index.get((job, step), frozenset())) >= world_size

    def _apply_retention(self) -> None:
        for job in self.store.jobs():
            self.store.apply_retention(job)

    async def _maintain(self) -> None:
        last_catch_up = last_gc = time.monotonic()
        first = True
        while True:
            try:
                if self._dns:
                    await self._discover()
                came_back = await self._refresh()
                self._restore_redundancy()
                now = time.monotonic()
                if first or came_back or now - last_catch_up > CATCH_UP_INTERVAL:
                    first, last_catch_up = False, now
                    self._catch_up()
                if now - last_gc > GC_INTERVAL:
                    last_gc = now
                    await self._collect_garbage()
                self._expire()
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep maintaining
                log.exception("peer tier maintenance failed")
            await asyncio.sleep(REFRESH_INTERVAL)

    async def _discover(self) -> None:
        """Resolve --peers-dns and learn the node id behind each new address."""
        name, port = self._dns
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("peers_dns: cannot resolve %s: %s", name, e)
            return
        known = {p.host for p in self._peers.values()} | self._self_addrs
        for addr in sorted({i[4][0] for i in infos} - known):
            probe = _Peer("?", addr, port, tls_name=name if self._creds else None)
            self._connect(probe)
            try:
                hello = await self._call(probe, probe.stub.Hello, ppb.HelloRequest(node_id=self.node_id), RPC_TIMEOUT)
                check_node(hello.node_id)
            except TierckptError as e:
                log.debug("peers_dns: %s did not answer: %s", addr, e)
                await probe.channel.close()
                continue
            if hello.node_id == self.node_id:
                self._self_addrs.add(addr)
                await probe.channel.close()
                continue
            old = self._peers.get(hello.node_id)
            if old is not None and old.channel is not None:
                await old.channel.close()
                log.info("peers_dns: node %s moved from %s to %s", hello.node_id, old.host, addr)
            else:
                log.info("peers_dns: discovered node %s at %s", hello.node_id, addr)
            probe.node_id = hello.node_id
            self._peers[hello.node_id] = probe

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, i in self._inbound.items() if now - i.created > self.config.staging_timeout]
            dropped = [self._inbound.pop(t) for t in stale]
            for t in [t for t, r in self._readers.items() if now - r.created > READ_TICKET_TTL]:
                del self._readers[t]
        for inb in dropped:
            self.store.abort(inb.staging.save_id)
        if self.metrics:
            pending = [time.monotonic() - st.since for st in self._reps.values() if not st.reached]
            self.metrics.replication_lag.set(max(pending, default=0.0))

    # ------------------------------------------------------------------------------ replication

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        # Copies of other owners' ranks (replicas) are not replicated further; an own rank
        # fetched back after a node replacement is checked (its copies usually exist already).
        if self.replicas and manifest.node == self.node_id:
            self._ensure(manifest)

    def on_evict(self, eviction: Eviction) -> None:
        for rank in eviction.ranks:
            st = self._reps.pop((eviction.job, eviction.step, rank), None)
            if st is not None:
                if st.task and not st.task.done():
                    st.task.cancel()
                if not st.event.is_set():
                    self._finish(st, TierError(f"{eviction.job} step {eviction.step} rank {rank} was evicted "
                                               f"({eviction.reason}) before reaching {self.replicas} peers"))
        if eviction.reason == "retention":
            self._spawn(self._drop_everywhere(eviction))

    async def _drop_everywhere(self, ev: Eviction) -> None:
        """Replicas follow the owner's retention: ask every live peer to drop our copies of the step."""
        req = ppb.DropReplicasRequest(owner=self.node_id, job=ev.job, step=ev.step, ranks=list(ev.ranks),
                                      reason=ev.reason)
        peers = [p for p in self._peers.values() if p.up]
        results = await asyncio.gather(*(self._call(p, p.stub.DropReplicas, req, RPC_TIMEOUT) for p in peers),
                                       return_exceptions=True)
        for p, res in zip(peers, results):
            if isinstance(res, TierckptError):
                log.info("could not drop replicas of %s step %d on %s (garbage-collected later): %s",
                         ev.job, ev.step, p.node_id, res)

    def _catch_up(self) -> None:
        """Check every owned rank in the retention window (a peer came back, or periodically)."""
        if not self.replicas:
            return
        for job in self.store.jobs():
            complete = self.store.complete_steps(job)
            floor = complete[-self.store.keep_local] if len(complete) >= self.store.keep_local else -1
            for step, ranks in self.store.steps(job).items():
                if step >= floor:
                    for man in ranks.values():
                        if man.node == self.node_id:
                            self._ensure(man)

    def _ensure(self, man: Manifest) -> _Rep:
        """The replication state of an owned rank, with a task checking/pushing its copies."""
        st = self._reps.get(man.key)
        if st is None or st.man.generation != man.generation:
            if st is not None and st.task and not st.task.done():
                st.task.cancel()
            st = self._reps[man.key] = _Rep(man)
        if st.task is None or st.task.done():
            if st.event.is_set() and not st.reached:  # failed before: a fresh round for new waiters
                st.event, st.error = asyncio.Event(), None
            st.fail_count.clear()
            st.task = asyncio.create_task(self._replicate(st))
        return st

    def _finish(self, st: _Rep, error: TierError | None) -> None:
        if error is None:
            st.reached = True
            if self.metrics:
                self.metrics.replication_latency.observe(time.monotonic() - st.since)
        else:
            st.error = error
            log.error("%s", error)
        st.event.set()

    def _holders(self, st: _Rep) -> list[str]:
        """Live peers holding this generation: per their last catalog, or acked since it."""
        out = []
        for n, p in self._peers.items():
            h = p.held.get(st.man.key)
            if p.up and ((h is not None and h.generation == st.man.generation) or st.acked_at.get(n, -2.0) > p.refreshed):
                out.append(n)
        return sorted(out)

    def _placement(self, owner: str, exclude: Collection[str] = ()) -> list[str]:
        up = {n for n, p in self._peers.items() if p.up and n not in exclude}
        return ring_placement(owner, set(self._peers) | {self.node_id}, up, self.replicas)

    async def _replicate(self, st: _Rep) -> None:
        man = st.man
        job, step, rank = man.key
        for attempt in range(1, RETRY.max_attempts + 1):
            st.attempts = attempt
            cur = self.store.get(job, step, rank)
            if cur is None or cur.generation != man.generation:
                if self._reps.get(man.key) is st:
                    del self._reps[man.key]
                if not st.event.is_set():
                    self._finish(st, TierError(f"{job} step {step} rank {rank} was evicted or re-saved "
                                               f"before reaching {self.replicas} peers"))
                return
            targets = self._placement(self.node_id, [n for n, c in st.fail_count.items() if c >= MAX_FAILS_PER_PEER])
            missing = [t for t in targets if t not in self._holders(st)]
            if missing:
                async with self._sem:
                    results = await asyncio.gather(*(self._push(man, self._peers[t]) for t in missing),
                                                   return_exceptions=True)
                for t, res in zip(missing, results):
                    if isinstance(res, BaseException):
                        await self._push_failed(st, self._peers[t], res, attempt)
                    else:
                        st.acked_at[t] = time.monotonic()
                        st.failures.pop(t, None)
            holders = self._holders(st)
            if len(holders) >= self.replicas and not st.reached:
                st.holders = holders
                self._finish(st, None)
            if len(targets) >= self.replicas and all(t in holders for t in targets):
                return  # converged on the preferred placement
            if attempt < RETRY.max_attempts:
                await asyncio.sleep(RETRY.delay(attempt))
        if not st.reached:
            self._finish(st, TierError(self._failure_message(st)))

    async def _push_failed(self, st: _Rep, p: _Peer, err: BaseException, attempt: int) -> None:
        if isinstance(err, asyncio.CancelledError):
            raise err
        if not isinstance(err, (TierckptError, OSError)):
            log.error("replication of %s to %s failed unexpectedly", st.man.key, p.node_id, exc_info=err)
        st.fail_count[p.node_id] += 1
        st.failures[p.node_id] = str(err)
        log.warning("replicating %s step %d rank %d to %s failed (attempt %d): %s",
                    st.man.job, st.man.step, st.man.rank, p.node_id, attempt, err)
        if self.metrics:
            self.metrics.replication_failures.labels(peer=p.node_id).inc()
            self.metrics.saves.labels(tier="peer", result="error").inc()
        if isinstance(err, (UnavailableError, DeadlineExceededError)):
            await self._refresh_peer(p)  # down for real, or a transient break?

    def _failure_message(self, st: _Rep) -> str:
        job, step, rank = st.man.key
        holders = self._holders(st)
        parts = []
        for n in ring_placement(self.node_id, set(self._peers) | {self.node_id}, set(self._peers), len(self._peers)):
            if n in holders:
                continue
            if n in st.failures:
                parts.append(f"{n} ({st.failures[n]})")
            elif not self._peers[n].up:
                parts.append(f"{n} (down: {self._peers[n].last_error})")
        return (f"{job} step {step} rank {rank}: {len(holders)} of {self.replicas} peer copies committed after "
                f"{st.attempts} attempts; failed peers: {', '.join(parts) or 'none (too few peers configured)'}")

    async def _push(self, man: Manifest, p: _Peer) -> None:
        """Copy one owned rank to peer ``p`` (prepare, bulk put, verified commit)."""
        t0 = time.perf_counter()
        prep = await self._call(p, p.stub.PrepareReplica,
                                ppb.PrepareReplicaRequest(sender=self.node_id, manifest_json=man.to_json().decode()),
                                RPC_TIMEOUT)
        if prep.already_committed:
            return
        try:
            files = {s.name: (str(self.store.shard_path(man, s.name)), s.size) for s in man.shards}
            pieces = plan_pieces([(s.name, s.size) for s in man.shards])
            await self._run_streams(p, prep.bulk_port, prep.ticket, "put", pieces, files, {})
            await self._call(p, p.stub.CommitReplica, ppb.CommitReplicaRequest(ticket=prep.ticket), COMMIT_TIMEOUT)
        except BaseException:
            self._spawn(self._abort_remote(p, prep.ticket))
            raise
        elapsed = time.perf_counter() - t0
        log.info("replicated %s step %d rank %d to %s: %d bytes in %.3fs (%.2f GB/s)", man.job, man.step,
                 man.rank, p.node_id, man.nbytes, elapsed, man.nbytes / max(elapsed, 1e-9) / 1e9)
        if self.metrics:
            self.metrics.saves.labels(tier="peer", result="ok").inc()
            self.metrics.saved_bytes.labels(tier="peer").inc(man.nbytes)

    async def _abort_remote(self, p: _Peer, ticket: str) -> None:
        try:
            await self._call(p, p.stub.AbortReplica, ppb.AbortReplicaRequest(ticket=ticket), RPC_TIMEOUT)
        except TierckptError as e:
            log.debug("abort of replica ticket on %s failed (its staging expires): %s", p.node_id, e)

    # ------------------------------------------------------------------------------ lost owners
    #
    # Restoring redundancy when an owner dies for good (see "Lost owners" in the module docstring).
    # Hysteresis against ping-pong: copies are pushed only after OWNER_GRACE, but kept (by GC) as
    # soon as the owner is down; when it holds the rank again GC goes back to R and drops the extra
    # copy. Nothing here pushes while the owner is up, so GC and this never undo each other.

    def _copies_wanted(self, man: Manifest) -> int:
        """Copies of a replica's rank wanted besides the owner's: R while the owner is up and holds
        the rank, else R + 1 (a stand-in for the owner's copy: down, or replaced and not restored)."""
        p = self._peers.get(man.node)
        return self.replicas + (0 if p is not None and p.up and man.key in p.held else 1)

    def _restore_redundancy(self) -> None:
        """Push copies of lost owners' ranks held here to live nodes lacking them (each maintenance pass)."""
        now = time.monotonic()
        for n, p in self._peers.items():
            if p.up:
                self._down_since.pop(n, None)
            else:
                self._down_since.setdefault(n, now)
        lost = {n for n, t in self._down_since.items() if now - t >= OWNER_GRACE}
        if not lost:
            self._rerep_backoff.clear()
        if not self.replicas or not lost:
            return
        nodes = set(self._peers) | {self.node_id}
        up = {n for n, p in self._peers.items() if p.up} | {self.node_id}
        seen = set()
        for job in self.store.jobs():
            complete = self.store.complete_steps(job)
            floor = complete[-self.store.keep_local] if len(complete) >= self.store.keep_local else -1
            for step, ranks in self.store.steps(job).items():
                if step < floor:
                    continue
                for man in ranks.values():
                    seen.add(man.key)
                    if man.node not in lost or man.key in self._rereps:
                        continue
                    fails, not_before = self._rerep_backoff.get(man.key, (0, 0.0))
                    if now < not_before:
                        continue
                    if any(p.up and (h := p.held.get(man.key)) is not None and h.created > man.created
                           for p in self._peers.values()):
                        continue  # a newer save of the rank lives elsewhere: its holders act
                    holders = self.live_holders(man)
                    # Only the first live holder after the owner on the ring acts (as in the drain's take-over).
                    first = min([self.node_id, *holders], key=lambda n, o=man.node: (n < o, n))
                    if first != self.node_id:
                        continue
                    missing = [t for t in ring_placement(man.node, nodes, up, self.replicas + 1)
                               if t != self.node_id and t not in holders]
                    if missing:
                        self._rereps[man.key] = asyncio.create_task(self._rereplicate(man, missing, fails))
        for key in [k for k in self._rerep_backoff if k not in seen]:
            del self._rerep_backoff[key]

    async def _rereplicate(self, man: Manifest, targets: list[str], fails: int) -> None:
        """Push a lost owner's rank held here to ``targets``; failures back off (RETRY's delays)."""
        try:
            log.warning("owner %s of %s step %d rank %d is down for over %.0fs: copying it to %s to restore "
                        "redundancy", man.node, man.job, man.step, man.rank, OWNER_GRACE, ",".join(targets))
            async with self._sem:
                results = await asyncio.gather(*(self._push(man, self._peers[t]) for t in targets),
                                               return_exceptions=True)
            failed = False
            for t, res in zip(targets, results):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    failed = True
                    log.warning("copying %s step %d rank %d (owner %s down) to %s failed: %s",
                                man.job, man.step, man.rank, man.node, t, res)
                    if isinstance(res, (UnavailableError, DeadlineExceededError)):
                        await self._refresh_peer(self._peers[t])
            if failed:
                fails = min(fails + 1, RETRY.max_attempts)
                self._rerep_backoff[man.key] = (fails, time.monotonic() + RETRY.delay(fails))
            else:
                self._rerep_backoff.pop(man.key, None)
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: retried on a later pass
            log.exception("re-replication of %s failed unexpectedly", man.key)
        finally:
            self._rereps.pop(man.key, None)

    # ------------------------------------------------------------------------------ bulk client

    async def _run_streams(self, p: _Peer, port: int, ticket: str, op: str, pieces: list[tuple[str, int, int, int]],
                           files: dict[str, tuple[str, int]], hashers: dict[str, bulk.OrderedHasher]) -> None:
        """Move pieces over up to BULK_STREAMS connections (worker threads); "get" feeds ``hashers``."""
        work: queue.SimpleQueue = queue.SimpleQueue()
        for piece in pieces:
            work.put(piece)
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        futs = [loop.run_in_executor(self._pool, self._stream_worker, p, port, ticket, op, work, files, hashers, stop)
                for _ in range(min(BULK_STREAMS, len(pieces)))]
        try:
            await asyncio.gather(*futs)
        except BaseException as e:
            stop.set()
            for h in hashers.values():
                h.abort(f"transfer from {p.node_id} failed: {e}")
            raise

    def _stream_worker(self, p: _Peer, port: int, ticket: str, op: str, work: queue.SimpleQueue,
                       files: dict[str, tuple[str, int]], hashers: dict[str, bulk.OrderedHasher],
                       stop: threading.Event) -> None:
        sock = bulk.connect(p.host, port, self._ssl_client, p.tls_name)
        buf = bytearray(bulk.BUF_BYTES) if (op == "get" or self._ssl_client) else None
        try:
            while not stop.is_set():
                try:
                    shard, off, chunk, stride = work.get_nowait()
                except queue.Empty:
                    return
                path, size = files[shard]
                what = f"peer {p.node_id} bulk {op} {shard}"
                bulk.send_msg(sock, {"v": bulk.VERSION, "op": op, "ticket": ticket, "shard": shard,
                                     "offset": off, "chunk": chunk, "stride": stride})
                reply = bulk.raise_for(bulk.recv_msg(sock), what)
                if op == "put":
                    with open(path, "rb") as fh:
                        for start, length in bulk.runs(off, chunk, stride, size):
                            bulk.send_range(sock, fh, start, length, buf)
                    bulk.raise_for(bulk.recv_msg(sock), what)
                    continue
                expect = sum(n for _, n in bulk.runs(off, chunk, stride, size))
                if reply.get("length") != expect:
                    raise DataLossError(f"{what}: peer offers {reply.get('length')} bytes, expected {expect}")
                fd = os.open(path, os.O_WRONLY)
                try:
                    for start, length in bulk.runs(off, chunk, stride, size):
                        bulk.recv_range(sock, fd, start, length, buf, hashers[shard].update)
                finally:
                    os.close(fd)
        except OSError as e:
            raise UnavailableError(f"bulk channel to {p.node_id}: {e}") from None
        finally:
            sock.close()

    # ------------------------------------------------------------------------------ bulk server

    def _serve_bulk(self, sock: socket.socket, req: dict, buf: bytearray) -> None:
        """Serve one bulk request (a bulk thread). Errors are answered, then close the connection."""
        try:
            op, ticket, shard = req.get("op"), str(req.get("ticket", "")), str(req.get("shard", ""))
            piece = (req.get("offset"), req.get("chunk"), req.get("stride"))
            if op == "put":
                self._bulk_put(sock, ticket, shard, piece, buf)
            elif op == "get":
                self._bulk_get(sock, ticket, shard, piece, buf)
            else:
                raise InvalidArgumentError(f"op: {op!r} must be put or get")
        except TierckptError as e:
            bulk.send_msg(sock, bulk.error_msg(e))
            raise

    def _bulk_put(self, sock: socket.socket, ticket: str, shard: str, piece: tuple, buf: bytearray) -> None:
        with self._lock:
            inb = self._inbound.get(ticket)
        if inb is None:
            raise FailedPreconditionError("ticket: unknown or expired replica ticket")
        f = inb.staging.files.get(shard)
        if f is None:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of this replica")
        bulk.check_piece(*piece, f.size)
        try:
            fd = os.open(f.path, os.O_WRONLY)
        except FileNotFoundError:
            raise FailedPreconditionError("ticket: the replica's staging area was aborted or expired") from None
        hasher = inb.hashers[shard]
        try:
            bulk.send_msg(sock, {"ok": True})
            for start, length in bulk.runs(*piece, f.size):
                bulk.recv_range(sock, fd, start, length, buf, hasher.update, self._yield_to_restores)
        except OSError as e:
            for h in inb.hashers.values():  # fail the other connections of this replica now
                h.abort(f"a connection of this replica broke: {e}")
            raise
        finally:
            os.close(fd)
        bulk.send_msg(sock, {"ok": True})

    def _yield_to_restores(self) -> None:
        """Inbound replicas pause while this node restores (a replacement node's trainers wait on
        the restore; catching up its replicas can wait). Bounded, so the sender never times out."""
        with self._restore_cv:
            self._restore_cv.wait_for(lambda: self._restoring == 0, timeout=bulk.IO_TIMEOUT / 3)

    def _restore_begun(self, delta: int) -> None:
        with self._restore_cv:
            self._restoring += delta
            self._restore_cv.notify_all()

    def _bulk_get(self, sock: socket.socket, ticket: str, shard: str, piece: tuple, buf: bytearray) -> None:
        with self._lock:
            rd = self._readers.get(ticket)
        if rd is None:
            raise FailedPreconditionError("ticket: unknown or expired read ticket")
        try:
            entry = rd.man.shard(shard)
        except KeyError:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of this rank") from None
        bulk.check_piece(*piece, entry.size)
        ranges = list(bulk.runs(*piece, entry.size))
        try:
            fh = self.store.shard_path(rd.man, shard).open("rb")  # closed below (the reply needs it open)
        except FileNotFoundError:
            raise NotFoundError(f"{rd.man.job} step {rd.man.step} rank {rd.man.rank} was evicted") from None
        with fh:
            bulk.send_msg(sock, {"ok": True, "length": sum(n for _, n in ranges)})
            for start, length in ranges:
                bulk.send_range(sock, fh, start, length, buf)

    def _check_digest(self, man: Manifest, shard: str, actual: str, what: str) -> None:
        expected = man.shard(shard).checksum
        if actual != expected:
            if self.metrics:
                self.metrics.checksum_failures.labels(tier="peer").inc()
            raise DataLossError(f"checksum mismatch for {man.job}/{man.step}/rank {man.rank}/{shard} ({what}): "
                                f"expected {expected}, got {actual}")

    # ------------------------------------------------------------------------------ servicer side

    def hello(self) -> ppb.HelloResponse:
        """Identity of this daemon (Hello RPC)."""
        return ppb.HelloResponse(node_id=self.node_id, instance=self.instance, bulk_port=self._bulk.port,
                                 replicas=self.replicas)

    def local_catalog(self, job: str) -> ppb.CatalogResponse:
        """Committed ranks held here, own and replicas, for ``job`` or every job (Catalog RPC)."""
        resp = ppb.CatalogResponse(node_id=self.node_id, instance=self.instance, bulk_port=self._bulk.port)
        for j in [job] if job else self.store.jobs():
            for step, ranks in self.store.steps(j).items():
                for m in ranks.values():
                    resp.entries.append(ppb.CatalogEntry(
                        job=j, step=step, rank=m.rank, world_size=m.world_size, owner=m.node,
                        generation=m.generation, bytes=m.nbytes, created_unix=m.created))
        return resp

    async def prepare_replica(self, sender: str, manifest_json: str) -> ppb.PrepareReplicaResponse:
        """Open a staging area for a replica and issue its bulk "put" ticket (PrepareReplica RPC).

        Raises:
            InvalidArgumentError: the manifest is malformed.
            FailedPreconditionError: this node saved the rank itself (a copy never replaces it),
                or is restoring it right now.
            CapacityError: the local tier cannot hold the replica.
        """
        try:
            man = Manifest.from_json(manifest_json)
        except DataLossError as e:
            raise InvalidArgumentError(f"manifest_json: {e}") from None
        cur = self.store.get(*man.key)
        if cur is not None and cur.generation == man.generation:
            return ppb.PrepareReplicaResponse(already_committed=True)
        if man.key in self._fetching:  # a restore is bringing it in; the owner retries after
            raise FailedPreconditionError(f"{man.job} step {man.step} rank {man.rank} is being restored on "
                                          f"{self.node_id}")
        if cur is not None and cur.node == self.node_id != man.node:
            raise FailedPreconditionError(f"{man.job} step {man.step} rank {man.rank} was saved on {self.node_id}; "
                                          f"refusing a copy owned by {man.node}")
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        st = await asyncio.to_thread(self.store.begin, man.job, man.step, man.rank, man.world_size, specs)
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            self._inbound[ticket] = _Inbound(ticket, man, st, sender, {s.name: bulk.OrderedHasher(s.size)
                                                                       for s in man.shards})
        return ppb.PrepareReplicaResponse(ticket=ticket, bulk_port=self._bulk.port)

    async def commit_replica(self, ticket: str) -> int:
        """Check every shard arrived whole with its checksum, then commit (CommitReplica RPC).

        Returns:
            The bytes committed.

        Raises:
            FailedPreconditionError: unknown or expired ticket.
            InvalidArgumentError: a shard is incomplete.
            DataLossError: a checksum mismatch (the staging area is dropped).
        """
        with self._lock:
            inb = self._inbound.pop(ticket, None)
        if inb is None:
            raise FailedPreconditionError("ticket: unknown, expired or already committed replica ticket")
        man = inb.man
        try:
            for s in man.shards:
                h = inb.hashers[s.name]
                if not h.complete:
                    raise InvalidArgumentError(f"shard {s.name!r}: {h.pos} of {s.size} bytes received in order")
                self._check_digest(man, s.name, h.hexdigest(), f"replica from {inb.sender}")
            local, _ = await asyncio.to_thread(functools.partial(
                self.store.commit, inb.staging.save_id, {s.name: s.checksum for s in man.shards}, man.metadata_json,
                persist=man.persist, verify=False, node=man.node, generation=man.generation, created=man.created))
        except BaseException:
            self.store.abort(inb.staging.save_id)
            raise
        log.info("committed replica of %s step %d rank %d from %s (%d bytes)", man.job, man.step, man.rank,
                 inb.sender, man.nbytes)
        if self.node is not None:
            self.node.notify_ingested(local)
        return local.nbytes

    def abort_replica(self, ticket: str) -> None:
        """Drop an unfinished replica (AbortReplica RPC). Idempotent."""
        with self._lock:
            inb = self._inbound.pop(ticket, None)
        if inb is not None:
            self.store.abort(inb.staging.save_id)

    def open_read(self, job: str, step: int, rank: int) -> ppb.OpenReadResponse:
        """Describe a held rank and issue a bulk "get" ticket for it (OpenRead RPC).

        Raises:
            NotFoundError: the rank is not held here.
        """
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not held by node {self.node_id}")
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            self._readers[ticket] = _Reader(man, time.monotonic())
        return ppb.OpenReadResponse(manifest_json=man.to_json().decode(), ticket=ticket, bulk_port=self._bulk.port)

    async def drop_replicas(self, owner: str, job: str, step: int, ranks: Sequence[int], reason: str) -> int:
        """Remove the replicas of ``owner``'s ranks of a step (DropReplicas RPC); returns how many."""
        removed = 0
        for rank in ranks:
            man = self.store.get(job, step, rank)
            if man is not None and man.node == owner != self.node_id:
                removed += await asyncio.to_thread(self.store.remove_rank, job, step, rank,
                                                   f"replica dropped by its owner {owner} ({reason})")
        return removed

    # ------------------------------------------------------------------------------ garbage

    async def _collect_garbage(self) -> None:
        """Drop surplus replicas (placement holds R copies without us) and retired ones (the owner
        evicted the step and ``keep_local`` newer steps are complete)."""
        nodes = set(self._peers) | {self.node_id}
        up = {n for n, p in self._peers.items() if p.up} | {self.node_id}
        drop: list[tuple[Manifest, str]] = []
        for job in self.store.jobs():
            complete = self.store.complete_steps(job)
            for step, ranks in self.store.steps(job).items():
                for man in ranks.values():
                    if man.node == self.node_id:
                        continue
                    wanted = self._copies_wanted(man)
                    placement = ring_placement(man.node, nodes, up, wanted)
                    confirmed = [n for n in placement if n != self.node_id and
                                 (h := self._peers[n].held.get(man.key)) is not None and h.generation == man.generation]
                    owner = self._peers.get(man.node)
                    newer = sum(1 for s in complete if s > step)
                    if self.node_id not in placement and self.replicas and len(confirmed) >= wanted:
                        drop.append((man, f"surplus copy: held by {','.join(confirmed)}"))
                    elif owner is not None and owner.up and man.key not in owner.held and newer >= self.store.keep_local:
                        drop.append((man, f"retired: owner {man.node} evicted it"))
        for man, reason in drop:
            await asyncio.to_thread(self.store.remove_rank, man.job, man.step, man.rank, reason)

    # ------------------------------------------------------------------------------ RemoteTier

    async def _peer_catalogs(self, job: str) -> list[tuple[_Peer, list[ppb.CatalogEntry]]]:
        """Ask every live peer (and any not contacted yet) for its committed ranks of ``job``,
        updating the cached catalogs."""
        peers = [p for p in self._peers.values() if p.up or p.refreshed < 0]
        req = ppb.CatalogRequest(job=job, node_id=self.node_id)
        results = await asyncio.gather(*(self._call(p, p.stub.Catalog, req, RPC_TIMEOUT) for p in peers),
                                       return_exceptions=True)
        out = []
        for p, res in zip(peers, results):
            if isinstance(res, TierckptError):
                self._mark_down(p, res)
                continue
            if isinstance(res, BaseException):
                raise res
            if not p.up:
                self._mark_up(p)
            held = {k: v for k, v in p.held.items() if k[0] != job}
            held.update({(e.job, e.step, e.rank): _Held(e.world_size, e.owner, e.generation, e.bytes, e.created_unix)
                         for e in res.entries})
            p.held = held
            out.append((p, list(res.entries)))
        return out

    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        merged: dict[int, dict[int, RankCopy]] = {}
        for p, entries in await self._peer_catalogs(job):
            for e in entries:
                old = merged.setdefault(e.step, {}).get(e.rank)
                nodes = tuple(sorted(set(old.nodes if old else ()) | {p.node_id}))
                merged[e.step][e.rank] = RankCopy(e.world_size, nodes, e.bytes,
                                                  min(old.created, e.created_unix) if old else e.created_unix)
        return merged

    async def fetch(self, job: str, step: int, rank: int) -> Manifest:
        check_job(job)
        check_step(step)
        cands = [(p, e) for p, entries in await self._peer_catalogs(job) for e in entries
                 if e.step == step and e.rank == rank]
        if not cands:
            raise NotFoundError(f"{job} step {step} rank {rank} is not held by any live peer")
        owner = cands[0][1].owner
        ring = ring_placement(owner, set(self._peers) | {self.node_id}, set(self._peers), len(self._peers))
        cands.sort(key=lambda c: (-c[1].created_unix, c[0].node_id != owner,
                                  ring.index(c[0].node_id) if c[0].node_id in ring else len(ring)))
        self._restore_begun(1)
        self._fetching.add((job, step, rank))
        try:
            return await self._fetch_from(cands, job, step, rank)
        finally:
            self._fetching.discard((job, step, rank))
            self._restore_begun(-1)

    async def _fetch_from(self, cands: list, job: str, step: int, rank: int) -> Manifest:
        errors: list[str] = []
        lost = False
        for p, _ in cands:
            try:
                return await self._pull(p, job, step, rank)
            except NotFoundError as e:
                errors.append(f"{p.node_id}: {e}")
            except DataLossError as e:
                lost = True
                errors.append(f"{p.node_id}: {e}")
                log.error("copy of %s step %d rank %d on %s is corrupt; trying the next: %s", job, step, rank,
                          p.node_id, e)
            except (UnavailableError, DeadlineExceededError, FailedPreconditionError) as e:
                errors.append(f"{p.node_id}: {e}")
                log.warning("copy of %s step %d rank %d on %s unavailable; trying the next: %s", job, step, rank,
                            p.node_id, e)
        msg = f"{job} step {step} rank {rank}: every peer copy failed: " + "; ".join(errors)
        raise DataLossError(msg) if lost else UnavailableError(msg)

    async def _pull(self, p: _Peer, job: str, step: int, rank: int) -> Manifest:
        """Copy one rank from peer ``p`` into the local store, verifying every checksum."""
        t0 = time.perf_counter()
        resp = await self._call(p, p.stub.OpenRead,
                                ppb.OpenReadRequest(requester=self.node_id, job=job, step=step, rank=rank), RPC_TIMEOUT)
        man = Manifest.from_json(resp.manifest_json)
        if man.key != (job, step, rank):
            raise DataLossError(f"peer {p.node_id} described {man.key} instead of {(job, step, rank)}")
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        st = await asyncio.to_thread(self.store.begin, job, step, rank, man.world_size, specs)
        try:
            files = {n: (str(f.path), f.size) for n, f in st.files.items()}
            hashers = {s.name: bulk.OrderedHasher(s.size) for s in man.shards}
            await self._run_streams(p, resp.bulk_port, resp.ticket, "get",
                                    plan_pieces([(s.name, s.size) for s in man.shards]), files, hashers)
            for s in man.shards:
                if not hashers[s.name].complete:
                    raise UnavailableError(f"peer {p.node_id} sent {hashers[s.name].pos} of {s.size} bytes of {s.name}")
                self._check_digest(man, s.name, hashers[s.name].hexdigest(), f"copy on {p.node_id}")
            local, _ = await asyncio.to_thread(functools.partial(
                self.store.commit, st.save_id, {s.name: s.checksum for s in man.shards}, man.metadata_json,
                persist=man.persist, verify=False, node=man.node, generation=man.generation, created=man.created))
        except BaseException:
            self.store.abort(st.save_id)
            raise
        elapsed = time.perf_counter() - t0
        log.info("fetched %s step %d rank %d from %s: %d bytes in %.3fs (%.2f GB/s)", job, step, rank, p.node_id,
                 man.nbytes, elapsed, man.nbytes / max(elapsed, 1e-9) / 1e9)
        if self.node is not None:
            self.node.notify_ingested(local)
        return local

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not committed on node {self.node_id}")
        if not self.replicas:
            return []
        st = self._reps.get(man.key)
        if st is None or st.man.generation != man.generation or (st.event.is_set() and not st.reached):
            st = self._ensure(man)
        await st.event.wait()
        if st.reached:
            return list(st.holders)
        raise st.error

    def is_up(self, node_id: str) -> bool:
        """Whether ``node_id`` is a peer that answered its last health check (this node's view)."""
        p = self._peers.get(node_id)
        return p is not None and p.up

    def live_holders(self, man: Manifest) -> list[str]:
        """Live peers whose last catalog lists this generation of the rank (sorted ids)."""
        return sorted(n for n, p in self._peers.items()
                      if p.up and (h := p.held.get(man.key)) is not None and h.generation == man.generation)

    def status(self) -> dict:
        pending = [st for st in self._reps.values() if not st.reached and not st.event.is_set()]
        return {
            "peers": [{"node_id": p.node_id, "address": p.address, "up": p.up, "last_seen_unix": p.last_seen,
                       "last_error": p.last_error} for p in sorted(self._peers.values(), key=lambda p: p.node_id)],
            "replicas": self.replicas,
            "pending_ranks": len(pending),
            "lag_seconds": max((time.monotonic() - st.since for st in pending), default=0.0),
            "bulk_port": self._bulk.port,
        }


# ----------------------------------------------------------------------------------- servicer

class PeerServicer(ppb_grpc.PeerServicer):
    """Thin servicer of the Peer service: validate, delegate to :class:`PeerTier`."""

    def __init__(self, tier: PeerTier) -> None:
        self.tier = tier

    @_rpc
    async def Hello(self, request: ppb.HelloRequest, context) -> ppb.HelloResponse:
        return self.tier.hello()

    @_rpc
    async def Catalog(self, request: ppb.CatalogRequest, context) -> ppb.CatalogResponse:
        if request.job:
            check_job(request.job)
        return self.tier.local_catalog(request.job)

    @_rpc
    async def PrepareReplica(self, request: ppb.PrepareReplicaRequest, context) -> ppb.PrepareReplicaResponse:
        if not request.manifest_json:
            raise InvalidArgumentError("manifest_json: required")
        return await self.tier.prepare_replica(request.sender, request.manifest_json)

    @_rpc
    async def CommitReplica(self, request: ppb.CommitReplicaRequest, context) -> ppb.CommitReplicaResponse:
        if not request.ticket:
            raise InvalidArgumentError("ticket: required")
        return ppb.CommitReplicaResponse(bytes=await self.tier.commit_replica(request.ticket))

    @_rpc
    async def AbortReplica(self, request: ppb.AbortReplicaRequest, context) -> ppb.AbortReplicaResponse:
        await asyncio.to_thread(self.tier.abort_replica, request.ticket)
        return ppb.AbortReplicaResponse()

    @_rpc
    async def OpenRead(self, request: ppb.OpenReadRequest, context) -> ppb.OpenReadResponse:
        check_job(request.job)
        check_step(request.step)
        return self.tier.open_read(request.job, request.step, request.rank)

    @_rpc
    async def DropReplicas(self, request: ppb.DropReplicasRequest, context) -> ppb.DropReplicasResponse:
        check_job(request.job)
        check_node(request.owner, "owner")
        removed = await self.tier.drop_replicas(request.owner, request.job, request.step, list(request.ranks),
                                                request.reason)
        return ppb.DropReplicasResponse(removed=removed)
