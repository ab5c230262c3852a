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
import collections
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from tierckpt.common.names import check_node
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import FailedPreconditionError, TierckptError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..config import DaemonConfig
from ..knobs import KNOBS
from . import Key

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

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def holds(self, key: Key, generation: str) -> bool:
        h = self.held.get(key)
        return h is not None and h.generation == generation


def held_from(entries: Any) -> dict[Key, Held]:
    return {(e.job, e.step, e.rank): Held(e.world_size, e.owner, e.generation, e.bytes, e.created_unix)
            for e in entries}


class Membership:
    """The peers of this node and what it knows of them.

    Args:
        config: peers, peers_dns, node_id, max_message_bytes.
        metrics: optional :class:`~tierckptd.metrics.Metrics` (``peer_up``).
        credentials: gRPC channel credentials under mTLS, else None.
    """

    def __init__(self, config: DaemonConfig, metrics: Any = None, credentials: Any = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.metrics = metrics
        self._creds = credentials
        self.peers: dict[str, PeerInfo] = {p.node_id: PeerInfo(p.node_id, p.host, p.port)
                                           for p in config.other_peers()}
        self._dns: tuple[str, int] | None = None
        if config.peers_dns:
            name, _, port = config.peers_dns.rpartition(":")
            self._dns = (name, int(port))
        self._self_addrs: set[str] = set()
        self._index: dict[tuple[str, int], frozenset[int]] = {}
        self._down_since: dict[str, float] = {}

    # ------------------------------------------------------------------------------ channels

    def connect_all(self) -> None:
        for p in self.peers.values():
            self._connect(p)

    def _connect(self, p: PeerInfo) -> None:
        opts = list(_CHANNEL_OPTIONS) + [("grpc.max_receive_message_length", self.config.max_message_bytes),
                                         ("grpc.max_send_message_length", self.config.max_message_bytes)]
        if self._creds is not None:
            if p.tls_name:
                opts.append(("grpc.ssl_target_name_override", p.tls_name))
            p.channel = grpc.aio.secure_channel(p.address, self._creds, options=opts)
        else:
            p.channel = grpc.aio.insecure_channel(p.address, options=opts)
        p.stub = ppb_grpc.PeerStub(p.channel)

    async def close(self) -> None:
        for p in self.peers.values():
            if p.channel is not None:
                await p.channel.close()

    async def call(self, p: PeerInfo, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call ``method`` (a Peer RPC name) on ``p``; gRPC errors become tierckpt errors naming the peer."""
        try:
            return await getattr(p.stub, method)(request, timeout=KNOBS.rpc_timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"peer {p.node_id} ({p.address})") from None

    # ------------------------------------------------------------------------------ health

    def mark_up(self, p: PeerInfo) -> None:
        if not p.up:
            log.info("peer %s (%s) is up", p.node_id, p.address)
            p.last_error = ""
        p.up, p.last_seen = True, time.time()
        self._down_since.pop(p.node_id, None)
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(1)

    def mark_down(self, p: PeerInfo, err: BaseException) -> None:
        p.last_error = str(err)
        if p.up:
            log.warning("peer %s (%s) is down: %s", p.node_id, p.address, err)
        p.up = False
        self._down_since.setdefault(p.node_id, time.monotonic())
        if self.metrics:
            self.metrics.peer_up.labels(peer=p.node_id).set(0)

    async def refresh_peer(self, p: PeerInfo) -> bool:
        """Read one peer's catalog; returns True if it came back or restarted."""
        try:
            resp = await self.call(p, "Catalog", ppb.CatalogRequest(node_id=self.node_id))
        except TierckptError as e:
            self.mark_down(p, e)
            return False
        if resp.node_id != p.node_id:
            self.mark_down(p, FailedPreconditionError(f"{p.address} answers as node {resp.node_id!r}"))
            return False
        came_back = not p.up or (p.instance and p.instance != resp.instance)
        p.held = held_from(resp.entries)
        p.instance, p.bulk_port, p.refreshed = resp.instance, resp.bulk_port, time.monotonic()
        self.mark_up(p)
        return bool(came_back)

    async def refresh(self) -> tuple[bool, bool]:
        """Refresh every peer. Returns (a peer came back or restarted, cluster completeness changed)."""
        if self._dns:
            await self._discover()
        results = await asyncio.gather(*(self.refresh_peer(p) for p in list(self.peers.values())))
        return any(results), self._rebuild_index()

    async def job_catalogs(self, job: str) -> list[tuple[PeerInfo, list[Any]]]:
        """Ask every live peer (and any not contacted yet) for its committed ranks of ``job``,
        updating the cached catalogs."""
        peers = [p for p in self.peers.values() if p.up or p.refreshed < 0]
        req = ppb.CatalogRequest(job=job, node_id=self.node_id)
        results = await asyncio.gather(*(self.call(p, "Catalog", req) for p in peers), return_exceptions=True)
        out = []
        for p, res in zip(peers, results):
            if isinstance(res, TierckptError):
                self.mark_down(p, res)
                continue
            if isinstance(res, BaseException):
                raise res
            if not p.up:
                self.mark_up(p)
            held = {k: v for k, v in p.held.items() if k[0] != job}
            held.update(held_from(res.entries))
            p.held = held
            out.append((p, list(res.entries)))
        return out

    # ------------------------------------------------------------------------------ discovery

    async def _discover(self) -> None:
        """Resolve --peers-dns and learn the node id behind each new address."""
        assert self._dns is not None
        name, port = self._dns
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("peers_dns: cannot resolve %s: %s", name, e)
            return
        known = {p.host for p in self.peers.values()} | self._self_addrs
        for addr in sorted({i[4][0] for i in infos} - known):
            await self._probe(addr, port, name)

    async def _probe(self, addr: str, port: int, name: str) -> None:
        probe = PeerInfo("?", addr, port, tls_name=name if self._creds else None)
        self._connect(probe)
        try:
            hello = await self.call(probe, "Hello", ppb.HelloRequest(node_id=self.node_id))
            check_node(hello.node_id)
        except TierckptError as e:
            log.debug("peers_dns: %s did not answer: %s", addr, e)
            await probe.channel.close()
            return
        if hello.node_id == self.node_id:
            self._self_addrs.add(addr)
            await probe.channel.close()
            return
        old = self.peers.get(hello.node_id)
        if old is not None and old.channel is not None:
            await old.channel.close()
            log.info("peers_dns: node %s moved from %s to %s", hello.node_id, old.host, addr)
        else:
            log.info("peers_dns: discovered node %s at %s", hello.node_id, addr)
        probe.node_id = hello.node_id
        self.peers[hello.node_id] = probe

    # ------------------------------------------------------------------------------ views

    def ids(self) -> set[str]:
        """Every node id of the ring, this node's included."""
        return set(self.peers) | {self.node_id}

    def up_ids(self, *, include_self: bool = False) -> set[str]:
        up = {n for n, p in self.peers.items() if p.up}
        return up | {self.node_id} if include_self else up

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
        idx: dict[tuple[str, int], set[int]] = collections.defaultdict(set)
        for p in self.peers.values():
            if p.up:
                for job, step, rank in p.held:
                    idx[(job, step)].add(rank)
        new = {k: frozenset(v) for k, v in idx.items()}
        changed = new != self._index
        self._index = new
        return changed

    def is_complete(self, job: str, step: int, world_size: int, ranks: set[int]) -> bool:
        """Cluster-aware completeness for local retention: every rank held here or by a live peer."""
        if len(ranks) >= world_size:
            return True
        return len(ranks | self._index.get((job, step), frozenset())) >= world_size

    def status(self) -> list[dict]:
        return [{"node_id": p.node_id, "address": p.address, "up": p.up, "last_seen_unix": p.last_seen,
                 "last_error": p.last_error} for p in sorted(self.peers.values(), key=lambda p: p.node_id)]
