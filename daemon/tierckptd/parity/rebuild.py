"""Reconstructing a lost rank from parity: each chunk is its slot's parity XOR the other members'
chunks (read from their owners), written into a staging area; every shard is then checked
against the rank's manifest (kept by each protector) before the copy is committed. A slot that
fails its checksum, or a member whose owner is down too, fails the reconstruction: the restore
moves on to the next tier (more than one node of the group lost -> the persistent tier)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

import grpc
from tierckpt.common import checksum
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import DataLossError, NotFoundError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..knobs import KNOBS
from ..local.localfs import digest_fd
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking, run_owning
from . import layout
from .protector import members_of, pull_range
from .ranges import read_range, write_range
from .xor import xor_into

__all__ = ["Rebuilder"]

log = logging.getLogger(__name__)


class Rebuilder:
    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, size: int, receiver: Any,
                 metrics: Any = None) -> None:
        self.node_id, self.store, self.cluster, self.size = node_id, store, cluster, size
        self.receiver, self.metrics = receiver, metrics

    async def locate(self, job: str, step: int | None, rank: int | None,
                     nodes: set[str] | None) -> list[tuple[str, Manifest, int, int]]:
        """(protector, manifest, chunk, chunks) of every protected copy the peers (``nodes``, else
        all) answer for; unverifiable manifests are skipped (logged)."""
        req = ppb.ParityLookupRequest(requester=self.node_id, job=job, has_step=step is not None, step=step or 0,
                                      has_rank=rank is not None, rank=rank or 0)
        answers, _ = await self.cluster.fan_out("ParityLookup", req, nodes)
        out = []
        for p, resp in answers:
            for r in resp.ranks:
                try:
                    out.append((p.node_id, Manifest.from_json(r.manifest_json), r.chunk, r.chunks))
                except DataLossError as e:
                    log.error("parity manifest from %s refused: %s", p.node_id, e)
        return out

    def near(self) -> set[str]:
        """This node's group and watched neighbourhood (O(group) nodes)."""
        return (set(layout.group_of(self.node_id, self.cluster.ids(), self.size)) | self.cluster.watched()) - {
            self.node_id}

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        found = await self.locate(job, step, rank, self.near()) or await self.locate(job, step, rank, None)
        found = [f for f in found if f[1].key == (job, step, rank) and job_owner in (None, f[1].job_owner)]
        if not found:
            raise NotFoundError(f"{job} step {step} rank {rank} is not protected by parity on any live peer")
        newest = max(found, key=lambda f: f[1].created)[1]
        chunks = {c: (h, n) for h, m, c, n in found if m.generation == newest.generation}
        total = next(iter(chunks.values()))[1]
        if any(c not in chunks for c in range(total)):
            raise UnavailableError(f"{job} step {step} rank {rank}: the parity of chunks "
                                   f"{sorted(set(range(total)) - set(chunks))} is not on any live peer")
        t0 = time.perf_counter()
        self.receiver.restore_begun(1)
        try:
            with self.receiver.fetching_rank((job, step, rank)):
                local = await self._rebuild(newest, {c: h for c, (h, _) in chunks.items()}, total)
        finally:
            self.receiver.restore_begun(-1)
        log.info("reconstructed %s step %d rank %d from parity: %d bytes in %.3fs", job, step, rank, newest.nbytes,
                 time.perf_counter() - t0)
        self.receiver.announce(local)
        return local

    async def _rebuild(self, man: Manifest, holders: dict[int, str], chunks: int) -> Manifest:
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        st = await run_owning(self.store.begin, self.store.abort_staging, man.job, man.step, man.rank, man.world_size,
                              specs, prefault=True, job_owner=man.job_owner)
        try:
            opener = functools.partial(self.store.open_staged, st.save_id)

            async def one(c: int) -> None:
                off, length = layout.chunk_span(man.nbytes, chunks, c)
                buf = await self._chunk(man, c, holders[c], length)
                await run_blocking(write_range, opener, man, off, memoryview(buf)[:length])

            await asyncio.gather(*(one(c) for c in range(chunks)))  # the chunks are independent
            for s in man.shards:
                fd = opener(s.name, os.O_RDONLY)
                try:
                    actual = await run_blocking(digest_fd, fd, s.size)
                finally:
                    os.close(fd)
                if actual != s.checksum:
                    if self.metrics:
                        self.metrics.checksum_failures.labels(tier="peer").inc()
                    msg = (f"{man.job} step {man.step} rank {man.rank}/{s.name}: the copy reconstructed from parity "
                           f"fails its checksum (expected {s.checksum}, got {actual})")
                    log.error("%s", msg)
                    raise DataLossError(msg)
            return await self.receiver.commit_copy(st, man)
        except BaseException:
            await run_blocking(self.store.abort, st.save_id)
            raise

    async def _chunk(self, man: Manifest, chunk: int, holder: str, length: int) -> bytearray:
        """Chunk ``chunk`` of ``man``: the slot from ``holder`` XOR its other members' chunks."""
        p = self.cluster.peers[holder]
        req = ppb.ReadParityRequest(requester=self.node_id, job=man.job, step=man.step, rank=man.rank, owner=man.node,
                                    generation=man.generation, chunk=chunk)
        buf: bytearray | None = None
        size, digest, pos = 0, "", 0
        members: list[dict] = []
        try:
            async for piece in p.stub.ReadParity(req, timeout=max(KNOBS.commit_timeout, KNOBS.rpc_timeout)):
                if buf is None:
                    size, digest, members = members_of(piece.meta_json)
                    expect = max((_span(m)[1] for m in members), default=0)
                    if size != expect or size < length:
                        raise DataLossError(f"parity slot on {holder} is {size} bytes; its members' chunks need "
                                            f"{expect} (and this chunk {length})")
                    buf = bytearray(size)
                    continue
                if pos + len(piece.data) > size:
                    raise DataLossError(f"parity slot on {holder} sent more than its {size} bytes")
                buf[pos:pos + len(piece.data)] = piece.data
                pos += len(piece.data)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"peer {holder} ({p.address})") from None
        if buf is None or pos != size:
            raise UnavailableError(f"parity slot on {holder}: {pos} of {size} bytes arrived")
        actual = await run_blocking(checksum.digest, memoryview(buf)[:size])
        if actual != digest:
            if self.metrics:
                self.metrics.checksum_failures.labels(tier="peer").inc()
            msg = (f"parity slot of {man.job} step {man.step} on {holder} fails its checksum (expected {digest}, "
                   f"got {actual})")
            log.error("%s", msg)
            raise DataLossError(msg)
        # the other members' chunks, all at once (every XOR runs on the event loop: one at a time)
        await asyncio.gather(*(self._xor_member(buf, m) for m in members if (m["node"], m["rank"], m["generation"],
                               m["chunk"]) != (man.node, man.rank, man.generation, chunk)))
        return buf

    async def _xor_member(self, buf: bytearray, m: dict) -> None:
        other, (off, length) = m["man"], _span(m)
        if length > len(buf):
            raise DataLossError(f"parity slot is shorter than the chunk of {other.key} it protects")
        local = self.store.get(*other.key)
        if local is not None and local.generation == other.generation:  # held here: no network
            held, pos = local, 0
            it = read_range(lambda n: self.store.open_shard(held, n), held, off, length)
            try:
                while (b := await run_blocking(next, it, None)) is not None:
                    xor_into(memoryview(buf)[pos:], b)
                    pos += len(b)
            finally:
                it.close()
            return
        if other.node == self.node_id:
            raise UnavailableError(f"{other.key} generation {other.generation} is no longer held here")

        async def sink(pos: int, data: bytes) -> None:
            xor_into(memoryview(buf)[pos:], data)

        await pull_range(self.cluster, other.node, self.node_id, other, off, length, sink)


def _span(m: dict) -> tuple[int, int]:
    """(offset, length) of a slot member's chunk in its rank; parses (and checks the MAC of) its
    manifest once, kept as ``m["man"]``."""
    try:
        if "man" not in m:
            m["man"] = Manifest.from_json(m["manifest"])
        chunks, chunk = int(m["chunks"]), int(m["chunk"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataLossError(f"parity slot member is malformed: {e}") from None
    if not 0 <= chunk < chunks:
        raise DataLossError(f"parity slot member names chunk {chunk} of {chunks}")
    return layout.chunk_span(m["man"].nbytes, chunks, chunk)
