"""A Reed-Solomon chunk decoded as its blocks arrive, for a restoring node (:mod:`.rsfar`).

Why: solving the lane once every block is in (:func:`.rsdecode.solve`) makes the restorer's pull
of the decoded chunk follow the decoder's pulls of the K-1 blocks (about two link-times where
NICs are the limit). The lost chunk is a fixed linear combination of the blocks used: with
``inv`` the inverse of the rows' coefficients on the unknown positions, ``target = sum_j inv[t, j]
* row_j + sum_i (sum_j inv[t, j] * a[k+j, i]) * d_i`` over the rows used and the known members they
hold. So once the sources are chosen and opened (read tickets; a member that cannot be opened is
an unknown, rows holding every unknown are taken, this node's own first), each is scaled by its
coefficient as it arrives and XORed window by window (:class:`.bulkdecode.Windows`), as XOR
parity's protector decode does (:mod:`.xorpull`): the restorer's stream trails the slowest source
by about a window.

Checks: the rows' descriptions are bounded by the lane's MAC-checked members (as the restorer's
decode does, :meth:`.rsrebuild.RsRebuilder._row_bulk`); a row held here is checked against its
checksum before use; a row pulled is hashed as it arrives and checked against its checksum before
the end of the chunk is released (DataLossError, the stream is cut and the restorer decodes the
chunk itself). The restorer checks the whole rank against its manifest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
from tierckpt.common import checksum
from tierckpt.errors import DataLossError, UnavailableError
from tierckpt.v1 import peer_pb2 as ppb

from ..local.manifest import Manifest
from . import layout
from .bulkdecode import Into, Pulls, Source, Windows
from .gf import gf_mul

__all__ = ["StreamedDecode", "open_streamed"]


class StreamedDecode:
    """A chunk's sources opened, with their coefficients (:func:`open_streamed`); :meth:`run` once."""

    def __init__(self, pulls: Pulls, sources: list[tuple[Source, int, int]], windows: Windows, codec: Any,
                 rows: list[tuple[Any, str, str]], metrics: Any) -> None:
        self.pulls, self.sources, self.windows, self.codec = pulls, sources, windows, codec
        self.rows, self.metrics = rows, metrics  # (hasher, expected checksum, what) of each row pulled

    async def run(self) -> int:
        """Pull, scale and XOR every source; the bytes received over the network.

        Raises:
            DataLossError: a row fails its checksum. UnavailableError: a block could not be read.
        """
        intos = [Into(self._scaled(coef), window=self.windows.w) for _, coef, _ in self.sources]
        await self.pulls.run([_job(src, into) for (src, _, _), into in zip(self.sources, intos)])
        for hasher, expected, what in self.rows:
            if hasher.hexdigest() != expected:
                if self.metrics:
                    self.metrics.checksum_failures.labels(tier="peer").inc()
                raise DataLossError(f"{what} fails its checksum on receipt (expected {expected}, got "
                                    f"{hasher.hexdigest()})")
        self.windows.check()
        return sum(i.moved for i in intos)

    def close(self) -> None:
        """The read tickets opened expire on their own."""

    def _scaled(self, coef: int) -> Callable[[int, memoryview], None]:
        if coef == 1:
            return self.windows.add
        coeffs = np.array([[coef]], dtype=np.uint8)

        def add(w: int, data: memoryview) -> None:
            out = np.empty(len(data), dtype=np.uint8)
            self.codec.impl.dot(coeffs, [np.frombuffer(data, dtype=np.uint8)], [out])
            self.windows.add(w, out.data)
        return add


def _job(src: Source, into: Into) -> Callable[[], None]:
    return lambda: src(into)


def _from_buffer(buf: bytearray, n: int) -> Source:
    """A block held here (already checked), delivered as if pulled."""
    def pull(into: Into) -> None:
        at = [0]

        def recv(view: memoryview) -> None:
            view[:] = buf[at[0]:at[0] + len(view)]
            at[0] += len(view)
        into.useful(recv, n)
        into.flush()
    return pull


