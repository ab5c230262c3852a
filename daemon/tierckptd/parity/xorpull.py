"""One chunk of a lost rank under XOR parity, decoded on the restoring node from blocks pulled
over the bulk channel (:mod:`.bulkdecode`): the slot from its holder and the slot's other
members' chunks from their owners, all at once, XORed window by window into the staging file.

What the slot's holder describes is checked before a byte is used: at most 64 members, each
manifest MAC-checked and cut into at most 64 chunks, the requested chunk among them, and the
slot exactly as long as its longest member's chunk. The slot is hashed as it arrives and must
match its checksum (else DataLossError, as when the holder decoded it), and the rebuilt rank is
checked against its manifest before it is committed (:class:`.rebuild.Rebuilder`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from tierckpt.common import checksum
from tierckpt.errors import DataLossError
from tierckpt.v1 import peer_pb2 as ppb

from ..local.manifest import Manifest
from ..offload import run_blocking
from . import layout
from .bulkdecode import Into, Pulls, Source, W, Windows, fd_recv
from .ranges import write_range

__all__ = ["MAX_MEMBERS", "ChunkDecode", "open_chunk", "pull_chunk"]

log = logging.getLogger(__name__)

MAX_MEMBERS = 64


async def pull_chunk(pulls: Pulls, protector: Any, man: Manifest, chunk: int, chunks: int, holder: str,
                     opener: Any, metrics: Any = None, write: Callable[[int, Any], None] | None = None) -> int:
    """Decode chunk ``chunk`` of ``man`` into the staging files (``opener``), or, given ``write``,
    to ``write(offset in the chunk, data)`` (a protector decoding for a restorer: :mod:`.farside`);
    the bytes received over the bulk channel.

    Raises:
        DataLossError: the slot fails its checksum, or its holder described it inconsistently.
        UnavailableError / NotFoundError / FailedPreconditionError: a block could not be read.
    """
    decode = await open_chunk(pulls, protector, man, chunk, chunks, holder, opener, metrics, write)
    return await decode.run()


class ChunkDecode:
    """One chunk's decode, its sources opened and checked (:func:`open_chunk`): :meth:`run` pulls
    and XORs them (once), else :meth:`close` gives up. Split so that a protector answers a restorer
    (the ticket) as soon as every source is known good, and decodes while the restorer pulls."""

    def __init__(self, pulls: Pulls, sources: list[tuple[Source, int]], windows: Windows, hasher: Any,
                 expected: str, where: str, metrics: Any, fd: int) -> None:
        self.pulls, self.sources, self.windows, self.hasher = pulls, sources, windows, hasher
        self.expected, self.where, self.metrics, self.fd = expected, where, metrics, fd

    async def run(self) -> int:
        """Pull every source and XOR them window by window; the bytes received over the network.

        Raises:
            DataLossError: the slot fails its checksum.
            UnavailableError / NotFoundError / FailedPreconditionError: a block could not be read.
        """
        try:
            intos = [Into(self.windows.add, window=self.windows.w) for _ in self.sources]
            await self.pulls.run([_job(src, into) for (src, _), into in zip(self.sources, intos)])
            actual = self.hasher.hexdigest()
            if actual != self.expected:
                if self.metrics:
                    self.metrics.checksum_failures.labels(tier="peer").inc()
                msg = f"{self.where} fails its checksum (expected {self.expected}, got {actual})"
                log.error("%s", msg)
                raise DataLossError(msg)
            self.windows.check()
            return sum(i.moved for i in intos)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


async def open_chunk(pulls: Pulls, protector: Any, man: Manifest, chunk: int, chunks: int, holder: str,
                     opener: Any, metrics: Any = None, write: Callable[[int, Any], None] | None = None,
                     window: int = W) -> ChunkDecode:
    """The slot's description checked and every source opened (read tickets) for
    :func:`pull_chunk`; nothing pulled yet. ``window``: see :class:`.bulkdecode.Windows`.

    Raises:
        DataLossError: the slot's holder described it inconsistently.
        UnavailableError / NotFoundError / FailedPreconditionError: a block cannot be read.
    """
    off, length = layout.chunk_span(man.nbytes, chunks, chunk)
    req = ppb.RebuildChunkRequest(requester=pulls.node_id, job=man.job, step=man.step, rank=man.rank, owner=man.node,
                                  generation=man.generation, chunk=chunk)
    fd = -1
    if holder == pulls.node_id:  # the slot is here
        slot, fd = await run_blocking(protector.pstore.open_slot, man.job, man.step, man.node, man.rank,
                                      man.generation, chunk)
        resp = ppb.OpenSlotReadResponse(size=slot.size, checksum=slot.checksum, members=[
            ppb.ProtectedRank(manifest_json=m.manifest, chunk=m.chunk, chunks=m.chunks) for m in slot.members])
    else:
        resp = await pulls.cluster.call(pulls.cluster.peers[holder], "OpenSlotRead", req)
    try:
        others = _members(resp, man, chunk, holder)
        hasher = checksum.new()
        sources: list[tuple[Source, int]] = []
        if fd >= 0:
            sources.append((_local_slot(fd, resp.size, length, hasher), length))
        else:
            sources.append((pulls.slot(holder, resp, length, hasher), length))
        spans = [layout.chunk_span(m.nbytes, chunks_m, c) for m, c, chunks_m in others]
        opened = await asyncio.gather(*(pulls.member(m[0], m_off, min(m_len, length))
                                        for m, (m_off, m_len) in zip(others, spans)))  # read tickets at once
        sources.extend((src, min(m_len, length)) for src, (_, m_len) in zip(opened, spans))
        sink = write or (lambda at, data: write_range(opener, man, off + at, data))
        windows = Windows(length, [n for _, n in sources], sink, window)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return ChunkDecode(pulls, sources, windows, hasher, resp.checksum,
                       f"parity slot of {man.job} step {man.step} on {holder}", metrics, fd)


def _job(src: Source, into: Into) -> Any:
    return lambda: src(into)


def _members(resp: ppb.OpenSlotReadResponse, man: Manifest, chunk: int, holder: str) -> list[tuple[Manifest, int,
                                                                                                    int]]:
    """The slot's other members (manifest, chunk, chunks), after checking what ``holder`` said."""
    if not 0 < len(resp.members) <= MAX_MEMBERS:
        raise DataLossError(f"peer {holder} describes a parity slot of {len(resp.members)} members")
    found, others, longest = False, [], 0
    for r in resp.members:
        m = Manifest.from_json(r.manifest_json)  # DataLossError: a forged or garbled manifest
        if not r.chunk < r.chunks <= MAX_MEMBERS:
            raise DataLossError(f"peer {holder}: member chunk {r.chunk} of {r.chunks}")
        longest = max(longest, layout.chunk_span(m.nbytes, r.chunks, r.chunk)[1])
        if m.key == man.key and m.generation == man.generation and r.chunk == chunk and m.node == man.node:
            found = True
        else:
            others.append((m, r.chunk, r.chunks))
    if not found:
        raise DataLossError(f"peer {holder}'s parity slot does not hold chunk {chunk} of {man.key}")
    if resp.size != longest:
        raise DataLossError(f"parity slot on {holder} is {resp.size} bytes; its members' chunks need {longest}")
    return others


def _local_slot(fd: int, size: int, useful: int, hasher: Any) -> Source:
    def pull(into: Into) -> None:
        into.hasher = hasher
        recv = fd_recv(fd)
        into.useful(recv, useful)
        into.flush()
        into.extra(recv, size - useful)
    return pull
