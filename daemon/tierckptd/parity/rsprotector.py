"""The holder side of Reed-Solomon parity: ProtectRank (pull a chunk, add its share to the parity
row kept here), the rows other nodes read to decode (checked against their checksums first),
and the lookup of what is protected here.

Nothing a peer sends is trusted beyond what is checked here: the manifest's MAC, that the sender
owns the rank, that this node keeps that row of that chunk by :func:`.rslayout.roles`, the
chunk count, the row and lane syntax, and that the sender streams exactly the chunk's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tierckpt.common import checksum
from tierckpt.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..local.localfs import digest_fd
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking
from . import layout, rslayout
from .protector import GIVE_WAY_S, Protector, give_way, pull_incoming, pulled_deltas
from .ranges import PIECE
from .rs import Codec
from .rsslots import RsStore
from .share import ShareBoard, member_key, share, worth_delta
from .slots import Member

__all__ = ["RsProtector", "check_row"]

log = logging.getLogger(__name__)


def check_row(row: int, m: int, field: str = "row") -> None:
    if not 0 <= row < m:
        raise InvalidArgumentError(f"{field}: parity row {row} is not in 0..{m - 1}")


class RsProtector:
    """Parity rows held here for the other members of this node's group (``parity:K+M``)."""

    def __init__(self, node_id: str, store: LocalStore, rstore: RsStore, cluster: Membership, k: int, m: int,
                 metrics: Any = None) -> None:
        self.node_id, self.store, self.rstore, self.cluster = node_id, store, rstore, cluster
        self.k, self.m, self.metrics = k, m, metrics
        self._inflight: dict[tuple, asyncio.Lock] = {}
        self._pulling = asyncio.Semaphore(1)  # one chunk waits in a temporary file at a time
        self.board = ShareBoard()
        self.restoring: Callable[[], int] | None = None
        """Restores in progress here (set by the facade): a chunk is pulled once they are over, or
        after ``GIVE_WAY_S`` (:func:`.protector.give_way`; why: there)."""

    @functools.cache  # noqa: B019 (a handful of codecs for the daemon's life)
    def codec(self, k: int) -> Codec:
        return Codec(k, self.m)

    def group(self, node: str) -> list[str]:
        return rslayout.group(node, self.cluster.ids(), self.k, self.m)

    async def protect(self, sender: str, manifest_json: str, chunk: int, chunks: int, row: int,
                      lane: str) -> ppb.ProtectRankResponse:
        check_row(row, self.m)
        rslayout.check_lane(lane, row)
        man = Manifest.from_json(manifest_json)
        if man.node != sender:
            raise PermissionDeniedError(f"sender: {sender!r} does not own {man.key} (its owner is {man.node!r})")
        g = self.group(sender)
        k = rslayout.data_blocks(g, self.m)
        if chunks != k or (chunk, row) not in rslayout.roles(self.node_id, sender, g, self.m):
            raise PermissionDeniedError(f"chunk: node {self.node_id} keeps rows "
                                        f"{sorted(rslayout.roles(self.node_id, sender, g, self.m))} (chunk, row) of "
                                        f"{k} chunks of {sender}'s ranks, not row {row} of chunk {chunk} of {chunks}")
        stripe = rslayout.stripe_of(sender, g, self.m, chunk)
        key = (*man.key, man.generation, chunk, row)
        lock = self._inflight.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                held = self.rstore.find(man.job, man.step, (man.node, man.rank, man.generation, chunk), row)
                if held is not None and (not lane or held.lane == lane):
                    return ppb.ProtectRankResponse(already=True, parity_bytes=held.size, lane=held.lane)
                slot = await self._share(man, chunk, k, stripe, row, lane)
                if slot is None:
                    await give_way(self.restoring, time.monotonic() + GIVE_WAY_S)
                    async with self._pulling:
                        slot = await self._pull_and_add(man, chunk, self.codec(k), stripe, row, lane)
                return ppb.ProtectRankResponse(already=False, parity_bytes=slot.size, lane=slot.lane)
        finally:
            if not lock.locked() and self._inflight.get(key) is lock:
                del self._inflight[key]

    async def _share(self, man: Manifest, chunk: int, k: int, stripe: int, row: int, lane: str) -> Any:
        """The row of this step linked from the base step's (:mod:`.share`), or None: pull."""
        base_step, lane, keys, state, old = await run_blocking(self.rstore.share_plan, man, chunk, k, stripe, row,
                                                               lane)
        ident = (man.job, man.step, stripe, lane, row)
        if base_step is None or state in ("none", "exists"):
            if lane:
                self.board.break_(ident)  # this chunk joins the row by encoding: its claimants encode too
            return None
        member = Member(man.node, man.rank, man.generation, chunk, k, man.to_json().decode())
        slot = await share(self.board, ident, keys, member_key(man.node, man.rank, chunk),
                           (member, old if state == "changed" else None), changed=state == "changed",
                           link=lambda claims: self._link(man.job, man.step, base_step, stripe, lane, row, k, claims))
        if slot is None:  # linked all the same by a claimant cancelled meanwhile?
            return self.rstore.find(man.job, man.step, (man.node, man.rank, man.generation, chunk), row)
        if self.metrics and state == "same":
            self.metrics.parity_linked_bytes.inc(layout.chunk_span(man.nbytes, k, chunk)[1])
        return slot

    async def _link(self, job: str, step: int, base_step: int, stripe: int, lane: str, row: int, k: int,
                    claims: dict) -> Any:
        members = [m for m, _ in claims.values()]
        changed = [(m, old) for m, old in claims.values() if old is not None]
        if not changed:
            return await run_blocking(self.rstore.link, job, step, base_step, stripe, lane, row, members)
        if not worth_delta(len(changed), len(members)):
            return None
        base_size = await run_blocking(self.rstore.held_size, job, base_step, stripe, lane, row)
        async with self._pulling:
            async with pulled_deltas(self.rstore, self.store, self.cluster, self.node_id, changed,
                                     self.metrics, base_size) as files:
                return await run_blocking(self.rstore.link, job, step, base_step, stripe, lane, row, members,
                                          self.codec(k), files)

    async def _pull_and_add(self, man: Manifest, chunk: int, codec: Codec, stripe: int, row: int, lane: str) -> Any:
        off, length = layout.chunk_span(man.nbytes, codec.k, chunk)
        name, fd = await pull_incoming(self.rstore, self.store, self.cluster, self.node_id, man, off, length,
                                        self.rstore.growth(man.job, man.step, stripe, row, lane, chunk, length,
                                                           (man.node, man.rank)))
        if self.metrics:
            self.metrics.parity_pulled_bytes.inc(length)
        try:
            return await run_blocking(self.rstore.add, man, chunk, codec, stripe, row, lane, name, fd, length)
        except BaseException:
            with contextlib.suppress(OSError):
                await run_blocking(self.rstore.discard, man.job, man.step, name)
            raise

    # ------------------------------------------------------------------------------ reads

    async def row_bytes(self, job: str, step: int, stripe: int, lane: str, row: int) -> bytearray:
        """A row held here, checked against its checksum.

        Raises:
            NotFoundError: not held here. DataLossError: it fails its checksum.
        """
        check_row(row, self.m)
        rslayout.check_lane(lane, 1)
        slot, buf = await run_blocking(self.rstore.read_row, job, step, stripe, lane, row)
        actual = await run_blocking(checksum.digest, buf) if len(buf) == slot.size else "short"
        self._check_row(job, step, stripe, lane, row, slot.checksum, actual)
        return buf

    def _check_row(self, job: str, step: int, stripe: int, lane: str, row: int, expected: str, actual: str) -> None:
        """DataLossError (counted, logged) where a row held here does not match its checksum."""
        if actual == expected:
            return
        if self.metrics:
            self.metrics.checksum_failures.labels(tier="peer").inc()
        msg = (f"parity row {row} of {job} step {step} (stripe {stripe}, lane {lane}) on {self.node_id} fails its "
               f"checksum (expected {expected}, got {actual})")
        log.error("%s", msg)
        raise DataLossError(msg)

    async def open_row_read(self, req: ppb.ReadParityRowRequest, receiver: Any) -> ppb.OpenSlotReadResponse:
        """A bulk ticket for a row held here, once the file behind it passed its checksum (the
        ticket keeps that file open; the reader hashes what it receives again)."""
        slot, fd = await run_blocking(self.rstore.open_row, req.job, req.step, req.stripe, req.lane, req.row)
        try:
            actual = await run_blocking(digest_fd, fd, slot.size) if os.fstat(fd).st_size >= slot.size else "short"
            self._check_row(req.job, req.step, req.stripe, req.lane, req.row, slot.checksum, actual)
            ticket = receiver.blobs.issue(fd, slot.size, req.requester)
        except BaseException:
            os.close(fd)
            raise
        return ppb.OpenSlotReadResponse(ticket=ticket, bulk_port=receiver.bulk_port, size=slot.size,
                                        checksum=slot.checksum)

    async def read_row(self, job: str, step: int, stripe: int, lane: str, row: int) -> AsyncIterator[ppb.DataPiece]:
        buf = await self.row_bytes(job, step, stripe, lane, row)
        for off in range(0, len(buf), PIECE):
            yield ppb.DataPiece(data=bytes(buf[off:off + PIECE]))

    read_rank_range = Protector.read_rank_range  # the owner side of a pull: the same for both codes

    async def rebuild_chunk(self, job: str, step: int, owner: str, rank: int, generation: str,
                            chunk: int) -> AsyncIterator[ppb.DataPiece]:
        raise FailedPreconditionError(f"redundancy: node {self.node_id} uses Reed-Solomon parity: chunks are "
                                      "decoded by the restoring node (ReadParityRow), not here")
        yield  # an async generator, as the XOR one

    def lookup(self, job: str, step: int | None, rank: int | None) -> ppb.ParityLookupResponse:
        return ppb.ParityLookupResponse(ranks=[
            ppb.ProtectedRank(manifest_json=m.manifest, chunk=m.chunk, chunks=m.chunks, parity_rows=self.m,
                              stripe=r.stripe, lane=r.lane, row=r.row)
            for r, m in self.rstore.lookup(job, step, rank)])
