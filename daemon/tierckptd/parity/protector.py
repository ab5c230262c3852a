"""The holder side of parity: ProtectRank (pull a chunk, XOR it into a slot), and the streams
other nodes read (a chunk decoded from its slot here; a byte range of a rank held here).

Nothing a peer sends is trusted beyond what is checked here: the manifest's MAC
(:meth:`Manifest.from_json`), that the sender owns the rank, that this node is the protector of
that chunk by the layout's rule, and that the sender streams exactly the chunk's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tierckpt.errors import (
    CapacityError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
)
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking
from . import layout
from .decode import decode_chunk, pull_range
from .ranges import PIECE, read_range
from .share import ShareBoard, member_key, share, worth_delta
from .slots import Member, ParityStore

__all__ = ["GIVE_WAY_S", "Protector", "give_way"]

GIVE_WAY_S = 20.0
"""Longest a chunk to protect waits for this node's restores (then it is pulled regardless)."""


class Protector:
    """Parity slots held here for the other members of this node's group."""

    def __init__(self, node_id: str, store: LocalStore, pstore: ParityStore, cluster: Membership, size: int,
                 metrics: Any = None) -> None:
        self.node_id, self.store, self.pstore, self.cluster, self.size = node_id, store, pstore, cluster, size
        self.metrics = metrics
        self._inflight: dict[tuple[str, int, int, str, int], asyncio.Lock] = {}
        self.board = ShareBoard()
        self.restoring: Callable[[], int] | None = None
        """Restores in progress here (set by the facade): a chunk is pulled only once they are over
        (:meth:`_give_way`)."""
        self._pulling = asyncio.Semaphore(1)
        """One chunk pulled at a time: the chunk waits in a temporary file (1/K of a rank) until it
        is XORed in, so at most one such file exists and the memory stays ~1 + 1/K. A holder
        receives K chunks of 1/K per step, as many bytes as one full replica."""

    async def protect(self, sender: str, manifest_json: str, chunk: int, chunks: int) -> ppb.ProtectRankResponse:
        man = Manifest.from_json(manifest_json)
        if man.node != sender:
            raise PermissionDeniedError(f"sender: {sender!r} does not own {man.key} (its owner is {man.node!r})")
        want = layout.chunk_of(self.node_id, sender, self.cluster.ids(), self.size)
        prot = layout.protectors(sender, self.cluster.ids(), self.size)
        if want != chunk or chunks != len(prot):
            raise PermissionDeniedError(f"chunk: node {self.node_id} protects chunk {want} of {len(prot)} of "
                                        f"{sender}'s ranks, not chunk {chunk} of {chunks}")
        key = (*man.key, man.generation, chunk)
        lock = self._inflight.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                slot = self.pstore.find(man.job, man.step, man.node, man.rank, man.generation, chunk)
                if slot is not None:
                    return ppb.ProtectRankResponse(already=True, parity_bytes=slot.size)
                slot = await self._share(man, chunk, chunks)
                if slot is None:
                    until = time.monotonic() + GIVE_WAY_S  # one budget for the whole pull
                    await self._give_way(until)
                    async with self._pulling:
                        slot = await self._pull_and_add(man, chunk, chunks, until)
                return ppb.ProtectRankResponse(already=False, parity_bytes=slot.size)
        finally:
            if not lock.locked() and self._inflight.get(key) is lock:
                del self._inflight[key]

    async def _give_way(self, until: float) -> None:
        await give_way(self.restoring, until)

    async def _share(self, man: Manifest, chunk: int, chunks: int) -> Any:
        """The slot of this step linked from the base step's (:mod:`.share`), or None: pull."""
        base_step, n, keys, state, old = await run_blocking(self.pstore.share_plan, man, chunk, chunks)
        ident = (man.job, man.step, n)
        if base_step is None or state in ("none", "exists"):
            self.board.break_(ident)  # this chunk joins slot n by XOR: its claimants encode too
            return None
        member = Member(man.node, man.rank, man.generation, chunk, chunks, man.to_json().decode())
        slot = await share(self.board, ident, keys, member_key(man.node, man.rank, chunk),
                           (member, old if state == "changed" else None), changed=state == "changed",
                           link=lambda claims: self._link(man.job, man.step, base_step, n, claims))
        if slot is None:  # linked all the same by a claimant cancelled meanwhile?
            return self.pstore.find(man.job, man.step, man.node, man.rank, man.generation, chunk)
        if self.metrics and state == "same":
            self.metrics.parity_linked_bytes.inc(layout.chunk_span(man.nbytes, chunks, chunk)[1])
        return slot

    async def _link(self, job: str, step: int, base_step: int, n: int, claims: dict) -> Any:
        members = [m for m, _ in claims.values()]
        changed = [(m, old) for m, old in claims.values() if old is not None]
        if not changed:
            return await run_blocking(self.pstore.link, job, step, base_step, n, members)
        if not worth_delta(len(changed), len(members)):
            return None
        base_size = await run_blocking(self.pstore.held_size, job, base_step, n)
        async with self._pulling:
            async with pulled_deltas(self.pstore, self.store, self.cluster, self.node_id, changed,
                                     self.metrics, base_size) as files:
                return await run_blocking(self.pstore.link, job, step, base_step, n, members,
                                          [(fd, length) for fd, length, _ in files])

    async def _pull_and_add(self, man: Manifest, chunk: int, chunks: int, until: float = 0.0) -> Any:
        off, length = layout.chunk_span(man.nbytes, chunks, chunk)
        name, fd = await pull_incoming(self.pstore, self.store, self.cluster, self.node_id, man, off, length,
                                        self.pstore.growth(man.job, man.step, man.node, length, man.rank, chunk),
                                        lambda: self._give_way(until))
        if self.metrics:
            self.metrics.parity_pulled_bytes.inc(length)
        return await run_blocking(self.pstore.add, man, chunk, chunks, name, fd, length)

    # ------------------------------------------------------------------------------ streams

    async def rebuild_chunk(self, job: str, step: int, owner: str, rank: int, generation: str,
                            chunk: int) -> AsyncIterator[ppb.DataPiece]:
        """The bytes of a protected chunk, decoded here (:func:`.decode.decode_chunk`)."""
        slot, fd = await run_blocking(self.pstore.open_slot, job, step, owner, rank, generation, chunk)
        try:
            target = next(m for m in slot.members if m.key == (owner, rank, generation, chunk))
            data = await decode_chunk(self.node_id, self.store, self.cluster, slot, fd, target, self.metrics)
        finally:
            os.close(fd)
        for off in range(0, len(data), PIECE):
            yield ppb.DataPiece(data=bytes(data[off:off + PIECE]))

    async def open_slot_read(self, req: ppb.RebuildChunkRequest, receiver: Any) -> ppb.OpenSlotReadResponse:
        """A bulk ticket for the slot protecting a chunk, its size, checksum and members (the
        restoring node decodes the chunk itself: :mod:`.bulkdecode`). The ticket keeps the slot
        file open, so the bytes served are the ones described here."""
        slot, fd = await run_blocking(self.pstore.open_slot, req.job, req.step, req.owner, req.rank, req.generation,
                                      req.chunk)
        try:
            ticket = receiver.blobs.issue(fd, slot.size, req.requester)
        except BaseException:
            os.close(fd)
            raise
        members = [ppb.ProtectedRank(manifest_json=m.manifest, chunk=m.chunk, chunks=m.chunks) for m in slot.members]
        return ppb.OpenSlotReadResponse(ticket=ticket, bulk_port=receiver.bulk_port, size=slot.size,
                                        checksum=slot.checksum, members=members)

    async def read_rank_range(self, job: str, step: int, rank: int, generation: str, offset: int,
                              length: int) -> AsyncIterator[ppb.DataPiece]:
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not held by node {self.node_id}")
        if man.generation != generation:
            raise FailedPreconditionError(f"generation: {job} step {step} rank {rank} on {self.node_id} is "
                                          f"{man.generation}, not {generation}")
        if offset + length > man.nbytes:
            raise FailedPreconditionError(f"offset/length: past the {man.nbytes} bytes of the rank")
        it = read_range(lambda n: self.store.open_shard(man, n), man, offset, length)
        try:
            while (b := await run_blocking(next, it, None)) is not None:
                yield ppb.DataPiece(data=b)
        finally:
            it.close()

    def lookup(self, job: str, step: int | None, rank: int | None) -> ppb.ParityLookupResponse:
        return ppb.ParityLookupResponse(ranks=[ppb.ProtectedRank(manifest_json=m.manifest, chunk=m.chunk,
                                                                 chunks=m.chunks)
                                               for m in self.pstore.lookup(job, step, rank)])


