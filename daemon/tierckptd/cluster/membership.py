"""The peer set as this node sees it: discovery, health, down-since and cached catalogs.

Peers come from the static ``--peers`` list and, with ``--peers-dns NAME:PORT``, from the A/AAAA
records of NAME (each new address is asked for its node id with ``Hello``; under mTLS its
certificate must carry NAME). Every :data:`~tierckptd.knobs.Knobs.refresh_interval` the peer
tier calls :meth:`Membership.refresh`: each peer's catalog is read (the health check); a peer
that fails a call is down until it answers again. The catalogs back :meth:`is_complete` (the
cluster-aware completeness used by local retention) and :meth:`live_holders`.

This is the one home of "is that node up", "since when is it down" and "who holds that rank":
both remote tiers read it through :class:`~tierckptd.cluster.ClusterView`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import DeadlineExceededError, FailedPreconditionError, TierckptError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..config import DaemonConfig
from ..knobs import KNOBS
from . import Key, ring
from .completeness import Completeness
from .discovery import DnsDiscovery

__all__ = ["Held", "PeerInfo", "Membership"]

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class Held(NamedTuple):
    """One committed rank in a peer's catalog."""

    world_size: int
    owner: str
    generation: str
    nbytes: int
    created: float
    job_owner: str = ""


@dataclass(eq=False)
class PeerInfo:
    """A peer daemon: its address, channel, health and last catalog."""

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
    held: dict[Key, Held] = field(default_factory=dict)
    version: int = 0  # the peer's catalog version that ``held`` reflects (0: none)
    contacted: bool = False  # answered or failed at least once
    failures: int = 0  # consecutive failed health checks
    next_try: float = 0.0  # monotonic time before which a down peer is not asked again
    clock_skew: float | None = None  # its wall clock minus ours at the last health check (None: unknown)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def holds(self, key: Key, generation: str) -> bool:
        h = self.held.get(key)
        return h is not None and h.generation == generation


def held_from(entries: Any) -> dict[Key, Held]:
    return {(e.job, e.step, e.rank): Held(e.world_size, e.owner, e.generation, e.bytes, e.created_unix, e.job_owner)
            for e in entries}


