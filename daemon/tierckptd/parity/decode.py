"""Decoding one chunk on the node holding its slot: the slot (its checksum checked first) XOR the
other members' chunks, read from their owners (or from this node's store when it holds them).

Done where the slot is, so that a restoring node receives each chunk once (a rank's bytes in
all, as from a replica) while the K protectors read the other members' chunks in parallel,
instead of the restoring node reading K times the rank's bytes alone."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc
from tierckpt.common import checksum
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import DataLossError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking
from . import layout
from .ranges import read_range
from .slots import Member, Slot
from .xor import xor_into

__all__ = ["decode_chunk", "pull_range"]

log = logging.getLogger(__name__)


async def pull_range(cluster: Membership, node: str, requester: str, man: Manifest, offset: int, length: int,
                     sink: Any) -> None:
    """Stream ``[offset, offset + length)`` of ``man``'s rank (that generation) from ``node``,
    calling ``sink(position, data)`` for each piece in order.

    Raises:
        UnavailableError / FailedPreconditionError / NotFoundError: as the peer answered.
        DataLossError: it sent more or fewer bytes than asked.
    """
    p = cluster.peers[node]
    req = ppb.ReadRankRangeRequest(requester=requester, job=man.job, step=man.step, rank=man.rank,
                                   generation=man.generation, offset=offset, length=length)
    pos = 0
    try:
        async for piece in p.stub.ReadRankRange(req, timeout=max(KNOBS.commit_timeout, KNOBS.rpc_timeout)):
            n = len(piece.data)
            if pos + n > length:
                raise DataLossError(f"peer {node} sent more than the {length} bytes asked of {man.key}")
            await sink(pos, piece.data)
            pos += n
    except grpc.RpcError as e:
        raise error_from_rpc(e, f"peer {node} ({p.address})") from None
    if pos != length:
        raise UnavailableError(f"peer {node} sent {pos} of the {length} bytes asked of {man.key}")


async def decode_chunk(node_id: str, store: LocalStore, cluster: Membership, slot: Slot, fd: int, target: Member,
                       metrics: Any = None) -> memoryview:
    """The bytes of ``target``'s chunk, reconstructed from ``slot`` (data readable at ``fd``).

    Raises:
        DataLossError: the slot fails its checksum or is malformed.
        UnavailableError / NotFoundError / FailedPreconditionError: another member's chunk could
            not be read (its owner is down too, or evicted that step).
    """
    others = [(m, _manifest(m)) for m in slot.members if m.key != target.key]
    expect = max([layout.chunk_span(man.nbytes, m.chunks, m.chunk)[1] for m, man in others]
                 + [layout.chunk_span(_manifest(target).nbytes, target.chunks, target.chunk)[1]])
    if slot.size != expect:
        raise DataLossError(f"parity slot {slot.n} is {slot.size} bytes; its members' chunks need {expect}")
    buf = bytearray(slot.size)
    got = await run_blocking(os.preadv, fd, [buf], 0) if slot.size else 0
    if got != slot.size:
        raise DataLossError(f"parity slot {slot.n} has {got} of its {slot.size} bytes")
    actual = await run_blocking(checksum.digest, buf)
    if actual != slot.checksum:
        if metrics:
            metrics.checksum_failures.labels(tier="peer").inc()
        tm = _manifest(target)
        msg = (f"parity slot of {tm.job} step {tm.step} on {node_id} fails its checksum (expected {slot.checksum}, "
               f"got {actual})")
        log.error("%s", msg)
        raise DataLossError(msg)
    # every member's chunk at once; each XOR runs on the event loop, so one at a time
    await asyncio.gather(*(_xor_member(node_id, store, cluster, buf, m, man) for m, man in others))
    _, length = layout.chunk_span(_manifest(target).nbytes, target.chunks, target.chunk)
    return memoryview(buf)[:length]


def _manifest(m: Member) -> Manifest:
    try:
        return Manifest.from_json(m.manifest)
    except DataLossError as e:
        raise DataLossError(f"parity slot member {m.key}: {e}") from None


async def _xor_member(node_id: str, store: LocalStore, cluster: Membership, buf: bytearray, m: Member,
                      man: Manifest) -> None:
    off, length = layout.chunk_span(man.nbytes, m.chunks, m.chunk)
    local = store.get(*man.key)
    if local is not None and local.generation == man.generation:  # held here: no network
        held, pos = local, 0
        it = read_range(lambda n: store.open_shard(held, n), held, off, length)
        try:
            while (b := await run_blocking(next, it, None)) is not None:
                xor_into(memoryview(buf)[pos:], b)
                pos += len(b)
        finally:
            it.close()
        return
    if man.node == node_id or man.node not in cluster.peers:
        raise UnavailableError(f"{man.key} generation {man.generation} is held by no live node known here")

    async def sink(pos: int, data: bytes) -> None:
        xor_into(memoryview(buf)[pos:], data)

    await pull_range(cluster, man.node, node_id, man, off, length, sink)