@contextlib.asynccontextmanager
async def pulled_deltas(pstore: Any, store: LocalStore, cluster: Membership, node_id: str, changed: list,
                        metrics: Any = None, base_size: int = 0) -> AsyncIterator[list[tuple[int, int, int]]]:
    """The old and new chunk of each changed member (``(member, its manifest in the base step)``)
    pulled from their owners into temporary files of ``pstore``: (fd, length, position) each,
    removed on exit (a delta update of a base slot or row, :mod:`.share`).

    The update writes a private copy of the ``base_size``-byte base file (grown to the longest new
    chunk), charged in full against local_capacity, so room for it is made before anything is
    pulled, as for a chunk encoded anew (:func:`pull_incoming`); the pulled chunks are temporary
    (two per changed member, fewer than half the members) and, like an encode's, not charged.

    Raises:
        CapacityError: no room here for the copy, even after evicting what may be evicted.
    """
    files: list[tuple[Manifest, str, int, int, int]] = []
    longest = max((layout.chunk_span(Manifest.from_json(m.manifest).nbytes, m.chunks, m.chunk)[1]
                   for m, _ in changed), default=0)
    await make_room(store, max(base_size, longest), changed[0][0].manifest if changed else "", pstore)
    try:
        for m, old_json in changed:
            for man in (Manifest.from_json(old_json), Manifest.from_json(m.manifest)):
                off, length = layout.chunk_span(man.nbytes, m.chunks, m.chunk)
                name, fd = await pull_incoming(pstore, store, cluster, node_id, man, off, length, 0)
                files.append((man, name, fd, length, m.chunk))
                if metrics:
                    metrics.parity_pulled_bytes.inc(length)
        yield [(fd, length, pos) for _, _, fd, length, pos in files]
    finally:
        for man, name, fd, _, _ in files:
            os.close(fd)
            with contextlib.suppress(OSError):
                await run_blocking(pstore.discard, man.job, man.step, name)


