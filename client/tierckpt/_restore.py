"""Restore materialisation for :class:`tierckpt.Client`: a ``Restore`` answer turned into buffers.

On the same node the committed files are mapped read-only (one loan per copy, see
:mod:`._loans`); otherwise each shard is read over gRPC. Packed shards are unpacked (see
:mod:`._pack`), and checksums verified as the client's ``verify`` asks.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

from . import _pack
from ._buffers import to_array
from ._loans import Loans
from ._transfer import Progress, map_verified, read_stream, run_batched
from .v1 import tierckpt_pb2 as pb

__all__ = ["materialize", "read_only_arrays"]


def materialize(io: cf.ThreadPoolExecutor, loans: Loans, stub: Any, address: str, resp: pb.RestoreResponse,
                job: str, rank: int, progress: Callable[[int, int], None] | None, *, shared: bool, transfer: str,
                verify: bool | str) -> tuple[list[_pack.Row], Any, dict]:
    """The restored rank's rows (name, dtype, shape, buffer), the pack's buffer (or None) and the
    loan's finalizers by shard; ``shared``: the daemon's files are visible here (mapped)."""
    advance = Progress(sum(s.size for s in resp.shards), progress)
    key = (job, resp.step, rank, resp.generation)
    finalizers: dict = {}
    where = f"{job} step {resp.step} rank {rank}"
    packed = _pack.is_packed(resp.shards)
    if shared:
        check = verify == "always" or (verify is True and resp.tier == pb.TIER_LOCAL)
        try:
            # A pack is checked shard by shard against its index (in unpack), not twice.
            bufs = run_batched(io, lambda s: map_verified(job, resp.step, rank, s, advance,
                                                          check and not (packed and s.name == _pack.PACK)),
                               list(resp.shards), lambda s: s.size)
            rows, pack = _pack.unpack(io, resp.shards, bufs, check, where)
        except BaseException:
            loans.release_now(key)  # nothing was handed out
            raise
        held = {r[0]: r[3] for r in rows}
        if pack is not None:
            held[_pack.PACK] = pack
        finalizers = loans.track(key, held)
    else:
        if transfer != "stream":
            loans.release_now(key)  # asked for paths (and a loan), but reads over gRPC
        bufs = [read_stream(stub, address, job, resp.step, rank, s, advance) for s in resp.shards]
        rows, pack = _pack.unpack(io, resp.shards, bufs, verify is not False, where)
    return rows, pack, finalizers


def read_only_arrays(rows: list[_pack.Row]) -> tuple[dict, dict, dict, dict]:
    """Read-only arrays over the restored buffers, with the buffers, dtypes and shapes by shard."""
    arrays, buffers, dtypes, shapes = {}, {}, {}, {}
    for name, dtype, shape, buf in rows:
        arr = to_array(buf, dtype, shape)
        arr.flags.writeable = False
        arrays[name], buffers[name], dtypes[name], shapes[name] = arr, buf, dtype, shape
    return arrays, buffers, dtypes, shapes
