"""Reed-Solomon rebuild decoded on a survivor of the stripe, both hops over the bulk channel.

Why: decoding a lost chunk on the restoring node (:mod:`.rsrebuild`) makes it receive K blocks of
the chunk's stripe (the other members' chunks and enough rows) through its own link: about K times
a replica fetch where NICs are the limit. Here a node holding a row of the chunk's lane decodes it
(``OpenRebuiltChunk``, the RPC XOR parity uses: :mod:`.farside`): it pulls the K-1 other blocks it
needs over the bulk channel (its own row is read here), solves the lane, and serves the chunk to
the restorer over a bulk ticket, so the restorer receives the rank once and the K-1 pulls of each
chunk land on the link of the survivor decoding it (the restorer spreads the chunks over
different row holders: :meth:`.rsrebuild.RsRebuilder._deciders`).

Same checks as the restorer's decode, because it is the same code (:meth:`.rsrebuild.RsRebuilder.
solve_chunk`): what is decoded comes from the MAC-checked manifests of the row holders' lookup
answers, not from the request (which only names the rank and chunk); every row is checked against
its checksum (here, or by its holder and again on receipt); lanes are tried in turn. Same bounds and
serving as XOR's (:class:`.farside.FarDecoder`: ``MAX_DECODES``, a private unlinked file, the end
held back until the decode is done, a failed decode cuts the stream and the restorer decodes the
chunk itself). The restorer checks the rebuilt rank against its manifest before serving it.

Pipelined as XOR's: the lost chunk is a fixed combination of the blocks chosen, so each is scaled
and XORed in as it arrives (:mod:`.rsstream`) and the restorer's pull overlaps the decoder's. Where
those blocks cannot all be opened (a row lost or corrupt here, too few rows), the lane is solved
once its blocks are in, rows and lanes tried in turn as the restorer would, and written in windows.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from tierckpt.errors import NotFoundError, TierckptError
from tierckpt.v1 import peer_pb2 as ppb

from ..local.manifest import Manifest
from ..offload import run_blocking
from .bulkdecode import Pulls
from .farside import WINDOW, FarDecoder
from .rsstream import open_streamed

__all__ = ["RsFarDecoder"]

log = logging.getLogger(__name__)


class RsFarDecoder(FarDecoder):
    """``OpenRebuiltChunk`` of one Reed-Solomon code: the chunk decoded by this row holder.

    Args:
        rebuilder: the code's :class:`.rsrebuild.RsRebuilder` (its lookups and lane solving).
    """

    def __init__(self, node_id: str, protector: Any, pulls: Callable[[], Pulls | None], metrics: Any,
                 rebuilder: Any) -> None:
        super().__init__(node_id, protector, pulls, metrics)
        self.rebuilder = rebuilder

    def scratch(self) -> Any:
        return self.protector.rstore

    async def find(self, req: ppb.RebuildChunkRequest) -> tuple[Manifest, int, int, Any]:
        """The rank's lanes of chunk ``req.chunk`` in which this node holds a row, from the row
        holders' answers (the lane's other members' manifests are needed too: all ranks).

        Raises:
            NotFoundError: no such copy, or this node holds no row of that chunk.
        """
        r = self.rebuilder

        def wanted(m: Manifest) -> bool:
            return m.node == req.owner and m.generation == req.generation

        recs = await r.records(req.job, req.step, None, r.near())
        if not any(x.man.key == (req.job, req.step, req.rank) and wanted(x.man) and x.holder == self.node_id
                   for x in recs):
            raise NotFoundError(f"node {self.node_id} holds no row of {req.job} step {req.step} rank {req.rank} "
                                f"of {req.owner} (generation {req.generation})")
        man, plans, total = r.plans(recs, req.job, req.step, req.rank, wanted)
        mine = [p for p in plans.get(req.chunk, []) if self.node_id in p.rows.values()] if req.chunk < total else []
        if not mine:
            raise NotFoundError(f"node {self.node_id} holds no row of chunk {req.chunk} of {req.job} step "
                                f"{req.step} rank {req.rank}")
        return man, req.chunk, total, mine

    async def start(self, pulls: Pulls, man: Manifest, chunk: int, chunks: int, found: Any,
                    write: Callable[[int, Any], None]) -> Any:
        """Decoded as its blocks arrive (:mod:`.rsstream`) in the first lane whose sources open;
        else solved once they are all in, trying rows and lanes in turn (the restorer's own decode)."""
        for plan in found:
            try:
                return await open_streamed(self.rebuilder, pulls, man, chunk, chunks, plan, write, WINDOW)
            except (TierckptError, OSError) as e:
                log.info("chunk %d of %s step %d rank %d: lane %s cannot be decoded as it arrives (%s)", chunk,
                         man.job, man.step, man.rank, plan.lane[1], e)
        return _RsDecode(self.rebuilder, man, chunk, chunks, found, write)


class _RsDecode:
    """One chunk solved here for a restoring node (:class:`.farside.Decode`)."""

    def __init__(self, rebuilder: Any, man: Manifest, chunk: int, chunks: int, plans: list, write: Any) -> None:
        self.moved = [0]
        self.rebuilder = copy.copy(rebuilder)  # its pulls counted as decoding for others, not as restoring
        self.rebuilder.count_bulk = lambda n: self.moved.__setitem__(0, self.moved[0] + n)
        self.man, self.chunk, self.chunks, self.plans, self.write = man, chunk, chunks, plans, write

    async def run(self) -> int:
        data = memoryview(await self.rebuilder.solve_chunk(self.man, self.chunk, self.chunks, self.plans))
        await run_blocking(_write_windows, self.write, data)
        return self.moved[0]

    def close(self) -> None:
        """Nothing is opened before :meth:`run`."""


def _write_windows(write: Callable[[int, Any], None], data: memoryview) -> None:
    for at in range(0, len(data), WINDOW):
        write(at, data[at:at + WINDOW])
