"""Decoding a lost chunk on the restoring node from blocks pulled over the bulk data channel.

gRPC byte streams reach about a third of a raw socket's throughput (see :mod:`..peer.bulk`), so
a rebuild that moved its blocks as gRPC messages took about three times as long as a replica
fetch of the same rank. Here every block a chunk needs (XOR: the slot and the slot's other
members' chunks; Reed-Solomon: the other members' data blocks) comes over the bulk channel, all
sources of all chunks at once, each on its own connection:

- a member's chunk: ``OpenRead`` on its owner (a read ticket; the manifest it describes must be
  the member's, same generation) and one bulk "get" per shard span of the chunk;
- an XOR slot: ``OpenSlotRead`` on its holder (a ticket for the slot file, its size, checksum
  and members).

XOR decoding happens as data arrives (:class:`Windows`): each source delivers its bytes in
order, window by window; a window every covering source has added is written into the staging
file and freed. The slot is hashed on receipt and checked against its checksum before anything
is committed; the members' chunks cannot be checked alone (a shard's checksum covers the whole
shard), so the rebuilt rank is checked against its manifest before it is served, as before.

Every length a peer states is bounded by what the MAC-checked manifests imply; a peer that sends
more, fewer or other bytes fails the chunk.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from tierckpt.errors import DataLossError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking
from ..peer import bulk
from .ranges import spans
from .xor import xor_into

__all__ = ["W", "Windows", "Into", "Pulls", "Source", "fd_recv"]

W = bulk.BUF_BYTES
"""Window: the unit a source delivers and the accumulator XORs (one receive buffer)."""

Source = Callable[["Into"], None]
"""A blocking function delivering a block's bytes, in order, to an :class:`Into`."""


