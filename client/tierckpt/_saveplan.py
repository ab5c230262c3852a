"""Save planning for :class:`tierckpt.Client`: the ``BeginSave`` shard list, the pack layout, and
the bookkeeping behind ``unchanged`` hints (the step each (job, rank) last committed here)."""

from __future__ import annotations

from . import _pack
from ._buffers import ShardBuffer
from .v1 import tierckpt_pb2 as pb

__all__ = ["SavePlanner", "split_packed"]

Plan = tuple[list[pb.ShardSpec], "_pack.Layout | None"]


def split_packed(buffers: list[ShardBuffer], layout: _pack.Layout | None
                 ) -> tuple[list[ShardBuffer], tuple[_pack.Layout, list[ShardBuffer]] | None]:
    """The buffers stored on their own, and the pack's (layout, buffers) (None: nothing is packed)."""
    if layout is None:
        return buffers, None
    return [buffers[i] for i in layout.unpacked], (layout, [buffers[i] for i in layout.packed])


class SavePlanner:
    """The save plans of one client (cached per layout, as DCP caches save plans) and its
    committed saves per (job, rank)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}
        # (job, rank) -> (step, save_id) of the last save this client committed there
        self._committed: dict[tuple[str, int], tuple[int, str]] = {}

    def plan(self, buffers: list[ShardBuffer], pack_below: int, pack_min_shards: int) -> Plan:
        """The BeginSave shard list and the pack layout, cached per layout (as DCP caches save plans)."""
        key = (pack_below, pack_min_shards, *((b.name, b.nbytes, b.dtype, b.shape) for b in buffers))
        plan = self._plans.get(key)
        if plan is None:
            layout = _pack.plan(buffers, pack_below, pack_min_shards)
            stored = buffers if layout is None else [buffers[i] for i in layout.unpacked]
            specs = [pb.ShardSpec(name=b.name, size=b.nbytes, dtype=b.dtype, shape=list(b.shape)) for b in stored]
            if layout is not None:
                specs += [pb.ShardSpec(name=_pack.PACK, size=layout.size), pb.ShardSpec(name=_pack.INDEX,
                                                                                       size=layout.index_size)]
            if len(self._plans) > 64:
                self._plans.clear()
            plan = self._plans[key] = (specs, layout)
        return plan

    def hint(self, req: pb.BeginSaveRequest, unchanged: frozenset[str]) -> None:
        """Fill the request's ``unchanged`` shards (those stored on their own) and ``base_step``."""
        base = self._committed.get((req.job, req.rank))
        names = [s.name for s in req.shards if s.name in unchanged]
        if base is not None and names:
            req.base_step, req.base_generation = base
            req.unchanged.extend(names)

    def committed(self, job: str, rank: int, step: int, save_id: str) -> None:
        """``save_id`` committed ``step`` of (job, rank): the base of that rank's next hint."""
        self._committed[(job, rank)] = (step, save_id)
