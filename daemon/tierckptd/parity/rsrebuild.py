"""Reconstructing a lost rank from Reed-Solomon parity, on the restoring node.

For each chunk: the lane of its stripe (:mod:`.rslayout`) with the most rows still answering,
that lane's rows (``ReadParityRow``: each holder checks its row's checksum first) and the other
members' chunks (``ReadRankRange`` from their owners, or this node's store); up to M of the
lane's data blocks may be missing (:func:`.rsdecode.solve`). The staging, the check of every
shard against the rank's manifest and the commit are :class:`.rebuild.Rebuilder`'s. More than M
blocks of a stripe lost, or a corrupt row where no spare row is left, fail the reconstruction:
the restore moves on to the next tier (the persistent one, or a DataLossError naming the row).

The restoring node reads k blocks per chunk (k times the rank's bytes), where XOR parity's
distributed decode reads the rank's bytes once: the price of decoding where the rows meet.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
from tierckpt.common import checksum
from tierckpt.common.status import error_from_rpc
from tierckpt.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
    UnavailableError,
)
from tierckpt.v1 import peer_pb2 as ppb

from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..offload import run_blocking
from . import layout, rslayout
from .bulkdecode import Into, Pulls, W
from .decode import pull_range
from .farside import pull_rebuilt
from .ranges import read_range, write_range
from .rebuild import Rebuilder
from .rsdecode import solve
from .rsprotector import RsProtector, check_row

__all__ = ["RsRebuilder"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Rec:
    holder: str
    man: Manifest
    chunk: int
    chunks: int
    stripe: int
    lane: str
    row: int


@dataclass
class _Plan:
    lane: tuple[int, str]  # (stripe, lane)
    rows: dict[int, str]  # row -> holder
    members: dict[int, dict[int, Manifest]]  # row -> data position -> member's manifest

    def positions(self, man: Manifest, chunk: int) -> dict[int, Manifest]:
        """Data position -> its member's manifest, across the lane's rows, ``chunk`` being ``man``'s."""
        out: dict[int, Manifest] = {}
        for ms in self.members.values():
            out.update(ms)
        out[chunk] = man
        return out


