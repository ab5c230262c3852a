"""The bulk client: moving a rank's shards to or from a peer over several bulk connections.

A transfer is planned (:func:`plan_pieces`: which byte ranges go over which connection), then
executed by up to ``KNOBS.bulk_streams`` worker threads of the peer tier's pool, each on its own
connection. "put" sends from the local tier's files (sendfile); "get" writes into staging files
and feeds the receiver-side hashers in byte order, so checksums are verified on receipt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import os
import queue
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tierckpt.errors import CapacityError, DataLossError, UnavailableError

from ..knobs import KNOBS
from ..offload import run_blocking
from . import bulk

__all__ = ["plan_pieces", "BulkClient", "Piece", "Opener"]

Opener = Callable[[], int]
"""Returns a new file descriptor of a shard (the caller closes it)."""
Piece = tuple[str, int, int, int]
"""(shard, offset, chunk, stride): see :mod:`.bulk`."""


def plan_pieces(shards: Sequence[tuple[str, int]], streams: int | None = None, min_piece: int | None = None,
                chunk: int = bulk.CHUNK) -> list[Piece]:
    """Split shards into ``(name, offset, chunk, stride)`` pieces for ``streams`` connections.

    Shards travel whole (one run) unless there are fewer shards than streams; then a large shard
    is split into k <= ``streams`` pieces (at least ``min_piece`` bytes each) of interleaved
    ``chunk``-byte runs, so the receiver can hash it in order as the k connections deliver it.
    Largest first, so connections finish together.
    """
    streams = KNOBS.bulk_streams if streams is None else streams
    min_piece = KNOBS.min_piece if min_piece is None else min_piece
    split = len(shards) < streams
    pieces: list[Piece] = []
    for name, size in sorted(shards, key=lambda s: -s[1]):
        k = max(1, min(streams, size // max(1, min_piece))) if split else 1
        if k == 1:
            pieces.append((name, 0, max(size, 1), max(size, 1)))
        else:
            pieces.extend((name, j * chunk, chunk, k * chunk) for j in range(k))
    return pieces


class BulkClient:
    """Runs transfers on a thread pool. ``ssl_context()`` (mTLS) gives the current context for
    each new connection (certificates rotate without a restart); None: plain TCP."""

    def __init__(self, pool: cf.Executor, ssl_context: Callable[[], ssl.SSLContext] | None) -> None:
        self._pool = pool
        self._ssl = ssl_context

    @property
    def pool(self) -> cf.Executor:
        """The worker threads transfers run on."""
        return self._pool

    def open(self, host: str, port: int, tls_name: str | None = None) -> Any:
        """A new bulk connection (blocking), under the current TLS context if any."""
        return bulk.connect(host, port, self._ssl() if self._ssl is not None else None, tls_name)

    async def run(self, peer_id: str, host: str, port: int, ticket: str, op: str, pieces: list[Piece],
                  files: Mapping[str, tuple[Opener, int]], hashers: dict[str, bulk.OrderedHasher],
                  tls_name: str | None = None) -> None:
        """Move ``pieces`` over up to ``KNOBS.bulk_streams`` connections; "get" feeds ``hashers``.

        ``files`` maps each shard to (an opener returning a descriptor that does not follow links:
        the store's ``open_shard`` for "put", ``open_staged`` for "get"; its size).

        Raises:
            UnavailableError: a connection failed. DataLossError: the peer offered the wrong size.
        """
        work: queue.SimpleQueue = queue.SimpleQueue()
        for piece in pieces:
            work.put(piece)
        stop = threading.Event()
        ctx = self._ssl() if self._ssl is not None else None
        job = _Stream(peer_id, host, port, ticket, op, work, files, hashers, stop, ctx, tls_name)
        futs = [run_blocking(job.work, pool=self._pool) for _ in range(min(KNOBS.bulk_streams, len(pieces)))]
        try:
            await asyncio.gather(*futs)
        except BaseException as e:
            stop.set()
            for h in hashers.values():
                h.abort(f"transfer from {peer_id} failed: {e}")
            raise


class _Stream:
    """One transfer's shared state; :meth:`work` is one connection's loop (a worker thread)."""

    def __init__(self, peer_id: str, host: str, port: int, ticket: str, op: str, work: queue.SimpleQueue,
                 files: Mapping[str, tuple[Opener, int]], hashers: dict[str, bulk.OrderedHasher], stop: threading.Event,
                 ssl_context: ssl.SSLContext | None, tls_name: str | None) -> None:
        self.peer_id, self.host, self.port, self.ticket, self.op = peer_id, host, port, ticket, op
        self.queue, self.files, self.hashers, self.stop = work, files, hashers, stop
        self.ssl, self.tls_name = ssl_context, tls_name

    def work(self) -> None:
        sock = bulk.connect(self.host, self.port, self.ssl, self.tls_name)
        buf = bytearray(bulk.BUF_BYTES) if (self.op == "get" or self.ssl) else None
        try:
            while not self.stop.is_set():
                try:
                    piece = self.queue.get_nowait()
                except queue.Empty:
                    return
                self._one(sock, piece, buf)
        except OSError as e:
            if e.errno == errno.ENOSPC:  # writing the copy here: this node's local dir is full
                raise CapacityError(f"local_dir is full while copying from peer {self.peer_id}: {e}") from None
            raise UnavailableError(f"bulk channel to {self.peer_id}: {e}") from None
        finally:
            sock.close()

    def _one(self, sock, piece: Piece, buf: bytearray | None) -> None:
        shard, off, chunk, stride = piece
        opener, size = self.files[shard]
        what = f"peer {self.peer_id} bulk {self.op} {shard}"
        bulk.send_msg(sock, {"v": bulk.VERSION, "op": self.op, "ticket": self.ticket, "shard": shard,
                             "offset": off, "chunk": chunk, "stride": stride})
        reply = bulk.raise_for(bulk.recv_msg(sock) or {}, what)
        if self.op == "put":
            with os.fdopen(opener(), "rb") as fh:
                for start, length in bulk.runs(off, chunk, stride, size):
                    bulk.send_range(sock, fh, start, length, buf)
            bulk.raise_for(bulk.recv_msg(sock) or {}, what)
            return
        expect = sum(n for _, n in bulk.runs(off, chunk, stride, size))
        if reply.get("length") != expect:
            raise DataLossError(f"{what}: peer offers {reply.get('length')} bytes, expected {expect}")
        assert buf is not None
        fd = opener()
        try:
            for start, length in bulk.runs(off, chunk, stride, size):
                bulk.recv_range(sock, fd, start, length, buf, self.hashers[shard].update)
        finally:
            os.close(fd)
