"""A torch.distributed.checkpoint (DCP) storage plugin backed by the tierckpt daemon.

::

    import torch.distributed.checkpoint as dcp
    import tierckpt.dcp

    dcp.save(sd, storage_writer=tierckpt.dcp.Writer("job", step))
    fut = dcp.async_save(sd, storage_writer=tierckpt.dcp.Writer("job", step))
    dcp.load(sd, storage_reader=tierckpt.dcp.Reader("job", step))     # step=None: the latest

Layout of a DCP checkpoint of ``W`` ranks as tierckpt step ``(job, step)`` of world size ``W + 1``:

* tierckpt rank ``r < W`` holds the write items of DCP rank ``r``: every item (a tensor chunk or
  a serialized object) of at least ``pack_below`` bytes is its own shard, smaller ones are packed
  into one ``packed`` shard. Each rank writes through its own node's daemon (``address`` or
  ``$TIERCKPT_ADDRESS``) and its ``write_data`` completes only once the rank is committed there.
* tierckpt rank ``W`` holds one shard, ``dcp-metadata``: the pickled DCP ``Metadata``, whose
  ``storage_data`` maps each item to (rank, shard, offset, length, dtype, shape). The
  coordinator writes it in ``finish()``, which DCP calls only after every rank's ``write_data``
  has returned (DCP gathers the write results first) and never when a rank failed.

So the metadata is committed last, and because it is a rank of the same tierckpt step, the daemon
counts the step complete (``latest``, retention, replication, persistence) only once the metadata
is there: a reader never sees metadata without every rank's data. A failed save leaves an
incomplete step that ``latest`` skips and retention reclaims.

Loading: every rank reads the metadata (rank ``W``, found from the step's world size in
``Client.list``), then restores each saved rank that holds items it needs, maps its shards and
copies byte ranges into the destination tensors, so any load world size DCP supports works
(resharding with DTensor, a different rank count). All restores go through the reader's own node's
daemon: on one machine every rank is local; across nodes a rank saved on another node is served
from the peer or persistent tier, so loading on a different world size across nodes needs
``replicas >= 1`` or a persistent tier holding the step.

``use_collectives=False`` (rank-local metadata) is not supported.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import re
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .agree import agree_restore_step
from .client import Checkpoint, Client
from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from .torch import PACKED_SHARD, TensorLoc, bytes_of, pack_tensors, shard_name, view_tensor

__all__ = ["Writer", "Reader", "ItemLoc", "METADATA_SHARD"]

log = logging.getLogger(__name__)

METADATA_SHARD = "dcp-metadata"
_ID_RE = re.compile(r"(?:tierckpt://)?([A-Za-z0-9][A-Za-z0-9._-]{0,127})/(\d+|latest)")


@dataclass(frozen=True)
class ItemLoc:
    """Where one DCP item's bytes are: tierckpt rank, shard, byte range, and the stored chunk's
    dtype and shape (empty dtype for byte items)."""

    rank: int
    shard: str
    offset: int
    length: int
    dtype: str = ""
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class _PlanData:
    rank: int
    world_size: int


def _parse_id(checkpoint_id: Any) -> tuple[str, int | None]:
    m = _ID_RE.fullmatch(str(checkpoint_id))
    if not m:
        raise InvalidArgumentError(f"checkpoint_id: {checkpoint_id!r} is not 'tierckpt://JOB/STEP'")
    return m.group(1), None if m.group(2) == "latest" else int(m.group(2))


_clients: dict[str | None, Client] = {}


def _client_for(address: str | None) -> Client:
    """One shared client per address (DCP creates writers per save)."""
    c = _clients.get(address)
    if c is None:
        c = _clients[address] = Client(address)
    return c


class Writer(StorageWriter):
    """DCP ``StorageWriter`` saving into ``(job, step)`` through the node's tierckpt daemon.

    DCP calls, on every rank: ``reset``, ``set_up_storage_writer``, ``prepare_local_plan``; on the
    coordinator: ``prepare_global_plan`` (assigns each plan its rank and the world size); on every
    rank: ``write_data`` (saves and waits for the local commit); on the coordinator: ``finish``
    (commits the metadata as the last rank).

    Args:
        job, step: the tierckpt checkpoint to write (a ``checkpoint_id`` of ``tierckpt://JOB/STEP``
            given to ``dcp.save`` overrides them).
        address: this node's daemon (default ``$TIERCKPT_ADDRESS``); ignored when ``client`` is given.
        persist: ask the daemon to drain the step to the persistent tier.
        pack_below: tensors smaller than this many bytes share one packed shard.
    """

    def __init__(self, job: str = "", step: int = 0, *, address: str | None = None, client: Client | None = None,
                 persist: bool = False, pack_below: int = 64 << 10) -> None:
        super().__init__()
        self.job, self.step = job, step
        self.client = client or _client_for(address)
        self.persist = persist
        self.pack_below = pack_below
        self.rank = 0
        self.save_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return f"tierckpt://{self.job}/{self.step}"

    def reset(self, checkpoint_id: str | Any | None = None) -> None:
        if checkpoint_id:
            job, step = _parse_id(checkpoint_id)
            if step is None:
                raise InvalidArgumentError("checkpoint_id: a save needs an explicit step, not 'latest'")
            self.job, self.step = job, step
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        return bool(_ID_RE.fullmatch(str(checkpoint_id))) and str(checkpoint_id).startswith("tierckpt://")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise FailedPreconditionError("tierckpt.dcp.Writer needs use_collectives=True (one global metadata)")
        self.rank = kwargs.get("rank") or 0
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_PlanData(i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info: _PlanData = plan.storage_data
        items, tensors = plan.items, []
        taken: set[str] = set()
        for item in items:
            data: Any = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = data.getvalue()
                t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
            else:
                t = data.detach()
                t = t.to("cpu") if t.device.type != "cpu" else t
                t = t.contiguous()
            tensors.append((shard_name(item.index.fqn, taken, "i."), t))
        shards, locs = pack_tensors(tensors, self.pack_below)
        results = [
            WriteResult(index=item.index, size_in_bytes=loc.nbytes,
                        storage_data=ItemLoc(info.rank, loc.shard, loc.offset, loc.nbytes,
                                             "" if item.type == WriteItemType.BYTE_IO else loc.dtype,
                                             () if item.type == WriteItemType.BYTE_IO else loc.shape))
            for item, loc in zip(items, locs)
        ]
        if not shards:
            shards = {PACKED_SHARD: b""}  # a rank with nothing to write still commits (completeness)
        # A failure raised here or set on the future reaches every rank as a CheckpointException.
        save = self.client.save(self.job, self.step, info.rank, info.world_size + 1, shards,
                                metadata={"tierckpt.dcp": "data", "dcp_world_size": info.world_size},
                                persist=self.persist)
        fut: Future[list[WriteResult]] = Future()

        def done(f: Any) -> None:
            err = f.exception()
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(results)

        save.add_done_callback(done)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        world = len(results)
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        self.client.save(self.job, self.step, world, world + 1, {METADATA_SHARD: blob},
                         metadata={"tierckpt.dcp": "metadata", "dcp_world_size": world},
                         persist=self.persist).result()
        log.info("DCP checkpoint %s step %d committed: %d ranks, metadata %d bytes", self.job, self.step, world,
                 len(blob))


class Reader(StorageReader):
    """DCP ``StorageReader`` loading ``(job, step)`` through the node's tierckpt daemon.

    DCP calls, on every rank: ``reset``, ``read_metadata``, ``set_up_storage_reader``,
    ``prepare_local_plan``; on the coordinator: ``prepare_global_plan``; on every rank:
    ``read_data`` (restores the saved ranks it needs, copies byte ranges into the targets).

    Args:
        job: the tierckpt job.
        step: the step to load; None: the newest complete step, resolved by ``read_metadata`` on
            each rank. Pass an explicit step (e.g. ``Client.latest`` on rank 0, broadcast) when a
            save may complete while ranks are resolving, or they could pick different steps.
        address: this node's daemon (default ``$TIERCKPT_ADDRESS``); ignored when ``client`` is given.
    """

    def __init__(self, job: str = "", step: int | None = None, *, address: str | None = None,
                 client: Client | None = None) -> None:
        super().__init__()
        self.job, self.step = job, step
        self.client = client or _client_for(address)
        self.storage_data: dict[Any, ItemLoc] = {}
        self.tier = ""  # where the metadata came from, for logs

    @property
    def checkpoint_id(self) -> str:
        return f"tierckpt://{self.job}/{'latest' if self.step is None else self.step}"

    def reset(self, checkpoint_id: str | Any | None = None) -> None:
        if checkpoint_id:
            self.job, self.step = _parse_id(checkpoint_id)
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """The DCP metadata of the step (resolving ``step=None`` to the latest complete one).

        Raises:
            NotFoundError: no such step, or it is not complete (a save that failed or is running).
        """
        world = self._resolve_step()
        ck = self.client.restore(self.job, world - 1, self.step)
        if METADATA_SHARD not in ck.shards:
            raise NotFoundError(f"{self.job} step {self.step}: not a tierckpt.dcp checkpoint")
        self.tier = ck.tier
        metadata: Metadata = pickle.loads(ck.shards[METADATA_SHARD].tobytes())
        meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        meta.load_id = uuid.uuid4().hex
        metadata.storage_meta = meta
        return metadata

    def _resolve_step(self) -> int:
        """Resolve ``step=None`` and return the step's world size.

        Under torch.distributed the ranks agree on the newest step all of them can restore (one
        collective; each daemon answers with a constant number of calls); otherwise the daemon's
        cluster-wide view decides.
        """
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            if self.step is None:
                self.step = agree_restore_step(self.client, self.job, rank)
                if self.step is None:
                    raise NotFoundError(f"{self.job}: no step that every rank can restore")
            mine = next((a for a in self.client.availability(self.job, rank) if a.step == self.step), None)
            if mine is None:
                raise NotFoundError(f"{self.job} step {self.step}: not restorable by rank {rank}")
            return mine.world_size
        if self.step is None:
            self.step = self.client.latest(self.job)
            if self.step is None:
                raise NotFoundError(f"{self.job}: no complete checkpoint")
        info = next((c for c in self.client.list(self.job) if c.step == self.step), None)
        if info is None:
            raise NotFoundError(f"{self.job} step {self.step}: not found")
        if not info.complete:
            raise NotFoundError(f"{self.job} step {self.step}: incomplete (no DCP metadata committed)")
        return info.world_size

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        by_rank: dict[int, list] = {}
        for req in plan.items:
            by_rank.setdefault(self.storage_data[req.storage_index].rank, []).append(req)
        for rank in sorted(by_rank):
            ck: Checkpoint = self.client.restore(self.job, rank, self.step)
            raws: dict[str, torch.Tensor] = {}
            for req in by_rank[rank]:
                loc = self.storage_data[req.storage_index]
                raw = raws.get(loc.shard)
                if raw is None:
                    raw = raws[loc.shard] = bytes_of(ck, loc.shard)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(raw[loc.offset : loc.offset + loc.length].numpy().tobytes()))
                    continue
                src = view_tensor(raw, TensorLoc(loc.shard, loc.offset, loc.length, loc.dtype, loc.shape))
                for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, off, n)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise InvalidArgumentError(f"{req.storage_index}: size mismatch {tuple(target.size())} "
                                               f"vs stored {tuple(src.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
            del ck, raws  # unmap this rank before the next
        fut.set_result(None)
        return fut
