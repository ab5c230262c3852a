"""The owner side of Reed-Solomon parity: the :class:`.encoder.Encoder` protocol (background
task per rank, retries, ``wait("peer")``, catch-up when a holder restarted) over targets
``"holder|chunk|row"`` (:func:`.rslayout.targets`) instead of one chunk per protector.

Per chunk the holder of row 0 is asked first: it assigns the lane (which rows of the stripe the
chunk joins) and the holders of the other rows are then asked with that lane, so that the M rows
of a lane sum the same members. A row-0 holder that restarted (its instance changed) is asked
again, and so are the chunk's other rows (its answer may be a new lane).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tierckpt.errors import TierError
from tierckpt.v1 import peer_pb2 as ppb

from ..knobs import KNOBS
from ..local.manifest import Manifest
from . import rslayout
from .encoder import Encoder, _Prot

__all__ = ["RsEncoder", "target", "parse_target"]

log = logging.getLogger(__name__)


def target(holder: str, chunk: int, row: int) -> str:
    return f"{holder}|{chunk}|{row}"


def parse_target(t: str) -> tuple[str, int, int]:
    holder, chunk, row = t.rsplit("|", 2)
    return holder, int(chunk), int(row)


class RsEncoder(Encoder):
    """Protection of the ranks this node owns with ``parity:K+M`` (M >= 2)."""

    def __init__(self, *args, k: int, m: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.k, self.m = k, m
        self.shape = (k, m)
        self._lanes: dict[tuple, asyncio.Future] = {}  # (rank key, generation, chunk) -> row 0's answer

    def group(self) -> list[str]:
        return rslayout.group(self.node_id, self.cluster.ids(), self.k, self.m)

    def protectors(self) -> list[str]:
        return [target(h, c, j) for h, c, j in rslayout.targets(self.node_id, self.group(), self.m)]

    def holder_nodes(self) -> set[str]:
        return {h for h, _, _ in rslayout.targets(self.node_id, self.group(), self.m)}

    @staticmethod
    def node_of(t: str) -> str:
        return parse_target(t)[0]

    def ensure(self, man: Manifest) -> _Prot:
        st = super().ensure(man)
        # a chunk whose row 0 is to be asked again is asked again on every row (the lane may change);
        # the task just scheduled has not run yet, so it sees these targets missing
        redo = {parse_target(t)[1] for t in st.holders if parse_target(t)[2] == 0 and t not in st.acked}
        for t in [t for t in st.acked if parse_target(t)[1] in redo]:
            del st.acked[t]
        return st

    async def wait(self, man: Manifest) -> list[str]:
        return sorted({self.node_of(t) for t in await super().wait(man)})

    def reconcile(self, job: str, answered: set[str], held: set[tuple[str, int, int, str, int]]) -> None:
        """``held``: (target, step, rank, generation, 0) the ``answered`` holders keep of ``job``."""
        for st in list(self._prots.values()):
            if st.man.job != job or st.man.node != self.node_id:
                continue
            lost = [t for t in st.acked if self.node_of(t) in answered
                    and (t, st.man.step, st.man.rank, st.man.generation, 0) not in held]
            for t in lost:
                log.warning("parity of %s step %d rank %d is no longer on %s: protecting it again", job, st.man.step,
                            st.man.rank, self.node_of(t))
                del st.acked[t]
            if lost:
                self.ensure(st.man)

    async def _ask(self, man: Manifest, holder: str, chunk: int, chunks: int) -> str:
        """Have ``holder`` (a target) keep its row; returns its instance."""
        node, c, row = parse_target(holder)
        lk = (man.key, man.generation, c)
        if row == 0:
            fut = self._lanes[lk] = asyncio.get_running_loop().create_future()
            try:
                resp = await self._call(man, node, c, 0, "")
                rslayout.check_lane(resp.lane, 1)  # a hostile answer is refused like a request
            except BaseException:
                fut.set_result(None)  # the other rows of this round give up (asked again next round)
                raise
            fut.set_result(resp.lane)
        else:
            lane_fut = self._lanes.get(lk)
            lane = await asyncio.shield(lane_fut) if lane_fut is not None else None
            if not lane:
                raise TierError(f"row 0 of chunk {c} of {man.key} is not protected yet: its lane is unknown")
            await self._call(man, node, c, row, lane)
        return self.cluster.peers[node].instance

    async def _call(self, man: Manifest, node: str, chunk: int, row: int, lane: str) -> ppb.ProtectRankResponse:
        p = self.cluster.peers[node]
        t0 = time.perf_counter()
        resp = await self.cluster.call(p, "ProtectRank", ppb.ProtectRankRequest(
            sender=self.node_id, manifest_json=man.to_json().decode(), chunk=chunk,
            chunks=rslayout.data_blocks(self.group(), self.m), row=row, lane=lane, parity_k=self.k, parity_m=self.m),
            max(KNOBS.commit_timeout, KNOBS.rpc_timeout))
        if not resp.already:
            log.info("parity of %s step %d rank %d chunk %d row %d (lane %s) committed on %s in %.3fs (row %d "
                     "bytes)", man.job, man.step, man.rank, chunk, row, resp.lane, node, time.perf_counter() - t0,
                     resp.parity_bytes)
        return resp

    def forget(self, job, step, ranks, reason) -> None:  # type: ignore[no-untyped-def]
        super().forget(job, step, ranks, reason)
        for lk in [lk for lk in self._lanes if lk[0][0] == job and lk[0][1] == step and lk[0][2] in set(ranks)]:
            del self._lanes[lk]
