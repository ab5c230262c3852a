"""The holder side of the peer tier's parity RPCs (``ProtectRank``, ``ParityLookup``,
``ReadRankRange``, ``RebuildChunk``, ``ReadParityRow``, ``OpenSlotRead``, ``OpenRebuiltChunk``,
``OpenRowRead``), each routed to the parity code it names or to the one holding what it asks for:
a node may hold several codes (:mod:`.shapes`), and most requests do not say which."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tierckpt.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, TierckptError
from tierckpt.v1 import peer_pb2 as ppb

from .facade import Parity

if TYPE_CHECKING:
    from .shapes import ParityShapes

__all__ = ["HeldRequests"]


class HeldRequests:
    """Args:
        shapes: the node's parity codes.
    """

    def __init__(self, shapes: ParityShapes) -> None:
        self.shapes = shapes

    def _requested(self, k: int, m: int) -> Parity:
        """The code a holder-side request names (0/0: the daemon's own)."""
        if not k and not m:
            p = self.shapes.get(self.shapes.own)
            if p is None:
                raise FailedPreconditionError(f"redundancy: node {self.shapes.node_id} does not use parity")
            return p
        return self.shapes.obtain((k, m), "parity_k/parity_m")

    def _of_kind(self, *, xor: bool) -> list[Parity]:
        """The codes held here of one kind (XOR or Reed-Solomon), else the daemon's own (whose
        facade answers a request of the other kind FAILED_PRECONDITION)."""
        return [p for p in self.shapes.codes() if (p.m == 1) == xor] or [self._requested(0, 0)]

    def _xor_codes(self) -> list[Parity]:
        codes = [p for p in self.shapes.codes() if p.m == 1]
        if not codes:
            raise FailedPreconditionError(f"redundancy: node {self.shapes.node_id} does not hold XOR parity slots")
        return codes

    async def protect(self, req: ppb.ProtectRankRequest) -> ppb.ProtectRankResponse:
        return await self._requested(req.parity_k, req.parity_m).protect(req)

    def lookup(self, req: ppb.ParityLookupRequest) -> ppb.ParityLookupResponse:
        step = req.step if req.has_step else None
        rank = req.rank if req.has_rank else None
        if req.all_shapes:
            codes = self.shapes.codes()
        else:
            named = (req.parity_k, req.parity_m) if req.parity_k or req.parity_m else self.shapes.own
            p = self.shapes.get(named)
            codes = [p] if p is not None else []
        out = ppb.ParityLookupResponse()
        for p in codes:
            for r in p.protector.lookup(req.job, step, rank).ranks:
                r.parity_k, r.parity_m = p.k, p.m
                out.ranks.append(r)
        return out

    def read_rank_range(self, req: ppb.ReadRankRangeRequest) -> AsyncIterator[ppb.DataPiece]:
        """The owner side of a pull: the same whatever the code (any one serves it)."""
        codes = self.shapes.codes()
        if not codes:
            raise FailedPreconditionError(f"redundancy: node {self.shapes.node_id} does not use parity")
        return codes[0].protector.read_rank_range(req.job, req.step, req.rank, req.generation, req.offset,
                                                  req.length)

    async def rebuild_chunk(self, req: ppb.RebuildChunkRequest) -> AsyncIterator[ppb.DataPiece]:
        """XOR: the chunk decoded from whichever code's slot holds it (the request does not say)."""
        def open_(p: Parity) -> AsyncIterator[ppb.DataPiece]:
            return p.protector.rebuild_chunk(req.job, req.step, req.owner, req.rank, req.generation, req.chunk)

        async for piece in _first_holding(self._of_kind(xor=True), open_):
            yield piece

    async def read_row(self, req: ppb.ReadParityRowRequest) -> AsyncIterator[ppb.DataPiece]:
        """Reed-Solomon: the row from whichever code holds it."""
        def open_(p: Parity) -> AsyncIterator[ppb.DataPiece]:
            return p.read_row(req)

        async for piece in _first_holding(self._of_kind(xor=False), open_):
            yield piece

    async def open_slot_read(self, req: ppb.RebuildChunkRequest, receiver: Any) -> ppb.OpenSlotReadResponse:
        """XOR: a bulk ticket for the slot of whichever code holds it (the request does not say)."""
        return await _first_answer(self._xor_codes(), lambda p: p.protector.open_slot_read(req, receiver))

    async def open_rebuilt_chunk(self, req: ppb.RebuildChunkRequest) -> ppb.OpenSlotReadResponse:
        """The chunk decoded here by whichever code protects it (XOR: its slot; Reed-Solomon: a row of
        its lane), and a bulk ticket for it. An older daemon answered FAILED_PRECONDITION for
        Reed-Solomon codes; the restorer then decodes the chunk itself."""
        codes = sorted(self.shapes.codes(), key=lambda p: p.m)  # XOR first: the request does not say
        if not codes:
            raise FailedPreconditionError(f"redundancy: node {self.shapes.node_id} does not use parity")
        return await _first_answer(codes, lambda p: p.open_rebuilt_chunk(req))

    async def open_row_read(self, req: ppb.ReadParityRowRequest) -> ppb.OpenSlotReadResponse:
        """Reed-Solomon: a bulk ticket for the row of whichever code holds it."""
        return await _first_answer(self._of_kind(xor=False), lambda p: p.open_row_read(req))


async def _first_holding(codes: list[Parity], open_: Callable[[Parity], AsyncIterator[ppb.DataPiece]]
                         ) -> AsyncIterator[ppb.DataPiece]:
    """The pieces of the first code's stream that does not fail NOT_FOUND / INVALID_ARGUMENT /
    FAILED_PRECONDITION before its first piece (else the first code's error)."""
    err: TierckptError | None = None
    for p in codes:
        it = open_(p)
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        except (NotFoundError, InvalidArgumentError, FailedPreconditionError) as e:
            err = err or e
            continue
        yield first
        async for piece in it:
            yield piece
        return
    assert err is not None
    raise err


async def _first_answer(codes: list[Parity], call: Callable[[Parity], Awaitable[ppb.OpenSlotReadResponse]]
                        ) -> ppb.OpenSlotReadResponse:
    """The answer of the first code that does not fail NOT_FOUND / INVALID_ARGUMENT /
    FAILED_PRECONDITION (else the first code's error)."""
    err: TierckptError | None = None
    for p in codes:
        try:
            return await call(p)
        except (NotFoundError, InvalidArgumentError, FailedPreconditionError) as e:
            err = err or e
    assert err is not None
    raise err
