"""A :class:`tierckpt.dcp.Stager` bound to its :class:`tierckpt.dcp.Writer`: ``stage()`` copies
straight into the local tier's staging files (one host copy).

DCP plans after staging, but the plan of one rank is a pure function of its state dict: ``stage()``
runs DCP's default planner over it (:func:`local_items`: the items ``create_local_plan`` gives,
metadata only), lays them out as the Writer does (an item of at least ``pack_below`` bytes is its
own shard, smaller ones share the ``packed`` shard; :func:`tierckpt.torch.pack_tensors`) and begins
the rank's save on the daemon with ``hold=True``: the client's staging thread copies each tensor
into its staging mapping (:class:`tierckpt._tensorcopy.TensorCopier`: on a GPU after an event on
the current stream, on a dedicated stream, into page-locked mappings) and nothing commits.
``write_data`` then looks each item of DCP's final plan up in the :class:`Staged` record and
commits the held save with the save's DCP metadata: it reads no tensor byte.

What is copied in ``stage()`` itself, as the unbound stager does: items under ``small_below``
bytes (module buffers updated in ``forward``; on a GPU a device-side copy, the small ones packed
on the device), the serialized non-tensor items (``torch.save``), and the packed shard of small
CPU tensors (one buffer, copied into its staging file in ``stage()``). Everything else is copied
once, from the live tensor into the mapping, after ``stage()`` returned; the trainer's next
optimizer step waits for it. No pinned or host copy of the state is kept between saves.

Items DCP's global plan dedups away (a plain tensor replicated on several ranks is written by one)
stay in the other ranks' saves, unreferenced by the metadata. An item of the final plan that was
not staged (a custom planner that renames or re-chunks items) fails the save with a clear error.
"""

from __future__ import annotations

import concurrent.futures as cf
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from ._tensorcopy import TensorCopier
from .client import SaveFuture
from .errors import FailedPreconditionError, InvalidArgumentError
from .torch import PACKED_SHARD, TensorLoc, _contiguous, pack_tensors, shard_name

__all__ = ["Staged", "local_items", "stage_into", "busy"]


@dataclass
class Staged:
    """One rank's save begun (held) by ``stage()``: where each planned item's bytes are."""

    job: str
    step: int
    rank: int
    world_size: int  # tierckpt world size (DCP ranks + the metadata rank)
    locs: dict[MetadataIndex, tuple[TensorLoc, bool]]  # item -> (where, whether a byte item)
    save: SaveFuture  # held until write_data commits it

    def mismatch(self, job: str, step: int, rank: int, world_size: int) -> str | None:
        """Why DCP's save is not the one staged (None: it is)."""
        if (job, step) != (self.job, self.step):
            return (f"staged {self.job} step {self.step} but DCP writes {job} step {step} (a checkpoint_id given "
                    "to dcp.async_save is applied after staging: give the bound Writer its job and step)")
        if (rank, world_size) != (self.rank, self.world_size):
            return (f"staged as DCP rank {self.rank} of {self.world_size - 1} but DCP writes rank {rank} of "
                    f"{world_size - 1} (give the Stager the process group passed to dcp.async_save)")
        return None


def local_items(state_dict: dict[str, Any]) -> list[tuple[MetadataIndex, bool, torch.Tensor]]:
    """(index, whether a byte item, its data) of each item DCP's default planner writes for this
    rank; byte items serialized now, tensors as they are (a DTensor's local shard)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, None, True)
    out = []
    for item in planner.create_local_plan().items:
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            blob = data.getvalue()
            t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
            out.append((item.index, True, t))
        else:
            out.append((item.index, False, _contiguous(data.detach())))
    return out


def _place(group: Any) -> tuple[int, int]:
    """(this DCP rank, DCP world size) as ``dcp.async_save`` will see them."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def stage_into(writer: Any, state_dict: dict[str, Any], copier: TensorCopier, small_below: int,
               group: Any) -> Staged:
    """Begin ``writer``'s save of this rank with ``hold=True`` (see the module docstring).

    Raises:
        FailedPreconditionError: the Writer has no job (a ``checkpoint_id`` comes too late).
        TierckptError, OSError: BeginSave or the copies into ``stage()``'s buffers failed.
    """
    if not writer.job:
        raise FailedPreconditionError("tierckpt.dcp.Writer bound to a Stager has no job: the bound Stager begins "
                                      "the save in stage(), before DCP applies a checkpoint_id; give Writer(job, step)")
    rank, world = _place(group)
    items, kinds, indexes = [], [], []
    taken: set[str] = set()
    for index, is_bytes, data in local_items(state_dict):
        n = data.numel() * data.element_size()
        early = writer.pack_below <= n < small_below  # captured now (forward may update it before the copy)
        items.append((shard_name(index.fqn, taken, "i."),
                      data.clone(memory_format=torch.contiguous_format) if early else data))
        kinds.append(is_bytes)
        indexes.append(index)
    shards, locs = pack_tensors(items, writer.pack_below, defer=True)
    if not shards:
        shards = {PACKED_SHARD: b""}  # a rank with nothing to write still commits (completeness)
    save = writer.client.save(writer.job, writer.step, rank, world + 1, shards, persist=writer.persist,
                              copier=copier, hold=True)
    staged = Staged(writer.job, writer.step, rank, world + 1,
                    {i: (loc, b) for i, loc, b in zip(indexes, locs, kinds)}, save)

    def copied(f: cf.Future) -> None:
        err = f.exception()
        if err is not None:
            save.abort(err)  # a failed copy: abort the held save now (nothing commits)

    save.staged.add_done_callback(copied)
    return staged


def busy(writer: Any) -> bool:
    """Whether ``writer`` has a save in flight: staged and not written, or written and not committed."""
    return writer._staged is not None or (writer._writing is not None and not writer._writing.done())


def bound_writer(ref: weakref.ref | None) -> Any:
    return ref() if ref is not None else None


def check_stager(stager: Any) -> None:
    from ._dcpstage import Stager

    if not isinstance(stager, Stager):
        raise InvalidArgumentError(f"stager: {type(stager).__name__} is not a tierckpt.dcp.Stager")