async def pull_incoming(pstore: Any, store: LocalStore, cluster: Membership, node_id: str, man: Manifest, off: int,
                        length: int, need: int, give_way: Callable[[], Awaitable[None]] | None = None
                        ) -> tuple[str, int]:
    """Pull ``length`` bytes at ``off`` of the owner's rank into a new temporary file of
    ``pstore`` (XOR slots or Reed-Solomon rows): its name and open descriptor. Parity is charged
    against local_capacity (the facade's external_charge), so ``need`` bytes of room are made
    first; a failed pull leaves no file behind. ``give_way`` is awaited before each piece is
    written (a pull under way pauses while this node restores: the stream's flow control holds
    the sender)."""
    await make_room(store, need, man, pstore, length)
    name, fd = await run_blocking(pstore.incoming, man.job, man.step)
    try:
        async def sink(pos: int, data: bytes) -> None:
            if give_way is not None:
                await give_way()
            await run_blocking(os.pwrite, fd, data, pos)

        await pull_range(cluster, man.node, node_id, man, off, length, sink)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            await run_blocking(pstore.discard, man.job, man.step, name)
        raise
    return name, fd


async def make_room(store: LocalStore, need: int, man: Manifest | str, pstore: Any, length: int = 0) -> None:
    """Room for ``need`` more bytes of parity (``man``'s, as a Manifest or its JSON), evicting
    what a save of its job may evict (:meth:`LocalStore.make_room`).

    Raises:
        CapacityError: naming the chunk and the parity held, when it does not fit.
    """
    if not need:
        return
    if isinstance(man, str):
        man = Manifest.from_json(man)
    try:
        await run_blocking(store.make_room, need, man.job)
    except CapacityError as e:
        what = f"a {length}-byte parity chunk" if length else f"a {need}-byte parity update"
        raise CapacityError(f"local_capacity: no room here for {what} of {man.key} "
                            f"({pstore.nbytes()} bytes of parity held): {e}") from None


async def give_way(restoring: Callable[[], int] | None, until: float) -> None:
    """Wait while this node restores a rank (``restoring()``), at most until ``until``
    (``GIVE_WAY_S`` in all per chunk, well within the sender's ProtectRank timeout and the pull's
    stream timeout).

    Why: a replaced node is the protector of its group's chunks (XOR slots, Reed-Solomon rows) and
    is asked for them again as soon as it is back, by every member at once: pulled then, they would
    share its link with its own restore (a rank's worth into it, as much as the rank itself), as
    inbound replicas would if they did not give way too (:mod:`..peer.receiver`)."""
    if restoring is None:
        return
    while restoring() and time.monotonic() < until:
        await asyncio.sleep(0.05)
