"""A torch.distributed.checkpoint (DCP) storage plugin backed by the tierckpt daemon.

::

    import torch.distributed.checkpoint as dcp
    import tierckpt.dcp

    dcp.save(sd, storage_writer=tierckpt.dcp.Writer("job", step))
    fut = dcp.async_save(sd, storage_writer=tierckpt.dcp.Writer("job", step))
    dcp.load(sd, storage_reader=tierckpt.dcp.Reader("job", step))     # step=None: the latest

    stager = tierckpt.dcp.Stager()    # stage() does not stop the trainer (see tierckpt._dcpstage)
    resp = dcp.async_save(sd, storage_writer=tierckpt.dcp.Writer("job", step, stager=stager),
                          async_stager=stager)
    # resp.staging_completion: the tensors may change; the next optimizer step waits for it

A Stager given to a Writer (``stager=``) is bound to it: ``stage()`` begins that rank's save and
copies each tensor straight into the local tier's staging files, and ``write_data`` only commits
it (one host copy; see :mod:`tierckpt._dcpbound`). Pass both to the same ``dcp.async_save`` (THREAD
executor), give the Writer its job and step (a ``checkpoint_id`` is applied after staging), and one
Writer per save: binding the Stager to a second Writer while the first one's save is in flight
raises ``FailedPreconditionError``. An unbound Stager stages host copies that ``write_data`` copies
into the staging files (two host copies).

Layout of a DCP checkpoint of ``W`` ranks as tierckpt step ``(job, step)`` of world size ``W + 1``:

* tierckpt rank ``r < W`` holds the write items of DCP rank ``r``: every item (a tensor chunk or
  a serialized object) of at least ``pack_below`` bytes is its own shard, smaller ones are packed
  into one ``packed`` shard. Each rank writes through its own node's daemon (``address`` or
  ``$TIERCKPT_ADDRESS``) and its ``write_data`` completes only once the rank is committed there.
  With a bound Stager the rank's save is begun (held, uncommitted) in ``stage()`` with this same
  layout, computed from DCP's default local plan of the state; ``write_data`` commits it. Nothing
  else changes: an uncommitted rank is invisible, a failed stage fails the save before any commit.
* tierckpt rank ``W`` holds one shard, ``dcp-metadata``: the pickled DCP ``Metadata``, whose
  ``storage_data`` maps each item to (rank, shard, offset, length, dtype, shape). The
  coordinator writes it in ``finish()``, which DCP calls only after every rank's ``write_data``
  has returned (DCP gathers the write results first) and never when a rank failed.

So the metadata is committed last, and because it is a rank of the same tierckpt step, the daemon
counts the step complete (``latest``, retention, replication, persistence) only once the metadata
is there: a reader never sees metadata without every rank's data. A failed save leaves an
incomplete step that ``latest`` skips and retention reclaims.

Loading: the readers agree on the step (see :class:`Reader`: the newest step whose metadata and
every saved rank are restorable in some tier, for any reader world size), every rank reads the
metadata (rank ``W``), then restores each saved rank that holds items it needs, maps its shards
and copies byte ranges into the destination tensors, so any load world size DCP supports works
(resharding with DTensor, a different rank count). All restores go through the reader's own node's
daemon: on one machine every rank is local; across nodes a rank saved on another node is served
from the peer or persistent tier, so loading on a different world size across nodes needs
``replicas >= 1`` or a persistent tier holding the step.

A step saved again (``overwrite=True``, DCP's default) from fewer ranks still holds the earlier
save's extra ranks until retention reclaims them; the daemon's catalog takes one save's ranks per
step (the complete one, else the newest), and every rank records the coordinator's save id, so a
load never mixes two saves (a rank of another save is a ``DataLossError``).

``use_collectives=False`` (rank-local metadata) is not supported.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
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

from . import errors as _errors
from ._dcpbound import Staged, check_stager
from ._dcpstage import Stager
from .client import Checkpoint, Client
from .common.names import check_job, check_step
from .errors import (
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
)
from .torch import PACKED_SHARD, TensorLoc, bytes_of, pack_tensors, shard_name, view_tensor

__all__ = ["Writer", "Reader", "Stager", "ItemLoc", "METADATA_SHARD", "held_ranks", "loadable"]

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
    save_id: str = ""  # the coordinator's: every rank of one save records it (a load never mixes saves)


def _parse_id(checkpoint_id: Any) -> tuple[str, int | None]:
    m = _ID_RE.fullmatch(str(checkpoint_id))
    if not m:
        raise InvalidArgumentError(f"checkpoint_id: {checkpoint_id!r} is not 'tierckpt://JOB/STEP'")
    return m.group(1), None if m.group(2) == "latest" else int(m.group(2))


_clients: dict[tuple, Client] = {}


def _client_for(address: str | None, opts: tuple[tuple[str, Any], ...] = ()) -> Client:
    """One shared client per process, address and options (DCP creates writers per save)."""
    key = (os.getpid(), address, opts)
    c = _clients.get(key)
    if c is None:
        c = _clients[key] = Client(address, **dict(opts))
    return c


_CLIENT_OPTS = ("timeout", "transfer", "verify", "pack_below", "pack_min_shards")


class _Connected:
    """The daemon connection of a Writer or Reader: the address and the client's options travel
    when it is pickled (``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` sends the
    writer to a checkpoint process); the receiving process connects on first use."""

    _client: Client | None
    address: str | None
    _client_opts: tuple[tuple[str, Any], ...]

    def _connect(self, address: str | None, client: Client | None) -> None:
        if client is not None and not all(hasattr(client, m) for m in ("save", "restore", "availability")):
            raise InvalidArgumentError(f"client: {type(client).__name__} is not a tierckpt.Client")
        if address is not None and not isinstance(address, str):
            raise InvalidArgumentError(f"address: {address!r} must be a string")
        self._client = client
        self.address = getattr(client, "address", None) if client is not None else address
        self._client_opts = tuple((k, getattr(client, k)) for k in _CLIENT_OPTS if hasattr(client, k)) \
            if client is not None else ()

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = _client_for(self.address, self._client_opts)
        return self._client

    @client.setter
    def client(self, client: Client) -> None:
        self._connect(None, client)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # a live channel and threads: reconnected lazily where unpickled
        return state


class Writer(_Connected, StorageWriter):
    """DCP ``StorageWriter`` saving into ``(job, step)`` through the node's tierckpt daemon.

    DCP calls, on every rank: ``reset``, ``set_up_storage_writer``, ``prepare_local_plan``; on the
    coordinator: ``prepare_global_plan`` (assigns each plan its rank, the world size and the
    save's id; with ``overwrite=False`` refuses a step that exists); on every rank:
    ``write_data`` (saves and waits for the local commit); on the coordinator: ``finish``
    (commits the metadata as the last rank).

    A Writer pickles (address and options, not the connection): the receiving process connects
    on first use, so ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
    works. A ``client`` passed in is re-created there from its address and options (TLS files
    come from ``TIERCKPT_TLS_*`` in that process).

    Args:
        job, step: the tierckpt checkpoint to write (a ``checkpoint_id`` of ``tierckpt://JOB/STEP``
            given to ``dcp.save`` overrides them).
        address: this node's daemon (default ``$TIERCKPT_ADDRESS``); ignored when ``client`` is given.
        persist: ask the daemon to drain the step to the persistent tier.
        pack_below: tensors smaller than this many bytes share one packed shard.
        stager: bind this :class:`Stager` to the Writer: its ``stage()`` copies straight into this
            save's staging files (see the module docstring); None: ``write_data`` copies the
            state DCP hands it.
        overwrite: False: a save into a step whose DCP metadata is committed fails (on every rank,
            as ``FileSystemWriter(overwrite=False)`` does, with ``AlreadyExistsError``: "Checkpoint
            already exists"). True (the default, as DCP's): the save replaces it; a re-save from
            fewer ranks leaves the earlier save's extra ranks, which the catalog ignores and
            retention reclaims (a load reads only what the re-save wrote, see the module docstring).
    """

    def __init__(self, job: str = "", step: int = 0, *, address: str | None = None, client: Client | None = None,
                 persist: bool = False, pack_below: int = 64 << 10, overwrite: bool = True,
                 stager: Stager | None = None) -> None:
        super().__init__()
        if stager is not None:
            check_stager(stager)
        if job:
            check_job(job)
        check_step(step)
        if isinstance(pack_below, bool) or not isinstance(pack_below, int) or pack_below < 0:
            raise InvalidArgumentError(f"pack_below: {pack_below!r} must be a non-negative integer")
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError(f"overwrite: {overwrite!r} must be True or False")
        self.job, self.step = job, step
        self._connect(address, client)
        self.persist = bool(persist)
        self.pack_below = pack_below
        self.overwrite = overwrite
        self.rank = 0
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self._staged: Staged | None = None  # set by the bound stager's stage(), taken by write_data
        self._writing: Any = None  # the tierckpt save write_data committed (a bound stager's busy check)
        self._stager = stager
        if stager is not None:
            stager._bind(self)

    def __getstate__(self) -> dict[str, Any]:
        if self._stager is not None:
            raise FailedPreconditionError("a tierckpt.dcp.Writer bound to a Stager cannot be sent to another process "
                                          "(AsyncCheckpointerType.PROCESS): use the THREAD type, or an unbound Stager")
        return super().__getstate__()

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
        if not self.job:
            raise InvalidArgumentError("job: empty (give Writer a job, or dcp.save a checkpoint_id)")
        self.rank = kwargs.get("rank") or 0
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.overwrite:
            world = _committed_world(self.client, self.job, self.step)
            if world is not None:
                raise AlreadyExistsError(f"{self.checkpoint_id}: Checkpoint already exists and overwrite=False "
                                         f"(saved by {world - 1} DCP ranks)")
        return [dataclasses.replace(p, storage_data=_PlanData(i, len(plans), self.save_id))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info: _PlanData = plan.storage_data
        staged, self._staged = self._staged, None
        if staged is not None:
            return self._write_staged(staged, plan, info)
        if self._stager is not None and self._stager._writer is not None and self._stager._writer() is not self:
            raise FailedPreconditionError(f"{self.checkpoint_id}: this Writer's Stager is bound to a later Writer "
                                          "(its staging is no longer this Writer's; one Writer per save)")
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
                                metadata=_data_metadata(info), persist=self.persist)
        return _results_when(save, results)

    def _write_staged(self, staged: Staged, plan: SavePlan, info: _PlanData) -> Future[list[WriteResult]]:
        """Commit the save the bound stager began: each item's place is looked up, no byte is read."""
        why = staged.mismatch(self.job, self.step, info.rank, info.world_size + 1)
        results = []
        for item in plan.items if why is None else ():
            got = staged.locs.get(item.index)
            if got is None or got[1] != (item.type == WriteItemType.BYTE_IO):
                why = (f"DCP's plan writes {item.index.fqn!r}, which the bound Stager did not stage as such (a "
                       "custom planner that renames or re-chunks items needs an unbound Stager)")
                break
            loc, is_bytes = got
            results.append(WriteResult(index=item.index, size_in_bytes=loc.nbytes,
                                       storage_data=ItemLoc(info.rank, loc.shard, loc.offset, loc.nbytes,
                                                            "" if is_bytes else loc.dtype,
                                                            () if is_bytes else loc.shape)))
        if why is not None:
            staged.save.abort(FailedPreconditionError(f"{self.checkpoint_id}: {why}"))  # its own error object:
            raise FailedPreconditionError(f"{self.checkpoint_id}: {why}")  # the commit thread raises that one
        self._writing = staged.save.commit(metadata=_data_metadata(info))
        return _results_when(staged.save, results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        world = len(results)
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        self.client.save(self.job, self.step, world, world + 1, {METADATA_SHARD: blob},
                         metadata={"tierckpt.dcp": "metadata", "dcp_world_size": world, "dcp_save_id": self.save_id},
                         persist=self.persist).result()
        log.info("DCP checkpoint %s step %d committed: %d ranks, metadata %d bytes", self.job, self.step, world,
                 len(blob))


def _data_metadata(info: _PlanData) -> dict[str, Any]:
    return {"tierckpt.dcp": "data", "dcp_world_size": info.world_size, "dcp_save_id": info.save_id}


def _results_when(save: Any, results: list[WriteResult]) -> Future[list[WriteResult]]:
    """A DCP future of ``results`` once the rank's tierckpt save committed (its failure, else)."""
    fut: Future[list[WriteResult]] = Future()

    def done(f: Any) -> None:
        err = f.exception()
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(results)

    save.add_done_callback(done)
    return fut


def _committed_world(client: Client, job: str, step: int) -> int | None:
    """The tierckpt world size of ``step`` if its DCP metadata rank is held in some tier (two
    availability calls through this node's daemon), else None."""
    mine = next((a for a in client.availability(job, 0) if a.step == step), None)
    if mine is None:
        return None
    meta = next((a for a in client.availability(job, mine.world_size - 1) if a.step == step), None)
    return mine.world_size if meta is not None and meta.world_size == mine.world_size else None


class Reader(_Connected, StorageReader):
    """DCP ``StorageReader`` loading ``(job, step)`` through the node's tierckpt daemon.

    DCP calls, on every rank: ``reset``, ``read_metadata`` (resolves the step, restores the DCP
    metadata), ``set_up_storage_reader``, ``prepare_local_plan``; on the coordinator:
    ``prepare_global_plan``; on every rank: ``read_data`` (restores the saved ranks it needs,
    copies byte ranges into the targets).

    Which step: under torch.distributed, ``read_metadata`` is a collective of ``group``: each
    reader rank ``i`` of ``n`` asks its own daemon which steps the saved ranks ``i, i+n, i+2n, ...``
    can be restored at (the metadata rank included), one all-gather combines the answers, and
    the ranks take the newest step whose metadata and every saved rank are restorable in some tier
    -- whatever the saved world size, smaller or larger than ``n``. If the metadata of that step
    then cannot be restored on some rank (``NotFoundError``, ``DataLossError``), every rank moves
    to the next older such step together. Without torch.distributed one process does the same
    alone. An explicit ``step`` is checked the same way (never a fallback).

    Args:
        job: the tierckpt job.
        step: the step to load; None: the newest step every rank can load (see above).
        address: this node's daemon (default ``$TIERCKPT_ADDRESS``); ignored when ``client`` is given.
        group: the process group that loads (default: the world); give the group passed to
            ``dcp.load`` when it is not the world.
        collective: whether ``read_metadata`` agrees through ``group``; default: when
            torch.distributed is initialised. False: this process resolves the step alone (a
            load on some ranks only, e.g. ``dcp.load(..., no_dist=True)`` under a group).
    """

    def __init__(self, job: str = "", step: int | None = None, *, address: str | None = None,
                 client: Client | None = None, group: Any = None, collective: bool | None = None) -> None:
        super().__init__()
        if job:
            check_job(job)
        if step is not None:
            check_step(step)
        if collective not in (None, True, False):
            raise InvalidArgumentError(f"collective: {collective!r} must be True, False or None")
        self.collective = collective
        self.job, self.step = job, step
        self._connect(address, client)
        self.group = group
        self.storage_data: dict[Any, ItemLoc] = {}
        self.tier = ""  # where the metadata came from, for logs
        self.tiers: dict[int, str] = {}  # saved tierckpt rank -> the tier its last restore came from
        self.world_size = 0  # the step's tierckpt world size (saved DCP ranks + 1)
        self._save_id = ""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["group"] = None  # a process group does not travel
        return state

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
        """The DCP metadata of the step (resolving ``step=None``, see the class docstring).

        Raises:
            NotFoundError: no such step, or it is not complete (a save that failed or is running,
                a node lost with ranks no other tier holds).
        """
        if not self.job:
            raise InvalidArgumentError("job: empty (give Reader a job, or dcp.load a checkpoint_id)")
        ck = self._resolve()
        self.tier = self.tiers[ck.rank] = ck.tier
        self._save_id = str(ck.metadata.get("dcp_save_id", ""))
        metadata: Metadata = pickle.loads(ck.shards[METADATA_SHARD].tobytes())
        ck.close()
        meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        meta.load_id = uuid.uuid4().hex
        metadata.storage_meta = meta
        return metadata

    def _place(self) -> tuple[int, int, bool]:
        """(this reader's rank, the number of readers, whether they are a process group)."""
        up = dist.is_available() and dist.is_initialized()
        if self.collective and not up:
            raise FailedPreconditionError("collective: True but torch.distributed is not initialised")
        if up and self.collective is not False:
            return dist.get_rank(self.group), dist.get_world_size(self.group), True
        return 0, 1, False

    def _resolve(self) -> Checkpoint:
        """Agree on the step (collective under torch.distributed), restore its metadata rank."""
        me, n, grouped = self._place()

        def gather(obj: Any) -> list[Any]:
            if not grouped:
                return [obj]
            out: list[Any] = [None] * n
            dist.all_gather_object(out, obj, group=self.group)
            return out

        try:
            mine: Any = (held_ranks(self.client, self.job, me, n, self.step), None)
        except Exception as e:  # every rank must reach the gather: the error travels with it
            mine = ({}, _as_failure(e))
        answers = gather(mine)
        _raise_first([f for _, f in answers])
        union: dict[tuple[int, int], set[int]] = {}
        for held, _ in answers:
            for key, ranks in held.items():
                union.setdefault(key, set()).update(ranks)
        cands = loadable(union)
        if not cands:
            raise NotFoundError(_nothing_loadable(self.job, self.step, union))
        tried: list[str] = []
        for step, world in cands:
            ck: Checkpoint | None = None
            try:
                ck = self.client.restore(self.job, world - 1, step)
                if METADATA_SHARD not in ck.shards or ck.world_size != world:
                    raise NotFoundError(f"{self.job} step {step} rank {world - 1}: not a tierckpt.dcp metadata rank")
                failure = None
            except (NotFoundError, DataLossError) as e:
                failure = ("retry", type(e).__name__, str(e))
            except Exception as e:  # the ranks must leave together
                failure = _as_failure(e)
            outcomes = gather(failure)
            _raise_first([f for f in outcomes if f is not None and f[0] != "retry"])
            if all(f is None for f in outcomes):
                assert ck is not None
                self.step, self.world_size = step, world
                if tried:
                    log.warning("%s: loading step %d; newer steps could not be loaded on every rank: %s",
                                self.job, step, "; ".join(tried))
                return ck
            if ck is not None:
                ck.close()
            why = "; ".join(sorted({f"{f[1]}: {f[2]}" for f in outcomes if f is not None}))
            if self.step is not None:
                raise NotFoundError(f"{self.job} step {step}: the DCP metadata cannot be restored by every "
                                    f"rank: {why}")
            tried.append(f"step {step} ({why})")
        raise NotFoundError(f"{self.job}: no step whose DCP metadata every rank can restore; tried "
                            + "; ".join(tried))

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
            self._check_same_save(ck)
            self.tiers[rank] = ck.tier
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

    def _check_same_save(self, ck: Checkpoint) -> None:
        """A data rank must come from the save that wrote the metadata: a step re-saved (from
        another world size, or a re-save that died part-way) can leave ranks of an earlier save."""
        if self.world_size and ck.world_size != self.world_size:
            raise DataLossError(f"{self.job} step {ck.step} rank {ck.rank}: saved with world size {ck.world_size}, "
                                f"the DCP metadata with {self.world_size} (ranks of another save of the step)")
        got = ck.metadata.get("dcp_save_id")
        if self._save_id and got is not None and got != self._save_id:
            raise DataLossError(f"{self.job} step {ck.step} rank {ck.rank}: written by DCP save {got}, the metadata "
                                f"by save {self._save_id} (ranks of another save of the step)")


# ---------------------------------------------------------------------------------- agreement rules


def held_ranks(client: Any, job: str, first: int, stride: int,
               step: int | None = None) -> dict[tuple[int, int], list[int]]:
    """The saved tierckpt ranks ``first, first+stride, ...`` that this reader's daemon can restore:
    ``(step, world size) -> ranks``. Asks ``availability`` for each rank in turn and stops at
    the first rank held by no step (a step needing a higher rank needs that one too) or past
    every world size seen: ``ceil(world / stride)`` calls per reader."""
    held: dict[tuple[int, int], list[int]] = {}
    j = first
    while True:
        avail = [a for a in client.availability(job, j) if step is None or a.step == step]
        if not avail:
            return held
        for a in avail:
            if j < a.world_size:
                held.setdefault((a.step, a.world_size), []).append(j)
        j += stride
        if j >= max(a.world_size for a in avail):
            return held


def loadable(union: dict[tuple[int, int], set[int]]) -> list[tuple[int, int]]:
    """``(step, world size)`` whose every rank (the DCP metadata, rank ``world - 1``, included)
    is held, newest first (pure: the rule every reader applies to the same gathered answers)."""
    done = [k for k, ranks in union.items() if len(ranks) == k[1] and ranks == set(range(k[1]))]
    return sorted(done, reverse=True)


def _nothing_loadable(job: str, step: int | None, union: dict[tuple[int, int], set[int]]) -> str:
    if not union:
        return f"{job} step {step}: not found in any tier" if step is not None else \
            f"{job}: no tierckpt.dcp checkpoint in any tier"
    newest = max(union)
    s, world = newest
    missing = sorted(set(range(world)) - union[newest])
    data = [r for r in missing if r < world - 1]
    parts = ([f"ranks {data} of {world - 1} DCP ranks"] if data else []) + \
        ([f"the DCP metadata (rank {world - 1})"] if world - 1 in missing else [])
    what = f"step {s} is incomplete: {' and '.join(parts)} not restorable in any tier"
    if step is not None:
        return f"{job} {what} (a save that died part-way, or a node lost with its ranks)"
    return f"{job}: no step every rank can load; the newest, {what}"


def _as_failure(e: BaseException) -> tuple[str, str, str]:
    return ("fail", type(e).__name__, str(e))


def _raise_first(failures: list[Any]) -> None:
    """Raise, on every rank alike, the first failure a rank reported (its tierckpt type kept)."""
    for f in failures:
        if f is None:
            continue
        _, name, msg = f
        cls = getattr(_errors, name, None)
        if isinstance(cls, type) and issubclass(cls, TierckptError):
            raise cls(msg)
        raise TierckptError(f"{name}: {msg}")