class RsRebuilder(Rebuilder):
    """:class:`.rebuild.Rebuilder` with the chunks decoded here from the rows of their lanes."""

    protector: RsProtector  # type: ignore[assignment]  # the Reed-Solomon holder side, passed in by the facade

    def near(self) -> set[str]:
        return (set(self.protector.group(self.node_id)) | self.cluster.watched()) - {self.node_id}

    async def records(self, job: str, step: int | None, rank: int | None, nodes: set[str] | None) -> list[_Rec]:
        req = ppb.ParityLookupRequest(requester=self.node_id, job=job, has_step=step is not None, step=step or 0,
                                      has_rank=rank is not None, rank=rank or 0, parity_k=self.protector.k,
                                      parity_m=self.protector.m)
        answers, _ = await self.cluster.fan_out("ParityLookup", req, nodes)
        mine = self.protector.lookup(job, step, rank)
        out = []
        for node, resp in [(p.node_id, r) for p, r in answers] + [(self.node_id, mine)]:
            for r in resp.ranks:
                try:
                    if r.parity_rows < 2:
                        continue  # an XOR slot (a node configured otherwise): not part of this code
                    if r.parity_rows != self.protector.m:
                        raise InvalidArgumentError(f"parity_rows: {r.parity_rows}, this node's code has M = "
                                                   f"{self.protector.m}")
                    check_row(r.row, self.protector.m)
                    rslayout.check_lane(r.lane, 1)
                    if not r.chunk < r.chunks <= 64 or r.stripe >= 64:
                        raise InvalidArgumentError(f"chunk: {r.chunk} of {r.chunks} (stripe {r.stripe}) is not a "
                                                   "chunk of a group of at most 64 nodes")
                    out.append(_Rec(node, Manifest.from_json(r.manifest_json), r.chunk, r.chunks, r.stripe, r.lane,
                                    r.row))
                except TierckptError as e:
                    log.error("parity record from %s refused: %s", node, e)
        return out

    async def locate(self, job: str, step: int | None, rank: int | None,
                     nodes: set[str] | None) -> list[tuple[str, Manifest, int, int]]:
        return [(r.holder, r.man, r.chunk, r.chunks) for r in await self.records(job, step, rank, nodes)]

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        recs = await self.records(job, step, None, self.near()) or await self.records(job, step, None, None)
        newest, plans, total = self.plans(recs, job, step, rank, lambda m: job_owner in (None, m.job_owner))
        return await self.reconstruct(newest, self._deciders(plans), total)  # type: ignore[arg-type]

    @classmethod
    def plans(cls, recs: list[_Rec], job: str, step: int, rank: int,
              wanted: Any = lambda m: True) -> tuple[Manifest, dict[int, list[_Plan]], int]:
        """The newest protected copy of ``job`` step ``step`` rank ``rank`` among ``recs`` whose
        manifest passes ``wanted``: (its manifest, chunk -> its lanes' plans, most rows first, chunks).

        Raises:
            NotFoundError: no record of it. DataLossError: its records disagree on the chunk count.
            UnavailableError: a chunk has no row on a live peer.
        """
        mine = [r for r in recs if r.man.key == (job, step, rank) and wanted(r.man)]
        if not mine:
            raise NotFoundError(f"{job} step {step} rank {rank} is not protected by parity on any live peer")
        newest = max(mine, key=lambda r: r.man.created).man
        mine = [r for r in mine if r.man.generation == newest.generation]
        total = mine[0].chunks
        if not 1 <= total <= 64 or any(r.chunks != total or r.chunk >= total for r in mine):
            raise DataLossError(f"{job} step {step} rank {rank}: its parity records disagree on the chunk count")
        plans: dict[int, list[_Plan]] = {}
        for c in range(total):
            lanes = Counter((r.stripe, r.lane) for r in mine if r.chunk == c)
            if not lanes:
                raise UnavailableError(f"{job} step {step} rank {rank}: no parity row of chunk {c} is on a live peer")
            plans[c] = [cls._plan(recs, mine, c, total, lane) for lane, _ in lanes.most_common()]
        return newest, plans, total

    def _deciders(self, plans: dict[int, list[_Plan]]) -> dict[int, tuple[list[_Plan], str | None]]:
        """Chunk -> (its plans, the survivor asked to decode it: a row holder of its first lane,
        the least loaded so far, so that the decodes' pulls spread over different nodes' links;
        None: none but this node)."""
        load: Counter[str] = Counter()
        out: dict[int, tuple[list[_Plan], str | None]] = {}
        for c, ps in sorted(plans.items()):
            cands = sorted(set(ps[0].rows.values()) - {self.node_id}, key=lambda n: (load[n], n))
            if cands:
                load[cands[0]] += 1
            out[c] = (ps, cands[0] if cands else None)
        return out

    @staticmethod
    def _plan(recs: list[_Rec], mine: list[_Rec], c: int, total: int, lane: tuple[int, str]) -> _Plan:
        """Chunk ``c``'s rows in ``lane`` and each row's members (as their holders answered)."""
        rows = {r.row: r.holder for r in mine if r.chunk == c and (r.stripe, r.lane) == lane}
        members: dict[int, dict[int, Manifest]] = {j: {} for j in rows}
        for r in recs:
            if (r.stripe, r.lane) == lane and rows.get(r.row) == r.holder and r.chunks == total:
                members[r.row][r.chunk] = r.man
        return _Plan(lane, rows, members)

    async def _chunk(self, man: Manifest, chunk: int, chunks: int, holder: Any, opener: Any) -> None:
        """Chunk ``chunk`` decoded by a survivor of its stripe and pulled from it over the bulk
        channel (:mod:`.rsfar`); else decoded here from the first of its lanes that decodes."""
        plans, via = holder
        pulls = self.pulls()
        if pulls is not None and via is not None:
            try:
                self.count_bulk(await pull_rebuilt(pulls, man, chunk, chunks, via, opener))
                return
            except (TierckptError, OSError) as e:  # an older daemon, a lost or corrupt row there: decode here
                log.warning("chunk %d of %s step %d rank %d: %s could not decode it for us over bulk (%s); "
                            "decoding it here", chunk, man.job, man.step, man.rank, via, e)
        data = await self.solve_chunk(man, chunk, chunks, plans)
        off, _ = layout.chunk_span(man.nbytes, chunks, chunk)
        await run_blocking(write_range, opener, man, off, data)

    async def solve_chunk(self, man: Manifest, chunk: int, chunks: int, plans: list[_Plan]) -> Any:
        """Chunk ``chunk`` of ``man`` (its bytes) decoded here from the first of its lanes (most
        rows first) that decodes."""
        for i, plan in enumerate(plans):
            try:
                return await self._chunk_in(man, chunk, chunks, plan)
            except (UnavailableError, DataLossError) as e:
                if i == len(plans) - 1:
                    raise
                log.info("chunk %d of %s step %d rank %d: lane %s did not decode (%s); trying lane %s", chunk,
                         man.job, man.step, man.rank, plan.lane[1], e, plans[i + 1].lane[1])
        raise UnavailableError(f"chunk {chunk} of {man.job} step {man.step} rank {man.rank}: no lane to decode")

    async def _chunk_in(self, man: Manifest, chunk: int, chunks: int, plan: _Plan) -> Any:
        _, length = layout.chunk_span(man.nbytes, chunks, chunk)
        codec = self.protector.codec(chunks)
        positions = plan.positions(man, chunk)
        known: dict[int, bytes | bytearray] = {}
        reads = {i: self._member(m, i, chunks) for i, m in positions.items() if i != chunk}
        got = await asyncio.gather(*reads.values(), return_exceptions=True)
        for i, res in zip(reads, got):
            if isinstance(res, asyncio.CancelledError):
                raise res
            if not isinstance(res, BaseException):
                known[i] = res
        unknown = [chunk, *sorted(i for i in positions if i != chunk and i not in known)]
        expect = max(layout.chunk_span(mm.nbytes, chunks, i)[1] for i, mm in positions.items())
        # as many rows as there are unknowns first (each row holder sends a chunk's worth), the
        # others only where those do not solve (a row lost, corrupt, or not holding every unknown)
        first = sorted(plan.rows)[:len(unknown)]
        rows: dict[int, Any] = {}
        lost: list[BaseException] = []
        await self._rows(man, plan, first, expect, rows, lost)
        try:
            try:
                data = await run_blocking(solve, codec, chunk, known, unknown, rows, length)
            except UnavailableError:
                rest = [j for j in plan.rows if j not in first]
                if not rest:
                    raise
                await self._rows(man, plan, rest, expect, rows, lost)
                data = await run_blocking(solve, codec, chunk, known, unknown, rows, length)
        except UnavailableError as e:
            bad = next((x for x in lost if isinstance(x, DataLossError)), None)
            msg = f"chunk {chunk} of {man.job} step {man.step} rank {man.rank}: {e}"
            log.error("%s%s", msg, f" ({bad})" if bad else "")
            raise (DataLossError(f"{msg}; {bad}") if bad else UnavailableError(msg)) from None
        return data

    async def _rows(self, man: Manifest, plan: _Plan, which: list[int], expect: int, rows: dict[int, Any],
                    lost: list[BaseException]) -> None:
        """Read rows ``which`` of ``plan`` at once into ``rows`` (row -> (bytes, its members)); a
        row that cannot be read goes to ``lost``."""
        got = await asyncio.gather(*(self._row(man, plan, j, expect) for j in which), return_exceptions=True)
        for j, got_row in zip(which, got):
            if isinstance(got_row, asyncio.CancelledError):
                raise got_row
            if isinstance(got_row, BaseException):
                lost.append(got_row)
            else:
                rows[j] = (got_row, set(plan.members[j]))

    async def _member(self, m: Manifest, position: int, chunks: int) -> bytes:
        """Data block ``position`` of member ``m`` (a chunk of its rank), from here or its owner."""
        off, length = layout.chunk_span(m.nbytes, chunks, position)
        buf = bytearray(length)
        local = self.store.get(*m.key)
        if local is not None and local.generation == m.generation:
            held, pos = local, 0
            it = read_range(lambda n: self.store.open_shard(held, n), held, off, length)
            try:
                while (b := await run_blocking(next, it, None)) is not None:
                    buf[pos:pos + len(b)] = b
                    pos += len(b)
            finally:
                it.close()
            return bytes(buf)
        if m.node == self.node_id or m.node not in self.cluster.peers:
            raise UnavailableError(f"{m.key} is held by no live node known here")

        pulls = self.pulls()
        if pulls is not None:
            try:
                await self._member_bulk(pulls, m, off, length, buf)
                return bytes(buf)
            except FailedPreconditionError as e:  # e.g. a spent ticket; an owner down fails over gRPC too
                log.warning("%s: bulk pull failed (%s); reading it over gRPC", m.key, e)

        async def sink(pos: int, data: bytes) -> None:
            buf[pos:pos + len(data)] = data

        await pull_range(self.cluster, m.node, self.node_id, m, off, length, sink)
        return bytes(buf)

    async def _row_bulk(self, pulls: Pulls, holder: str, req: ppb.ReadParityRowRequest, expect: int) -> bytearray:
        """A row over the bulk channel: its holder checks it first, this node hashes what arrives."""
        try:
            resp = await self.cluster.call(self.cluster.peers[holder], "OpenRowRead", req)
        except TierckptError as e:
            log.warning("row %d of %s step %d from %s: %s", req.row, req.job, req.step, holder, e)
            raise
        if resp.size > expect:
            raise DataLossError(f"peer {holder} describes parity row {req.row} as {resp.size} bytes; its members "
                                f"need {expect}")
        buf = bytearray(resp.size)

        def add(w: int, data: memoryview) -> None:
            buf[w * W:w * W + len(data)] = data

        hasher = checksum.new()
        into = Into(add)
        src = pulls.slot(holder, resp, resp.size, hasher)
        await pulls.run([lambda: src(into)])
        self.count_bulk(into.moved)
        if hasher.hexdigest() != resp.checksum:
            if self.metrics:
                self.metrics.checksum_failures.labels(tier="peer").inc()
            raise DataLossError(f"parity row {req.row} of {req.job} step {req.step} from {holder} fails its checksum "
                                f"on receipt (expected {resp.checksum}, got {hasher.hexdigest()})")
        return buf

    async def _member_bulk(self, pulls: Pulls, m: Manifest, off: int, length: int, buf: bytearray) -> None:
        """``[off, off + length)`` of member ``m``'s rank into ``buf``, over the bulk channel."""
        def add(w: int, data: memoryview) -> None:
            if w * W + len(data) > length:
                raise DataLossError(f"{m.key}: more than the {length} bytes asked")
            buf[w * W:w * W + len(data)] = data

        src = await pulls.member(m, off, length)
        into = Into(add)
        await pulls.run([lambda: src(into)])
        self.count_bulk(into.moved)

    async def _row(self, man: Manifest, plan: _Plan, row: int, expect: int) -> bytearray:
        """Row ``row`` of the plan's lane (at most ``expect`` bytes: its longest member's chunk)."""
        holder = plan.rows[row]
        stripe, lane = plan.lane
        if holder == self.node_id:
            buf = await self.protector.row_bytes(man.job, man.step, stripe, lane, row)
            if len(buf) > expect:
                raise DataLossError(f"parity row {row} here is {len(buf)} bytes; its members need {expect}")
            return buf
        p = self.cluster.peers[holder]
        req = ppb.ReadParityRowRequest(requester=self.node_id, job=man.job, step=man.step, stripe=stripe, lane=lane,
                                       row=row)
        pulls = self.pulls()
        if pulls is not None:
            try:
                return await self._row_bulk(pulls, holder, req, expect)
            except FailedPreconditionError as e:  # e.g. a holder that cannot issue row tickets
                log.warning("row %d of %s step %d from %s: bulk pull failed (%s); reading it over gRPC", row, man.job,
                            man.step, holder, e)
        buf = bytearray()
        try:
            async for piece in p.stub.ReadParityRow(req, timeout=max(KNOBS.commit_timeout, KNOBS.rpc_timeout)):
                if len(buf) + len(piece.data) > expect:
                    raise DataLossError(f"peer {holder} sent more than the {expect} bytes of parity row {row}")
                buf += piece.data
        except grpc.RpcError as e:
            err = error_from_rpc(e, f"peer {holder} ({p.address})")
            log.warning("row %d of %s step %d from %s: %s", row, man.job, man.step, holder, err)
            raise err from None
        return buf