async def open_streamed(rb: Any, pulls: Pulls, man: Manifest, chunk: int, chunks: int, plan: Any,
                        write: Callable[[int, Any], None], window: int) -> StreamedDecode:
    """Choose and open the sources of chunk ``chunk`` of ``man`` in ``plan``'s lane (``rb``: the
    code's :class:`.rsrebuild.RsRebuilder`); nothing pulled yet.

    Raises:
        UnavailableError: too few rows hold the positions that cannot be read, or they do not
            determine them. DataLossError: a row is described inconsistently or fails its checksum.
    """
    _, length = layout.chunk_span(man.nbytes, chunks, chunk)
    codec = rb.protector.codec(chunks)
    positions = plan.positions(man, chunk)
    expect = max(layout.chunk_span(mm.nbytes, chunks, i)[1] for i, mm in positions.items())
    others = sorted(i for i in positions if i != chunk)
    spans = {i: layout.chunk_span(positions[i].nbytes, chunks, i) for i in others}
    got = await asyncio.gather(*(pulls.member(positions[i], spans[i][0], min(spans[i][1], length)) for i in others),
                               return_exceptions=True)
    known: dict[int, Source] = {}
    for i, res in zip(others, got):
        if isinstance(res, asyncio.CancelledError):
            raise res
        if not isinstance(res, BaseException):
            known[i] = res
    unknown = [chunk, *(i for i in others if i not in known)]
    here = {j for j, h in plan.rows.items() if h == rb.node_id}
    usable = sorted((j for j in plan.rows if set(unknown) <= set(plan.members[j])), key=lambda j: (j not in here, j))
    use = usable[:len(unknown)]
    if len(use) < len(unknown):
        raise UnavailableError(f"{len(unknown)} blocks of the lane are lost and only {len(use)} rows hold them")
    k = codec.k
    coeffs = np.array([[codec.matrix[k + j, u] for u in unknown] for j in use], dtype=np.uint8)
    try:
        inv = codec.impl.invert(coeffs)
    except ValueError:
        raise UnavailableError(f"the parity rows {use} do not determine positions {sorted(unknown)}") from None
    c = {j: int(inv[0, n]) for n, j in enumerate(use)}  # unknown[0] is the target
    e: dict[int, int] = {}
    for j in use:
        for i in set(plan.members[j]) & set(known):
            e[i] = e.get(i, 0) ^ gf_mul(c[j], int(codec.matrix[k + j, i]))
    sources: list[tuple[Source, int, int]] = [(known[i], coef, min(spans[i][1], length))
                                              for i, coef in sorted(e.items()) if coef]
    rows: list[tuple[Any, str, str]] = []
    stripe, lane = plan.lane
    for j in use:
        if not c[j]:
            continue
        holder = plan.rows[j]
        if holder == rb.node_id:
            buf = await rb.protector.row_bytes(man.job, man.step, stripe, lane, j)  # checked
            if len(buf) > expect:
                raise DataLossError(f"parity row {j} here is {len(buf)} bytes; its members need {expect}")
            sources.append((_from_buffer(buf, min(len(buf), length)), c[j], min(len(buf), length)))
            continue
        if holder not in rb.cluster.peers:
            raise UnavailableError(f"row {j} is held by {holder}, not a live peer known here")
        req = ppb.ReadParityRowRequest(requester=rb.node_id, job=man.job, step=man.step, stripe=stripe, lane=lane,
                                       row=j)
        resp = await rb.cluster.call(rb.cluster.peers[holder], "OpenRowRead", req)
        if resp.size > expect:
            raise DataLossError(f"peer {holder} describes parity row {j} as {resp.size} bytes; its members need "
                                f"{expect}")
        hasher = checksum.new()
        useful = min(resp.size, length)
        sources.append((pulls.slot(holder, resp, useful, hasher), c[j], useful))
        rows.append((hasher, resp.checksum, f"parity row {j} of {man.job} step {man.step} from {holder}"))
    windows = Windows(length, [cover for _, _, cover in sources], write, window=window)
    return StreamedDecode(pulls, sources, windows, codec, rows, rb.metrics)
