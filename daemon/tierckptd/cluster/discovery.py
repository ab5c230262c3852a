"""Peer discovery from DNS: the A/AAAA records of a name (a Kubernetes headless Service).

Every refresh resolves the name; each address not known yet is asked for its node id with
``Hello`` (under mTLS its certificate must carry the name), ``KNOBS.fanout`` at a time. An
address that does not answer is asked again with backoff (up to ``KNOBS.down_retry_max``), so a
cluster that starts slowly does not cost a Hello per missing node per second.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING

from tierckpt.common.names import check_node
from tierckpt.errors import TierckptError
from tierckpt.v1 import peer_pb2 as ppb

from ..knobs import KNOBS

if TYPE_CHECKING:
    from .membership import Membership, PeerInfo

__all__ = ["DnsDiscovery"]

log = logging.getLogger(__name__)


class DnsDiscovery:
    def __init__(self, membership: Membership, peers_dns: str) -> None:
        name, _, port = peers_dns.rpartition(":")
        self.name, self.port = name, int(port)
        self.membership = membership
        self._self_addrs: set[str] = set()
        self._failed: dict[str, tuple[int, float]] = {}  # address -> (failures, not before)

    async def discover(self) -> None:
        """Resolve the name and learn the node id behind each new address."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("peers_dns: cannot resolve %s: %s", self.name, e)
            return
        now = time.monotonic()
        known = {p.host for p in self.membership.peers.values()} | self._self_addrs
        new = sorted(a for a in {str(i[4][0]) for i in infos} - known if self._failed.get(a, (0, 0.0))[1] <= now)
        sem = asyncio.Semaphore(max(1, KNOBS.fanout))

        async def probe(addr: str) -> None:
            async with sem:
                await self._probe(addr)

        await asyncio.gather(*(probe(a) for a in new))

    async def _probe(self, addr: str) -> None:
        from .membership import PeerInfo

        m = self.membership
        p: PeerInfo = PeerInfo("?", addr, self.port, tls_name=self.name if m.tls else None)
        m.connect(p)
        try:
            hello = await m.call(p, "Hello", ppb.HelloRequest(node_id=m.node_id))
            check_node(hello.node_id)
        except TierckptError as e:
            fails = self._failed.get(addr, (0, 0.0))[0] + 1
            delay = min(KNOBS.down_retry_max, KNOBS.refresh_interval * 2 ** min(fails, 16))
            self._failed[addr] = (fails, time.monotonic() + delay)
            log.debug("peers_dns: %s did not answer: %s", addr, e)
            await p.channel.close()
            return
        self._failed.pop(addr, None)
        if hello.node_id == m.node_id:
            self._self_addrs.add(addr)
            await p.channel.close()
            return
        p.node_id = hello.node_id
        await m.adopt(p)