class Membership:
    """The peers of this node and what it knows of them.

    Args:
        config: peers, peers_dns, node_id, max_message_bytes.
        metrics: optional :class:`~tierckptd.metrics.Metrics` (``peer_up``).
        credentials: gRPC channel credentials under mTLS, else None.
    """

    def __init__(self, config: DaemonConfig, metrics: Any = None, tls_source: Any = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.metrics = metrics
        self._tls = tls_source  # a tls.TlsReloader under mTLS
        self._tls_generation = tls_source.generation if tls_source is not None else 0
        self._creds = tls_source.channel_credentials() if tls_source is not None else None
        self.peers: dict[str, PeerInfo] = {p.node_id: PeerInfo(p.node_id, p.host, p.port)
                                           for p in config.other_peers()}
        self._dns = DnsDiscovery(self, config.peers_dns) if config.peers_dns else None
        self._completeness = Completeness(self.node_id)
        self._down_since: dict[str, float] = {}
        self._returned = False  # a peer came up or restarted since the last refresh() (any path)
        self.also_watch: set[str] = set()  # watched besides the ring neighbourhood (the parity group)

    # ------------------------------------------------------------------------------ channels

    def connect_all(self) -> None:
        for p in self.peers.values():
            self.connect(p)

    def connect(self, p: PeerInfo) -> None:
        opts: list[tuple[str, Any]] = [*_CHANNEL_OPTIONS,
                                       ("grpc.max_receive_message_length", self.config.max_message_bytes),
                                       ("grpc.max_send_message_length", self.config.max_message_bytes)]
        if self._creds is not None:
            if p.tls_name:
                opts.append(("grpc.ssl_target_name_override", p.tls_name))
            p.channel = grpc.aio.secure_channel(p.address, self._creds, options=opts)
        else:
            p.channel = grpc.aio.insecure_channel(p.address, options=opts)
        p.stub = ppb_grpc.PeerStub(p.channel)

    async def _rotate(self) -> None:
        """Rebuild the peer channels when the TLS files changed (rotation without a restart)."""
        if self._tls is None or self._tls.generation == self._tls_generation:
            return
        self._tls_generation = self._tls.generation
        self._creds = self._tls.channel_credentials()
        log.info("peer channels rebuilt with the reloaded certificates (generation %d)", self._tls_generation)
        for p in self.peers.values():
            old = p.channel
            self.connect(p)
            if old is not None:
                await old.close()

    async def close(self) -> None:
        for p in self.peers.values():
            if p.channel is not None:
                await p.channel.close()

    async def call(self, p: PeerInfo, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call ``method`` (a Peer RPC name) on ``p``; gRPC errors become tierckpt errors naming the peer."""
        if self.metrics:
            self.metrics.peer_calls.labels(peer=p.node_id).inc()
        try:
            return await getattr(p.stub, method)(request, timeout=KNOBS.rpc_timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"peer {p.node_id} ({p.address})") from None

    # ------------------------------------------------------------------------------ health

    def mark_up(self, p: PeerInfo) -> None:
        if not p.up:
            log.info("peer %s (%s) is up", p.node_id, p.address)
            p.last_error = ""
            self._returned = True
        p.up, p.last_seen, p.contacted, p.failures, p.next_try = True, time.time(), True, 0, 0.0
        self._down_since.pop(p.node_id, None)
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(1)

    def mark_down(self, p: PeerInfo, err: BaseException) -> None:
        p.last_error = str(err)
        if p.up:
            log.warning("peer %s (%s) is down: %s", p.node_id, p.address, err)
        p.up, p.contacted = False, True
        p.failures += 1
        p.next_try = time.monotonic() + min(KNOBS.down_retry_max, KNOBS.refresh_interval * 2 ** min(p.failures, 16))
        self._down_since.setdefault(p.node_id, time.monotonic())
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(0)

    async def refresh_peer(self, p: PeerInfo) -> bool:
        """Bring one peer's catalog up to date (a delta when possible); returns True if it came
        back or restarted."""
        req = ppb.CatalogRequest(node_id=self.node_id, since_version=p.version if p.up else 0,
                                 since_instance=p.instance if p.up else "")
        sent = time.time()
        try:
            resp = await self.call(p, "Catalog", req)
        except TierckptError as e:
            self.mark_down(p, e)
            return False
        if resp.now_unix:  # an older peer leaves it 0
            p.clock_skew = resp.now_unix - (sent + time.time()) / 2
        if resp.node_id != p.node_id:
            self.mark_down(p, FailedPreconditionError(f"{p.address} answers as node {resp.node_id!r}"))
            return False
        came_back = not p.up or (p.instance and p.instance != resp.instance)
        self._returned = self._returned or bool(came_back)
        if resp.delta and not came_back:
            for k in resp.removed:
                p.held.pop((k.job, k.step, k.rank), None)
            p.held.update(held_from(resp.entries))
        else:
            p.held = held_from(resp.entries)
        p.instance, p.bulk_port, p.refreshed, p.version = resp.instance, resp.bulk_port, time.monotonic(), resp.version
        self.mark_up(p)
        return bool(came_back)

    async def refresh(self) -> tuple[bool, bool]:
        """Refresh the watched neighbourhood (:meth:`watched`). Returns (a peer came back or
        restarted since the last call, cluster completeness changed)."""
        await self._rotate()
        if self._dns:
            await self._dns.discover()
        watched = self.watched()
        if self.metrics:
            self.metrics.known_peers(sorted(watched))  # series at zero, so rate() sees the first failure
        for n, p in self.peers.items():
            if n not in watched and p.held:
                p.held, p.version = {}, 0  # left the neighbourhood: forget its catalog
        now = time.monotonic()
        due = [self.peers[n] for n in sorted(watched) if self.peers[n].up or self.peers[n].next_try <= now]
        await asyncio.gather(*(self.refresh_peer(p) for p in due))
        # Came back through any path (this refresh, a replication's probe, an operator fan-out):
        # the caller catches up once for it.
        returned, self._returned = self._returned, False
        return returned, self._rebuild_index()

    def watched(self) -> set[str]:
        """The neighbourhood this node keeps in touch with (:func:`ring.watched`)."""
        return ring.watched(self.node_id, self.ids(), self.maybe_up(), self.config.replicas,
                            KNOBS.max_widen) | (self.also_watch & set(self.peers))

    def maybe_up(self) -> set[str]:
        """The peers not known to be down (up, or never contacted yet)."""
        return {n for n, p in self.peers.items() if p.up or not p.contacted}

    async def fan_out(self, method: str, request: Any, nodes: set[str] | None = None
                      ) -> tuple[list[tuple[PeerInfo, Any]], list[str]]:
        """Call ``method`` on peers (``nodes``, default every known peer), ``KNOBS.fanout`` at a
        time, within ``KNOBS.fanout_deadline`` seconds; health is updated from the outcomes.

        Returns:
            (answers, the ids of peers that did not answer in time or failed).
        """
        targets = sorted(self.peers if nodes is None else nodes & set(self.peers))
        sem = asyncio.Semaphore(max(1, KNOBS.fanout))
        deadline = time.monotonic() + KNOBS.fanout_deadline

        async def ask(p: PeerInfo) -> Any:
            async with sem:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(f"peer {p.node_id}: not asked before the deadline")
                return await self.call(p, method, request, min(left, KNOBS.rpc_timeout))

        results = await asyncio.gather(*(ask(self.peers[n]) for n in targets), return_exceptions=True)
        out, missed = [], []
        for n, res in zip(targets, results):
            p = self.peers[n]
            if isinstance(res, TierckptError):
                missed.append(n)
                if not isinstance(res, DeadlineExceededError) or p.up:
                    self.mark_down(p, res)
                continue
            if isinstance(res, BaseException):
                raise res
            if not p.up:
                self.mark_up(p)
            out.append((p, res))
        if missed:
            log.info("%s: %d of %d peers did not answer within %.1fs: %s", method, len(missed), len(targets),
                     KNOBS.fanout_deadline, ",".join(missed[:10]) + (" ..." if len(missed) > 10 else ""))
        return out, missed

    async def job_catalogs(self, job: str, nodes: set[str] | None = None
                           ) -> tuple[list[tuple[PeerInfo, list[Any]]], list[str]]:
        """Every peer's (or ``nodes``') committed ranks of ``job``: see :meth:`fan_out`."""
        answers, missed = await self.fan_out("Catalog", ppb.CatalogRequest(job=job, node_id=self.node_id), nodes)
        return [(p, list(res.entries)) for p, res in answers], missed

    # ------------------------------------------------------------------------------ views

    def ids(self) -> set[str]:
        """Every node id of the ring, this node's included."""
        return set(self.peers) | {self.node_id}

    def up_ids(self, *, include_self: bool = False) -> set[str]:
        up = {n for n, p in self.peers.items() if p.up}
        return up | {self.node_id} if include_self else up

    def heard_from(self, node_id: str) -> None:
        """A peer called this node: if it was down, ask it again at the next refresh (no backoff)."""
        p = self.peers.get(node_id)
        if p is not None and not p.up:
            p.next_try = 0.0

    async def adopt(self, p: PeerInfo) -> None:
        """Add (or move) a discovered peer whose channel is already connected."""
        old = self.peers.get(p.node_id)
        if old is not None and old.channel is not None:
            await old.channel.close()
            log.info("peers_dns: node %s moved from %s to %s", p.node_id, old.host, p.host)
        else:
            log.info("peers_dns: discovered node %s at %s", p.node_id, p.host)
        self.peers[p.node_id] = p

    @property
    def tls(self) -> bool:
        return self._creds is not None

    def get(self, node_id: str) -> PeerInfo | None:
        return self.peers.get(node_id)

    def is_up(self, node_id: str) -> bool:
        p = self.peers.get(node_id)
        return p is not None and p.up

    def down_for(self, node_id: str) -> float:
        if self.is_up(node_id):
            return 0.0
        since = self._down_since.setdefault(node_id, time.monotonic())
        return time.monotonic() - since

    def live_holders(self, key: Key, generation: str) -> list[str]:
        return sorted(n for n, p in self.peers.items() if p.up and p.holds(key, generation))

    def newer_elsewhere(self, key: Key, created: float) -> bool:
        """Whether a live peer holds a newer save of the rank than one created at ``created``."""
        return any(p.up and (h := p.held.get(key)) is not None and h.created > created for p in self.peers.values())

    def owner_holds(self, owner: str, key: Key) -> bool:
        """Whether ``owner`` is up and its last catalog lists the rank."""
        p = self.peers.get(owner)
        return p is not None and p.up and key in p.held

    def _rebuild_index(self) -> bool:
        return self._completeness.rebuild(self.peers, self.watched())

    def is_complete(self, job: str, step: int, world_size: int, ranks: set[int]) -> bool:
        """Cluster-aware completeness for local retention (see :meth:`.completeness.Completeness.is_complete`)."""
        return self._completeness.is_complete(job, step, world_size, ranks)

    def note_own(self, job: str, rank: int) -> None:
        """A rank of ``job`` was saved on this node (its owner); completeness expects it."""
        self._completeness.note_own(job, rank)

    def status(self) -> list[dict]:
        """The watched neighbourhood's health (the other peers are not contacted in the background)."""
        watched = self.watched()
        return [{"node_id": p.node_id, "address": p.address, "up": p.up, "last_seen_unix": p.last_seen,
                 "last_error": p.last_error, "clock_skew_seconds": p.clock_skew or 0.0,
                 "clock_skew_known": p.clock_skew is not None}
                for p in sorted(self.peers.values(), key=lambda p: p.node_id) if p.node_id in watched]
