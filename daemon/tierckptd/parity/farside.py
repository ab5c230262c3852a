"""XOR rebuild decoded on the protector, both hops over the bulk data channel.

Why: decoding a lost chunk on the restoring node (:mod:`.xorpull`) makes it receive the slot and
the K-1 other members' chunks, K times the rank in all, through its own link; on a cluster whose
NICs are the limit that is K times a replica fetch. Decoding on the node holding the chunk's slot
(the older ``RebuildChunk``) has the right shape (the restorer receives the rank once, the K-1
pulls spread over the protectors' links) but streamed its result as slow gRPC messages. Here the
protector decodes (``OpenRebuiltChunk``: the slot, checked against its checksum, XOR the other
members' chunks pulled over bulk, :mod:`.xorpull`) into a private unlinked file of its parity
dir and issues a blob ticket (:mod:`..peer.blobs`) for it; the restorer pulls each chunk from its
protector over bulk, all chunks at once, into its staging file (:func:`pull_rebuilt`).

Pipelined: the ticket is issued as soon as every source of the decode is opened and checked (the
slot's members, the other members' read tickets), and serves the decoded bytes as they are
written (:class:`..peer.blobs.Progress`), so the restorer's pull overlaps the protector's. On
links that are the limit, the two used to follow each other (the K-1 members' chunks, then the
decoded chunk: about 1.75 link-times for 4+1); overlapped, about one. The end of the chunk is
held back until the decode has passed its checks (the slot's checksum, every window written); a
decode that fails cuts the restorer's stream short, and it decodes the chunk itself.

Bounds: a protector decodes at most ``MAX_DECODES`` chunks at once per code (each a file of one
chunk, 1/K of a rank, on disk; memory the windows of :class:`.bulkdecode.Windows`); what it
decodes is described by its own MAC-checked slot members, not by the request. The restorer takes
only the chunk length its own manifest implies; the rebuilt rank is checked against that manifest
before it is served (:class:`.rebuild.Rebuilder`), so a protector sending other bytes fails the
restore, never corrupts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from tierckpt.common.fileio import pwrite_all
from tierckpt.errors import CapacityError, DataLossError, FailedPreconditionError, NotFoundError
from tierckpt.v1 import peer_pb2 as ppb

from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..offload import run_blocking
from ..peer import bulk
from ..peer.blobs import Progress
from . import layout
from .bulkdecode import Pulls
from .ranges import write_range
from .xorpull import open_chunk

__all__ = ["Decode", "FarDecoder", "MAX_DECODES", "WINDOW", "pull_rebuilt"]

log = logging.getLogger(__name__)

MAX_DECODES = 2
"""Chunks one code decodes at once for restoring nodes (the rest wait their turn)."""

WINDOW = 1 << 20
"""Decode window here: the restorer's stream trails the slowest source by about one window (the
default 4 MiB is a fifth of a link-time for a 64 MiB rank's 16 MiB chunk at 1/4 of a link)."""


class Decode(Protocol):
    """One chunk's decode for a restoring node, its sources opened (:meth:`FarDecoder.start`)."""

    async def run(self) -> int:
        """Decode, writing through the ``write`` given; the bytes pulled over the network."""

    def close(self) -> None:
        """Give up before :meth:`run`."""


