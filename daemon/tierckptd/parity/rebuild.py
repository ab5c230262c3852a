"""Reconstructing a lost rank from parity: each chunk is decoded by the node holding its slot
(the slot XOR the other members' chunks, pulled over the bulk channel) and pulled from it here over
the bulk channel (:mod:`.farside`, ``OpenRebuiltChunk``), all chunks at once, into a staging area.
A holder that cannot (an older daemon) gives its slot instead and the chunk is decoded here
(:mod:`.xorpull`), else it decodes the chunk and streams it over gRPC (``RebuildChunk``). Every
shard is then checked against the rank's manifest (kept by each protector) before the copy is
committed. A slot that
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
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import DataLossError, NotFoundError, TierckptError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..knobs import KNOBS
from ..local.localfs import digest_fd
from ..local.manifest import Manifest
from ..local.store import LocalStore
from ..offload import run_blocking, run_owning
from . import layout
from .bulkdecode import Pulls
from .farside import pull_rebuilt
from .protector import Protector
from .ranges import write_range
from .xorpull import pull_chunk

__all__ = ["Rebuilder"]

log = logging.getLogger(__name__)


class Rebuilder:
    def __init__(self, node_id: str, store: LocalStore, cluster: Membership, size: int, receiver: Any,
                 protector: Protector, metrics: Any = None, transfer: Any = None) -> None:
        self.node_id, self.store, self.cluster, self.size = node_id, store, cluster, size
        self.receiver, self.protector, self.metrics = receiver, protector, metrics
        self.transfer = transfer  # the peer tier's BulkClient (None: every block over gRPC)

    def pulls(self) -> Pulls | None:
        """Bulk connections for one chunk's blocks (None without a bulk client)."""
        return Pulls(self.node_id, self.store, self.cluster, self.transfer) if self.transfer is not None else None

    def count_bulk(self, nbytes: int) -> None:
        if self.metrics and nbytes:
            self.metrics.parity_rebuild_bulk_bytes.inc(nbytes)

    async def locate(self, job: str, step: int | None, rank: int | None,
                     nodes: set[str] | None) -> list[tuple[str, Manifest, int, int]]:
        """(protector, manifest, chunk, chunks) of every protected copy the peers (``nodes``, else
        all) answer for; unverifiable manifests are skipped (logged)."""
        req = ppb.ParityLookupRequest(requester=self.node_id, job=job, has_step=step is not None, step=step or 0,
                                      has_rank=rank is not None, rank=rank or 0, parity_k=self.size - 1, parity_m=1)
        answers, _ = await self.cluster.fan_out("ParityLookup", req, nodes)
        mine = self.protector.lookup(job, step, rank)  # this node protects chunks too
        out = []
        for node, resp in [(p.node_id, r) for p, r in answers] + [(self.node_id, mine)]:
            for r in resp.ranks:
                try:
                    out.append((node, Manifest.from_json(r.manifest_json), r.chunk, r.chunks))
                except DataLossError as e:
                    log.error("parity manifest from %s refused: %s", node, e)
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
        return await self.reconstruct(newest, {c: h for c, (h, _) in chunks.items()}, total)

    async def reconstruct(self, man: Manifest, holders: dict[int, Any], chunks: int) -> Manifest:
        """Rebuild ``man``'s rank into the local tier from its ``chunks`` chunks' ``holders`` (what
        :meth:`_rebuild` takes), counted as a restore under way, logged and announced."""
        t0 = time.perf_counter()
        self.receiver.restore_begun(1)
        try:
            with self.receiver.fetching_rank(man.key):
                local = await self._rebuild(man, holders, chunks)
        finally:
            self.receiver.restore_begun(-1)
        log.info("reconstructed %s step %d rank %d from parity: %d bytes in %.3fs", man.job, man.step, man.rank,
                 man.nbytes, time.perf_counter() - t0)
        self.receiver.announce(local)
        return local

    async def _rebuild(self, man: Manifest, holders: dict[int, str], chunks: int) -> Manifest:
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        t0 = time.perf_counter()
        st = await run_owning(self.store.begin, self.store.abort_staging, man.job, man.step, man.rank, man.world_size,
                              specs, prefault=True, job_owner=man.job_owner)
        try:
            opener = functools.partial(self.store.open_staged, st.save_id)
            t1 = time.perf_counter()
            await asyncio.gather(*(self._chunk(man, c, chunks, holders[c], opener) for c in range(chunks)))
            t2 = time.perf_counter()
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
            t3 = time.perf_counter()
            local = await self.receiver.commit_copy(st, man)
            log.info("rebuilt %s step %d rank %d: staging %.3fs, blocks and decode %.3fs, verify %.3fs, commit %.3fs",
                     man.job, man.step, man.rank, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
            return local
        except BaseException:
            await run_blocking(self.store.abort, st.save_id)
            raise

    async def _chunk(self, man: Manifest, chunk: int, chunks: int, holder: str, opener: Any) -> None:
        """Chunk ``chunk`` of ``man`` into the staging files: decoded by ``holder`` (its slot's
        node) and pulled over the bulk channel (:mod:`.farside`); else decoded here from blocks
        pulled over the bulk channel (:mod:`.xorpull`); else decoded by ``holder`` and streamed
        over gRPC."""
        pulls = self.pulls()
        if pulls is not None and holder != self.node_id:
            try:
                self.count_bulk(await pull_rebuilt(pulls, man, chunk, chunks, holder, opener))
                return
            except DataLossError:
                raise
            except (TierckptError, OSError) as e:
                log.warning("chunk %d of %s step %d rank %d: %s could not decode it for us over bulk (%s); "
                            "decoding it here", chunk, man.job, man.step, man.rank, holder, e)
            pulls = self.pulls()  # the failed one was cut
        if pulls is not None:
            try:
                self.count_bulk(await pull_chunk(pulls, self.protector, man, chunk, chunks, holder, opener,
                                                 self.metrics))
                return
            except DataLossError:
                raise
            except (TierckptError, OSError) as e:
                log.warning("chunk %d of %s step %d rank %d: bulk rebuild failed (%s); decoding it on %s", chunk,
                            man.job, man.step, man.rank, e, holder)
        off, length = layout.chunk_span(man.nbytes, chunks, chunk)
        if holder == self.node_id:  # its slot is here
            pieces = self.protector.rebuild_chunk(man.job, man.step, man.node, man.rank, man.generation, chunk)
            where = "here"
        else:
            p = self.cluster.peers[holder]
            req = ppb.RebuildChunkRequest(requester=self.node_id, job=man.job, step=man.step, rank=man.rank,
                                          owner=man.node, generation=man.generation, chunk=chunk)
            pieces = p.stub.RebuildChunk(req, timeout=max(KNOBS.commit_timeout, KNOBS.rpc_timeout))
            where = f"peer {holder} ({p.address})"
        pos = 0
        try:
            async for piece in pieces:
                if pos + len(piece.data) > length:
                    raise DataLossError(f"peer {holder} sent more than the {length} bytes of chunk {chunk}")
                await run_blocking(write_range, opener, man, off + pos, piece.data)
                pos += len(piece.data)
        except grpc.RpcError as e:
            err = error_from_rpc(e, where)
            log.error("chunk %d of %s step %d rank %d could not be decoded on %s: %s", chunk, man.job, man.step,
                      man.rank, holder, err)
            raise err from None
        if pos != length:
            raise UnavailableError(f"peer {holder} sent {pos} of the {length} bytes of chunk {chunk}")