class Windows:
    """The XOR of several sources of one chunk of ``length`` bytes, window by window.

    ``covers[i]``: how many leading bytes of the chunk source i contributes. A window is complete
    once every source covering it added its bytes; it is then handed to ``write(offset, data)``
    and freed, so memory holds only the windows still waiting for a slower source.

    ``window``: bytes per window (``W`` unless given). A protector decoding for a restorer that
    pulls the result as it is written (:mod:`.farside`) uses smaller ones: the restorer's stream
    trails the slowest source by about one window."""

    def __init__(self, length: int, covers: list[int], write: Callable[[int, Any], None], window: int = W) -> None:
        self.length, self.write, self.w = length, write, window
        self.need = [sum(1 for c in covers if c > w * window) for w in range(-(-length // window))]
        self.done = 0
        self._lock = threading.Lock()
        self._acc: dict[int, tuple[bytearray, list[int], threading.Lock]] = {}

    def add(self, w: int, data: memoryview) -> None:
        if not 0 <= w < len(self.need) or len(data) > min(self.w, self.length - w * self.w):
            raise DataLossError(f"window {w} of a {self.length}-byte chunk got {len(data)} bytes")
        with self._lock:
            entry = self._acc.get(w)
            if entry is None:
                entry = self._acc[w] = (bytearray(), [0], threading.Lock())
        acc, count, lock = entry
        with lock:
            if not acc:  # the first to arrive: copied (no zero fill unless it is short)
                acc.extend(data)
                if len(acc) < min(self.w, self.length - w * self.w):
                    acc.extend(bytes(min(self.w, self.length - w * self.w) - len(acc)))
            else:
                xor_into(acc, data)
            count[0] += 1
            complete = count[0] == self.need[w]
        if complete:
            with self._lock:
                del self._acc[w]
            self.write(w * self.w, acc)
            with self._lock:
                self.done += 1

    def check(self) -> None:
        """Raise unless every window was completed and written."""
        if self.done != len(self.need):
            raise UnavailableError(f"{len(self.need) - self.done} windows of a {self.length}-byte chunk are "
                                   "incomplete")


class Into:
    """One source's bytes, in order: the first ``useful`` go to ``add(window, data)`` (whole
    windows), any after them to ``tail`` (the rest of a slot, to hash) or nowhere."""

    def __init__(self, add: Callable[[int, memoryview], None], hasher: Any = None, window: int = W) -> None:
        self.add, self.hasher, self.w = add, hasher, window
        self.pos = 0
        self.fill = 0
        self.buf = bytearray(window)
        self.moved = 0  # bytes received over the network

    def useful(self, recv: Callable[[memoryview], None], n: int) -> None:
        view = memoryview(self.buf)
        while n > 0:
            k = min(n, self.w - self.fill)
            part = view[self.fill:self.fill + k]
            recv(part)
            if self.hasher is not None:
                self.hasher.update(part)
            self.fill += k
            n -= k
            if self.fill == self.w:
                self.flush()

    def extra(self, recv: Callable[[memoryview], None], n: int) -> None:
        """``n`` bytes past the useful ones: hashed (a slot's padding) or dropped."""
        scratch = memoryview(bytearray(min(n, 1 << 20))) if n else memoryview(b"")
        while n > 0:
            part = scratch[:min(n, len(scratch))]
            recv(part)
            if self.hasher is not None:
                self.hasher.update(part)
            n -= len(part)

    def flush(self) -> None:
        if self.fill:
            self.add(self.pos // self.w, memoryview(self.buf)[:self.fill])
            self.pos += self.fill
            self.fill = 0


def _sock_recv(sock: socket.socket, into: Into) -> Callable[[memoryview], None]:
    def recv(view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = sock.recv_into(view[got:])
            if not k:
                raise ConnectionError(f"bulk stream ended {len(view) - got} bytes early")
            got += k
        into.moved += len(view)
    return recv


def fd_recv(fd: int, start: int = 0) -> Callable[[memoryview], None]:
    """Reads the file ``fd`` in order from ``start`` (a block held on this node)."""
    at = [start]

    def recv(view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], at[0] + got)
            if not k:
                raise DataLossError(f"a local block ended {len(view) - got} bytes early")
            got += k
        at[0] += len(view)
    return recv


class Pulls:
    """The bulk connections of one rebuild: opening sources, and cutting them all on a failure."""

    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, transfer: Any) -> None:
        self.node_id, self.store, self.cluster, self.transfer = node_id, store, cluster, transfer
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.failed = False

    def connect(self, node: str, port: int) -> socket.socket:
        p = self.cluster.peers[node]
        sock = self.transfer.open(p.host, port, p.tls_name)
        with self._lock:
            if self.failed:
                sock.close()
                raise UnavailableError("the rebuild was abandoned")
            self._socks.add(sock)
        return sock

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def cut(self) -> None:
        """Shut every open connection down (their threads then fail at once)."""
        with self._lock:
            self.failed = True
            socks = list(self._socks)
        for s in socks:
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            except OSError:
                pass

    async def run(self, jobs: list[Callable[[], None]]) -> None:
        """Run blocking ``jobs`` at once on the peer tier's pool; the first failure cuts the rest."""
        futs = [asyncio.ensure_future(run_blocking(j, pool=self.transfer.pool)) for j in jobs]
        try:
            await asyncio.gather(*futs)
        except BaseException:
            self.cut()
            await asyncio.gather(*futs, return_exceptions=True)
            raise

    async def member(self, m: Manifest, off: int, n: int) -> Source:
        """A source of ``[off, off + n)`` of member ``m``'s rank: from this node's store if it holds
        that generation, else from its owner over the bulk channel.

        Raises:
            UnavailableError / NotFoundError: no live node known here holds it.
        """
        local = self.store.get(*m.key)
        if local is not None and local.generation == m.generation:
            return self._local_member(local, off, n)
        if m.node == self.node_id or m.node not in self.cluster.peers:
            raise UnavailableError(f"{m.key} generation {m.generation} is held by no live node known here")
        p = self.cluster.peers[m.node]
        resp = await self.cluster.call(p, "OpenRead", ppb.OpenReadRequest(requester=self.node_id, job=m.job,
                                                                          step=m.step, rank=m.rank))
        held = Manifest.from_json(resp.manifest_json)
        if held.key != m.key or held.generation != m.generation or held.nbytes != m.nbytes:
            raise UnavailableError(f"peer {m.node} holds {held.key} generation {held.generation}, not "
                                   f"{m.key} generation {m.generation}")
        if not 0 <= off <= off + n <= m.nbytes:
            raise DataLossError(f"bytes {off}+{n} are past the {m.nbytes} bytes of {m.key}")
        sizes = {s.name: s.size for s in m.shards}

        def pull(into: Into) -> None:
            sock = self.connect(m.node, resp.bulk_port)
            try:
                recv = _sock_recv(sock, into)
                for shard, start, count, _ in spans(m, off, n):
                    # one run, at least MIN_CHUNK long (the server refuses tinier ones): the extra is dropped
                    chunk = max(count, min(bulk.MIN_CHUNK, sizes[shard] - start))
                    bulk.send_msg(sock, {"v": bulk.VERSION, "op": "get", "ticket": resp.ticket, "shard": shard,
                                         "offset": start, "chunk": chunk,
                                         "stride": max(chunk, sizes[shard] - start)})  # one run
                    reply = bulk.raise_for(bulk.recv_msg(sock) or {}, f"peer {m.node} bulk get {shard}")
                    if reply.get("length") != chunk:
                        raise DataLossError(f"peer {m.node} offers {reply.get('length')} bytes of {shard}, "
                                            f"expected {chunk}")
                    into.useful(recv, count)
                    _drop(sock, chunk - count, into)
                into.flush()
            finally:
                self.release(sock)
        return pull

    def _local_member(self, held: Manifest, off: int, n: int) -> Source:
        def pull(into: Into) -> None:
            for shard, start, count, _ in spans(held, off, n):
                fd = self.store.open_shard(held, shard)
                try:
                    into.useful(fd_recv(fd, start), count)
                finally:
                    os.close(fd)
            into.flush()
        return pull

    def slot(self, node: str, resp: ppb.OpenSlotReadResponse, useful: int, hasher: Any) -> Source:
        """A source of an XOR slot's bytes over the bulk channel: the first ``useful`` to the
        windows, all of them to ``hasher``."""
        size = resp.size

        def pull(into: Into) -> None:
            into.hasher = hasher
            sock = self.connect(node, resp.bulk_port)
            try:
                recv = _sock_recv(sock, into)
                bulk.send_msg(sock, {"v": bulk.VERSION, "op": "get", "ticket": resp.ticket, "shard": "slot",
                                     "offset": 0, "chunk": max(size, 1), "stride": max(size, 1)})
                reply = bulk.raise_for(bulk.recv_msg(sock) or {}, f"peer {node} bulk get of a parity slot")
                if reply.get("length") != size:
                    raise DataLossError(f"peer {node} offers {reply.get('length')} bytes of a {size}-byte parity "
                                        "slot")
                into.useful(recv, useful)
                into.flush()
                into.extra(recv, size - useful)
            finally:
                self.release(sock)
        return pull


def _drop(sock: socket.socket, n: int, into: Into) -> None:
    """Receive and drop ``n`` bytes (the part of a minimum-length run past the block)."""
    if n:
        bulk.discard(sock, n, bytearray(min(n, 1 << 20)))
        into.moved += n