class FarDecoder:
    """The protector side: ``OpenRebuiltChunk`` of one XOR code (:class:`.rsfar.RsFarDecoder`: of a
    Reed-Solomon code; :meth:`find` and :meth:`start` are what differ).

    Args:
        pulls: a fresh :class:`.bulkdecode.Pulls` per decode, or None without a bulk channel.
    """

    def __init__(self, node_id: str, protector: Any, pulls: Callable[[], Pulls | None], metrics: Any = None) -> None:
        self.node_id, self.protector, self.pulls, self.metrics = node_id, protector, pulls, metrics
        self._decoding = asyncio.Semaphore(MAX_DECODES)
        self._tasks: set[asyncio.Task] = set()  # decodes running behind the tickets they serve
        self.held = 0
        """Bytes of the chunks decoded here for restoring nodes: charged against local_capacity with
        the parity (:meth:`.shapes.ParityShapes.nbytes`) from the decode's start until the file is
        gone (its decode ended, and its ticket was read or expired and no serve holds it)."""
        self._held_lock = threading.Lock()  # held changes on the event loop and on bulk threads

    async def open(self, req: ppb.RebuildChunkRequest, receiver: Any) -> ppb.OpenSlotReadResponse:
        """Decode the chunk here and issue a ticket for it.

        Raises:
            NotFoundError: no slot here protects that chunk.
            DataLossError: the slot's members are inconsistent (a slot failing its checksum is found
                while it is decoded: the restorer's stream is then cut short).
            FailedPreconditionError: no bulk channel here (the restorer decodes it itself).
            UnavailableError: another member's chunk could not be pulled.
            CapacityError: no free room here for the decoded chunk (nothing is evicted for a
                restoring node's transient file: it decodes the chunk itself).
        """
        pulls = self.pulls()
        if pulls is None:
            raise FailedPreconditionError(f"node {self.node_id} has no bulk channel to decode chunks over")
        man, chunk, chunks, found = await self.find(req)
        _, length = layout.chunk_span(man.nbytes, chunks, chunk)
        pstore = self.scratch()
        await self._decoding.acquire()  # held by the decode until it ends (below, or _decode)
        try:
            self._charge(man, length)
        except BaseException:
            self._decoding.release()
            raise
        fd = -1
        file = _File(self, length)  # the room is the decode's and the ticket's until both are done
        try:
            name, fd = await run_blocking(pstore.incoming, man.job, man.step)
            progress = Progress(length)
            try:
                decode = await self.start(pulls, man, chunk, chunks, found, _writer(fd, progress))
                try:
                    ticket = receiver.blobs.issue(os.dup(fd), length, req.requester, progress,  # owns the dup
                                                  on_close=file.done)
                except BaseException:
                    decode.close()
                    raise
            finally:
                with contextlib.suppress(OSError):
                    await run_blocking(pstore.discard, man.job, man.step, name)  # the fds keep it
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self._decoding.release()
            file.done(parts=2)
            raise
        task = asyncio.ensure_future(self._decode(decode, progress, fd, man, chunk, file))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return ppb.OpenSlotReadResponse(ticket=ticket, bulk_port=receiver.bulk_port, size=length)

    def _charge(self, man: Manifest, length: int) -> None:
        """Count a ``length``-byte decoded chunk against local_capacity, if it fits in the free room."""
        free = self.protector.store.usage().free
        if free < length:
            raise CapacityError(f"local_capacity: no room on {self.node_id} for a {length}-byte chunk of "
                                f"{man.key} decoded for a restoring node ({free} bytes free)")
        with self._held_lock:
            self.held += length

    def uncharge(self, length: int) -> None:
        with self._held_lock:
            self.held -= length

    def scratch(self) -> Any:
        """The parity store whose step dirs hold the decoded files (``incoming`` / ``discard``)."""
        return self.protector.pstore

    async def find(self, req: ppb.RebuildChunkRequest) -> tuple[Manifest, int, int, Any]:
        """What to decode for ``req``, from this node's own MAC-checked records (never from the
        request): (the rank's manifest, chunk, chunks, what :meth:`start` needs). XOR: the slot."""
        slot = self.protector.pstore.find(req.job, req.step, req.owner, req.rank, req.generation, req.chunk)
        target = None if slot is None else next(
            (m for m in slot.members if m.key == (req.owner, req.rank, req.generation, req.chunk)), None)
        if target is None:
            raise NotFoundError(f"node {self.node_id} does not protect chunk {req.chunk} of {req.job} step "
                                f"{req.step} rank {req.rank} of {req.owner} (generation {req.generation})")
        man = Manifest.from_json(target.manifest)  # stored MAC-checked; checked again
        return man, target.chunk, target.chunks, None

    async def start(self, pulls: Pulls, man: Manifest, chunk: int, chunks: int, found: Any,
                    write: Callable[[int, Any], None]) -> Decode:
        """The decode, its sources opened and checked, not yet run. XOR: :func:`.xorpull.open_chunk`."""
        return await open_chunk(pulls, self.protector, man, chunk, chunks, self.node_id, None, self.metrics,
                                write=write, window=WINDOW)

    async def _decode(self, decode: Decode, progress: Progress, fd: int, man: Manifest, chunk: int,
                      file: _File) -> None:
        """Decode into ``fd`` while the ticket serves what is written: on success the held-back
        end is released; on failure (a slot failing its checksum, a member that cannot be pulled)
        the restorer's stream is cut short, and it decodes the chunk itself (:mod:`.rebuild`)."""
        try:
            moved = await decode.run()
            if self.metrics and moved:
                self.metrics.parity_decode_bulk_bytes.inc(moved)
            progress.finish()
        except BaseException as e:
            progress.fail(str(e) or type(e).__name__)
            if not isinstance(e, Exception):
                raise
            log.warning("chunk %d of %s step %d rank %d could not be decoded for a restoring node: %s", chunk,
                        man.job, man.step, man.rank, e)
        finally:
            os.close(fd)
            self._decoding.release()
            file.done()


class _File:
    """A decoded chunk's charge, given back when both its decode and its ticket are done with it
    (the unlinked file takes room until its last descriptor closes)."""

    def __init__(self, far: FarDecoder, length: int) -> None:
        self.far, self.length, self.parts = far, length, 2
        self._lock = threading.Lock()

    def done(self, parts: int = 1) -> None:
        with self._lock:
            self.parts -= parts
            last = self.parts == 0
        if last:
            self.far.uncharge(self.length)


def _writer(fd: int, progress: Progress) -> Callable[[int, Any], None]:
    def write(at: int, data: Any) -> None:
        pwrite_all(fd, memoryview(data), at)
        progress.wrote(at, len(data))
    return write


async def pull_rebuilt(pulls: Pulls, man: Manifest, chunk: int, chunks: int, holder: str, opener: Any) -> int:
    """Chunk ``chunk`` of ``man`` decoded by ``holder`` (its slot's node) and pulled over the bulk
    channel into the staging files (``opener``); the bytes received.

    Raises:
        FailedPreconditionError: the holder cannot decode it so (an older daemon: UNIMPLEMENTED).
        DataLossError: its slot is corrupt, or it offers another length than the chunk's.
        UnavailableError / NotFoundError: it could not decode it.
    """
    off, length = layout.chunk_span(man.nbytes, chunks, chunk)
    if not length:
        return 0
    req = ppb.RebuildChunkRequest(requester=pulls.node_id, job=man.job, step=man.step, rank=man.rank, owner=man.node,
                                  generation=man.generation, chunk=chunk)
    resp = await pulls.cluster.call(pulls.cluster.peers[holder], "OpenRebuiltChunk", req,
                                    timeout=max(KNOBS.commit_timeout, KNOBS.rpc_timeout))
    if resp.size != length:
        raise DataLossError(f"peer {holder} decoded {resp.size} bytes of chunk {chunk} of {man.key}; it has {length}")
    moved = [0]

    def pull() -> None:
        sock = pulls.connect(holder, resp.bulk_port)
        try:
            bulk.send_msg(sock, {"v": bulk.VERSION, "op": "get", "ticket": resp.ticket, "shard": "slot",
                                 "offset": 0, "chunk": length, "stride": length})
            reply = bulk.raise_for(bulk.recv_msg(sock) or {}, f"peer {holder} bulk get of a decoded chunk")
            if reply.get("length") != length:
                raise DataLossError(f"peer {holder} offers {reply.get('length')} bytes of a {length}-byte chunk")
            buf = bytearray(min(length, bulk.BUF_BYTES))
            view = memoryview(buf)
            pos = 0
            while pos < length:
                n = min(len(buf), length - pos)
                got = 0
                while got < n:
                    k = sock.recv_into(view[got:n])
                    if not k:
                        raise ConnectionError(f"bulk stream from {holder} ended {length - pos - got} bytes early")
                    got += k
                write_range(opener, man, off + pos, view[:n])
                pos += n
                moved[0] += n
        finally:
            pulls.release(sock)

    await pulls.run([pull])
    return moved[0]
