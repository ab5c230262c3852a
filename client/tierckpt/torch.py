"""Saving and restoring whole PyTorch training states through the tierckpt daemon.

A *state* is a mapping of names to things to checkpoint::

    state = {"model": model, "optim": optimizer, "sched": scheduler,
             "rng": tierckpt.torch.RNGState(), "loader": loader, "extra": {"epoch": 3}}
    ckpt = tierckpt.torch.Checkpointer("job", address=...)
    ckpt.save(step, state)          # returns once the bytes are staged; never raises on storage errors
    ckpt.load(state)                # in place; returns None when the job has no checkpoint yet

Values with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, schedulers, stateful
loaders, :class:`RNGState`) are saved through their state dicts; ``torch.Generator`` through
``get_state`` / ``set_state``; anything else (tensors, dicts, lists, numbers, picklable objects)
as it is.

Layout of one rank in the store: every tensor of at least ``pack_below`` bytes is its own shard
(named after its path, e.g. ``t.model.layers.0.weight``); smaller ones are packed, 64-byte
aligned, into one ``packed`` shard; everything that is not a tensor travels in the pickled
``objects.pkl`` shard, which also maps tensor paths to (shard, offset, dtype, shape). Identical
views (tied weights) are stored once.

Saving does not stop the trainer: :meth:`Checkpointer.save` returns once the copies are enqueued.
Tensors with their own shard (and, on a GPU, one device-side pack of the small ones) are copied
straight into the local tier's staging files after ``save()`` returned, CUDA tensors on a
dedicated stream after an event on the current stream, into page-locked staging mappings (one
host copy; see :mod:`tierckpt._tensorcopy`). The returned future's ``staged`` says when the
saved tensors may change; the Checkpointer waits for it before the next optimizer step (a global
optimizer step pre-hook), never in ``save()``. Code that writes saved tensors in place outside an
optimizer step (an EMA updated before the step, a write through ``.data``) calls
:meth:`Checkpointer.wait_staged` first. Small CPU tensors (the ``packed`` shard) and the objects
are copied in ``save()``, so module buffers updated in ``forward`` (BatchNorm statistics) are
saved as they were at ``save()``.

Restoring maps the shards copy-on-write: :meth:`Checkpointer.read` hands back tensors that share
that memory (zero copy; a write touches private copies of the pages, never the stored checkpoint),
:meth:`Checkpointer.load` copies into the
existing tensors in place (``load_state_dict`` semantics: a parameter keeps its ``data_ptr``)
and makes writable copies only where no matching tensor exists yet (e.g. a fresh optimizer).

The object shard is a pickle: load checkpoints only from a store you trust, as with ``torch.load``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import pickle
import random
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._hooks import StagedWaiter
from ._staging import Deferred
from ._tensorcopy import TensorCopier, tensor_bytes
from .agree import agree_restore_step, restore_same_world
from .client import Checkpoint, Client, SaveFuture
from .common.names import check_job
from .errors import FailedPreconditionError, InvalidArgumentError, TierckptError

__all__ = ["Checkpointer", "RNGState", "Restored", "SaveStats"]

log = logging.getLogger(__name__)

OBJECTS_SHARD = "objects.pkl"
PACKED_SHARD = "packed"
FORMAT = "tierckpt.torch/1"
_ALIGN = 64
_MAX_OWN_SHARDS = 4000  # the daemon allows 4096 shards per rank; keep room for objects + packed
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Ref:
    """Placeholder for a tensor in the pickled skeleton: index into the tensor table."""

    index: int


@dataclass(frozen=True)
class TensorLoc:
    """Where one tensor's bytes live: a shard, a byte offset in it, and how to view them."""

    shard: str
    offset: int
    nbytes: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    device: str = "cpu"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shard_name(path: str, taken: set[str], prefix: str = "t.") -> str:
    """A valid, unique shard name for a tensor path (``[A-Za-z0-9._-]``, no ``..``)."""
    base = re.sub(r"\.{2,}", ".", _BAD_CHARS.sub("_", prefix + path))[:200]
    name, n = base, 1
    while name in taken or name in (OBJECTS_SHARD, PACKED_SHARD):
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


def deferred(t: torch.Tensor) -> Deferred:
    """A contiguous tensor as a shard copied after ``save()`` returned (see :mod:`tierckpt._staging`)."""
    return Deferred(t, t.numel() * t.element_size(), "torch:" + _dtype_name(t.dtype), tuple(t.shape))


def _pack_name(device: torch.device) -> str:
    return PACKED_SHARD if device.type == "cpu" else f"{PACKED_SHARD}.{device.type}{device.index or 0}"


def pack_tensors(items: list[tuple[str, torch.Tensor]], pack_below: int, max_own: int = _MAX_OWN_SHARDS,
                 defer: bool = False) -> tuple[dict[str, Any], list[TensorLoc]]:
    """Lay tensors out as shards: large ones on their own, small ones packed into one buffer.

    Args:
        items: (shard name, contiguous tensor) in table order; names are already unique. Without
            ``defer`` every tensor is on the CPU.
        pack_below: tensors with fewer bytes go into the ``packed`` shard.
        max_own: at most this many tensors get their own shard (the largest ones).
        defer: tensors with their own shard are given as :class:`Deferred` (copied after
            ``save()`` returned); small tensors of a GPU are packed on that GPU (a device-side
            copy, ordered before the trainer's next kernels) into a deferred ``packed.cudaN``.

    Returns:
        The shards for :meth:`Client.save` and one :class:`TensorLoc` per item.
    """
    sizes = [t.numel() * t.element_size() for _, t in items]
    big = sorted((i for i, n in enumerate(sizes) if n >= max(pack_below, 1)), key=lambda i: -sizes[i])[:max_own]
    own = set(big)
    shards: dict[str, Any] = {}
    locs: list[TensorLoc | None] = [None] * len(items)
    packed_at: dict[str, tuple[torch.device, int]] = {}  # pack shard -> (device, its size so far)
    for i, (name, t) in enumerate(items):
        if i in own:
            shards[name] = deferred(t) if defer else t
            locs[i] = TensorLoc(name, 0, sizes[i], _dtype_name(t.dtype), tuple(t.shape))
        else:
            pack = _pack_name(t.device) if defer else PACKED_SHARD
            offset = packed_at.setdefault(pack, (t.device, 0))[1]
            locs[i] = TensorLoc(pack, offset, sizes[i], _dtype_name(t.dtype), tuple(t.shape))
            packed_at[pack] = (t.device, offset + -(-sizes[i] // _ALIGN) * _ALIGN)
    for pack, (device, size) in packed_at.items():
        flat = torch.zeros(max(size, 1), dtype=torch.uint8, device=device)
        for loc, (_, t) in zip(locs, items):
            if loc is not None and loc.shard == pack and loc.nbytes:
                flat[loc.offset : loc.offset + loc.nbytes].copy_(tensor_bytes(t))
        shards[pack] = flat.numpy() if device.type == "cpu" else deferred(flat)
    return shards, locs  # type: ignore[return-value]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where contiguous (CPU or CUDA), else a contiguous copy on its device; other
    devices are copied to the CPU."""
    if t.device.type not in ("cpu", "cuda"):
        return t.to("cpu").contiguous()
    return t if t.is_contiguous() else t.contiguous()


def bytes_of(ck: Checkpoint, shard: str) -> torch.Tensor:
    """The stored bytes of a shard as a flat uint8 tensor sharing the (copy-on-write) mapped memory."""
    arr = np.asarray(ck.shards[shard])
    raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not writable: callers only read
        return torch.from_numpy(raw)


def view_tensor(raw: torch.Tensor, loc: TensorLoc) -> torch.Tensor:
    """A typed, shaped view of ``loc``'s bytes inside a flat uint8 tensor (no copy)."""
    dtype = getattr(torch, loc.dtype)
    if loc.nbytes == 0:
        return torch.empty(loc.shape, dtype=dtype)
    return raw[loc.offset : loc.offset + loc.nbytes].view(dtype).reshape(loc.shape)


# ---------------------------------------------------------------------------------------------- state walking


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return obj.state_dict() if _is_stateful(obj) else obj


def _new_mapping(like: Mapping) -> dict:
    try:
        out: Any = type(like)()
    except TypeError:
        out = {}
    if hasattr(like, "_metadata"):  # nn.Module state dicts carry per-module versions here
        out._metadata = like._metadata  # type: ignore[attr-defined]
    return out


def _rebuild_seq(like: Any, items: list) -> Any:
    if isinstance(like, tuple):
        return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)
    return items


def _split(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]], seen: dict) -> Any:
    """Replace every tensor in nested dicts/lists/tuples by a :class:`_Ref`; collect the tensors."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = None
        if t.layout == torch.strided and t.numel():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   tuple(t.stride()), t.dtype)
            if key in seen:
                return _Ref(seen[key])
        tensors.append((path, t))
        if key is not None:
            seen[key] = len(tensors) - 1
        return _Ref(len(tensors) - 1)
    if isinstance(obj, Mapping):
        out = _new_mapping(obj)
        for k, v in obj.items():
            out[k] = _split(v, f"{path}.{k}", tensors, seen)
        return out
    if isinstance(obj, (list, tuple)):
        return _rebuild_seq(obj, [_split(v, f"{path}.{i}", tensors, seen) for i, v in enumerate(obj)])
    return obj


def _join(obj: Any, table: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return table[obj.index]
    if isinstance(obj, Mapping):
        out = _new_mapping(obj)
        for k, v in obj.items():
            out[k] = _join(v, table)
        return out
    if isinstance(obj, (list, tuple)):
        return _rebuild_seq(obj, [_join(v, table) for v in obj])
    return obj


def _fill(cur: Any, saved: Any, devices: Callable[[torch.Tensor], torch.device]) -> Any:
    """``saved`` with each tensor copied into the matching tensor of ``cur`` (same path, shape and
    dtype), else into a fresh writable tensor. Containers are new; ``cur`` is not modified except
    for the tensor contents."""
    if isinstance(saved, torch.Tensor):
        if isinstance(cur, torch.Tensor) and cur.shape == saved.shape and cur.dtype == saved.dtype:
            with torch.no_grad():
                cur.copy_(saved)
            return cur
        out = torch.empty(saved.shape, dtype=saved.dtype, device=devices(saved))
        out.copy_(saved)
        return out
    if isinstance(saved, Mapping):
        curm = cur if isinstance(cur, Mapping) else {}
        mapping = _new_mapping(saved)
        for k, v in saved.items():
            mapping[k] = _fill(curm.get(k), v, devices)
        return mapping
    if isinstance(saved, (list, tuple)):
        curs = cur if isinstance(cur, (list, tuple)) and len(cur) == len(saved) else [None] * len(saved)
        return _rebuild_seq(saved, [_fill(c, v, devices) for c, v in zip(curs, saved)])
    return saved


# ---------------------------------------------------------------------------------------------- RNG


class RNGState:
    """The global random number generators as one stateful item: Python ``random``, numpy's global
    ``RandomState``, torch's CPU generator and, when CUDA is initialized, every CUDA device's."""

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": cuda}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"].cpu())
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_available():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
            else:
                log.warning("not restoring CUDA RNG: saved for %d devices, %d present", len(cuda),
                            torch.cuda.device_count())


# ---------------------------------------------------------------------------------------------- checkpointer


@dataclass(frozen=True)
class Restored:
    """What a restore found.

    Attributes:
        step: the restored step.
        tier: where the bytes came from ("local", "peer" or "persistent").
        source_node: the node that served them.
        seconds: wall time of the restore (fetch, verification and, for load, the copies).
        metadata: the user metadata given to :meth:`Checkpointer.save`.
        state: name -> restored state (state dicts for stateful items); after :meth:`Checkpointer.read`
            its tensors share read-only mapped memory.
    """

    step: int
    tier: str
    source_node: str
    seconds: float
    metadata: dict
    state: dict = field(repr=False)


@dataclass
class SaveStats:
    """Counters of one :class:`Checkpointer` (updated from the commit thread, read anywhere)."""

    started: int = 0
    committed: int = 0
    failed: int = 0
    last_error: str = ""
    last_blocking_seconds: float = 0.0


@dataclass(frozen=True)
class _Print:
    """What identifies a tensor's bytes without reading them (``incremental``): the very storage
    (held by a weak reference, so a freed one never matches, whatever address its successor
    gets), the version counter (bumped by every in-place op autograd sees, shared with views and
    ``detach()``; not by writes through ``.data``) and the layout."""

    storage: weakref.ref
    version: int
    layout: tuple

    def same(self, other: _Print | None) -> bool:
        """Whether ``other`` (taken now) shows the bytes this print was taken of."""
        if other is None or other.version != self.version or other.layout != self.layout:
            return False
        held = self.storage()
        return held is not None and held is other.storage()


def _fingerprint(t: torch.Tensor) -> _Print | None:
    """A :class:`_Print` of a plain dense tensor; None (never unchanged) for anything else:
    subclasses, sparse or meta tensors, storages without a lasting Python object."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        ref = weakref.ref(t.untyped_storage())
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return _Print(ref, t._version, (str(t.device), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype))


class Checkpointer:
    """Saves and restores one rank's training state under ``job``.

    A step restores only at the world size it was saved with (rank ``r`` loads what rank ``r``
    saved): another world size raises :class:`FailedPreconditionError` naming both, from
    :meth:`latest` (collective) as from :meth:`read` / :meth:`load`. ``tierckpt.dcp`` reshards.

    Args:
        job: the tierckpt job name.
        client: a :class:`tierckpt.Client`; default: a new one for ``address``.
        address: the daemon's address when ``client`` is not given.
        rank, world_size: this process's place; default: ``torch.distributed`` when initialized,
            else 0 and 1.
        raise_on_error: storage errors (daemon down, local tier full) raise from :meth:`save`
            (and a failed background commit raises from the next :meth:`save` or :meth:`wait`)
            instead of being logged, counted in :attr:`stats` and returned as a failed future.
        pack_below: tensors smaller than this many bytes are packed into one shard.
        map_location: device for tensors that cannot be copied into an existing tensor on load;
            default: the device they were saved from when it exists here, else CPU.
        incremental: pass as ``unchanged`` (see :meth:`tierckpt.Client.save`) the tensors with
            their own shard that are views of the very storage the previous committed save of
            this Checkpointer held (a weak reference: a tensor re-created out of place, an EMA
            computed out of place, optimizer state re-allocated, or a new tensor at a freed
            address never matches), with the same layout and version counter (``t._version``):
            the daemon links their files instead of a copy. Frozen parameters
            (``requires_grad=False``) are the common case. Subclasses, sparse and meta tensors
            are always written. Opt-in because an in-place write through ``.data`` (or from
            outside autograd's view, e.g. a custom kernel writing the storage) does not bump the
            version counter: such a tensor would be saved with its previous bytes. Use it only
            when every update goes through ordinary tensor ops (as optimizers do).
    """

    def __init__(self, job: str, *, client: Client | None = None, address: str | None = None,
                 rank: int | None = None, world_size: int | None = None, raise_on_error: bool = False,
                 pack_below: int = 64 << 10, map_location: str | torch.device | None = None,
                 incremental: bool = False) -> None:
        check_job(job)
        if rank is None or world_size is None:
            up = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if up else 0) if rank is None else rank
            world_size = (dist.get_world_size() if up else 1) if world_size is None else world_size
        self.job, self.rank, self.world_size = job, rank, world_size
        self._own_client = client is None
        self.client = client or Client(address)
        self.raise_on_error = raise_on_error
        self.pack_below = pack_below
        self.map_location = None if map_location is None else torch.device(map_location)
        self.stats = SaveStats()
        self._lock = threading.Lock()
        self._pending: set[SaveFuture] = set()
        self._deferred: BaseException | None = None
        self._copier = TensorCopier()
        self._waiter = StagedWaiter()  # staged, awaited before the next optimizer step
        self.incremental = bool(incremental)
        self._prints: dict[str, _Print] = {}  # shard -> fingerprint at the last committed save (incremental)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None,
             persist: bool = False) -> SaveFuture:
        """Save ``state`` as ``step`` of this rank.

        Returns once the copies are enqueued (the objects and small CPU tensors are copied here;
        tensors with their own shard, and everything on a GPU, after this call returned). The
        future's ``staged`` resolves once every byte is in the local tier's staging files: the
        saved tensors must not change before it. This Checkpointer waits for it before the next
        ``step()`` of any optimizer; anything else that writes saved tensors in place first calls
        :meth:`wait_staged`. The future resolves to a :class:`tierckpt.SaveResult` when the rank
        is committed locally (never before ``staged``); its ``total_blocking_seconds`` is the
        time this call held the caller.

        Args:
            metadata: a small JSON object stored in the manifest (see :attr:`Restored.metadata`).
            persist: ask the daemon to drain this step to the persistent tier.

        Raises:
            TierckptError, OSError: storage failures, only with ``raise_on_error`` (otherwise the
                returned future fails).
            InvalidArgumentError: a bad step or metadata (always).
            TypeError, pickle.PicklingError: the state holds something that cannot be saved.
        """
        self._raise_deferred()
        t0 = time.perf_counter()
        tensors: list[tuple[str, torch.Tensor]] = []
        seen: dict = {}
        skeleton = {k: _split(_state_of(v), str(k), tensors, seen) for k, v in state.items()}
        srcs = [_contiguous(t) for _, t in tensors]
        taken: set[str] = set()
        names = [shard_name(p, taken) for p, _ in tensors]
        shards, locs = pack_tensors(list(zip(names, srcs)), self.pack_below, defer=True)
        del srcs
        devices = [str(t.device) for _, t in tensors]
        locs = [dataclasses.replace(loc, device=d) for loc, d in zip(locs, devices)]
        shards[OBJECTS_SHARD] = pickle.dumps({"format": FORMAT, "state": skeleton, "tensors": locs},
                                             protocol=pickle.HIGHEST_PROTOCOL)
        meta = {"tierckpt.torch": FORMAT, "keys": [str(k) for k in state], "user": dict(metadata or {})}
        prints = {n: p for n, (_, t) in zip(names, tensors)
                  if n in shards and (p := _fingerprint(t)) is not None} if self.incremental else {}
        with self._lock:
            self.stats.started += 1
            unchanged = [n for n, p in prints.items() if (was := self._prints.get(n)) is not None and was.same(p)]
        try:
            fut = self.client.save(self.job, step, self.rank, self.world_size, shards, metadata=meta,
                                   persist=persist, unchanged=unchanged, copier=self._copier)
            self._waiter.add(fut.staged)
        except InvalidArgumentError:
            raise  # a bad name or metadata is a bug in the caller, not a storage failure
        except (TierckptError, OSError) as e:
            if self.raise_on_error:
                with self._lock:
                    self.stats.failed += 1
                    self.stats.last_error = repr(e)
                raise
            fut = SaveFuture(self.client, self.job, step, self.rank)
            fut.set_exception(e)
        fut.total_blocking_seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
        with self._lock:
            self.stats.last_blocking_seconds = fut.total_blocking_seconds  # type: ignore[attr-defined]
            self._pending.add(fut)
        fut.add_done_callback(functools.partial(self._done, prints=prints))
        return fut

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the saves started so far are staged (their tensors may change); whether all
        are by ``timeout``. Called before every optimizer step; call it before other in-place
        writes to saved tensors. A failed copy is not raised here (its save's future fails)."""
        return self._waiter.wait(timeout)

    def _done(self, fut: cf.Future, prints: dict[str, _Print] | None = None) -> None:
        err = fut.exception()
        with self._lock:
            self._pending.discard(fut)  # type: ignore[arg-type]
            if err is None:
                self.stats.committed += 1
                if prints:  # commits complete in save order (one committer thread per client)
                    self._prints = prints
                return
            self.stats.failed += 1
            self.stats.last_error = repr(err)
            if self.raise_on_error and self._deferred is None:
                self._deferred = err
        log.warning("checkpoint save of %s step %d rank %d failed (%d failed so far%s): %s: %s", self.job,
                    getattr(fut, "step", -1), self.rank, self.stats.failed,
                    "" if self.raise_on_error else "; training goes on", type(err).__name__, err)

    def _raise_deferred(self) -> None:
        with self._lock:
            err, self._deferred = self._deferred, None
        if err is not None:
            raise err

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save started so far has committed or failed.

        Raises:
            The first background failure, only with ``raise_on_error``.
        """
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending, timeout)
        self._raise_deferred()

    def close(self) -> None:
        """Wait for pending saves (errors are only logged) and close an owned client."""
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending)
        self._waiter.close()
        self._copier.close()  # page-locked staging maps are unregistered
        if self._own_client:
            self.client.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ restoring

    def latest(self) -> int | None:
        """The newest step complete for every rank, or None.

        With torch.distributed initialised this is a collective: each rank asks its own daemon
        which steps it can restore and the ranks agree on the newest one all of them can
        (:func:`tierckpt.agree.agree_restore_step`), so no daemon asks every node. Without it,
        the daemon's cluster-wide ``latest``.
        """
        if dist.is_available() and dist.is_initialized():
            return agree_restore_step(self.client, self.job, self.rank, world_size=self.world_size)
        return self.client.latest(self.job)

    def read(self, step: int | None = None) -> Restored | None:
        """Restore ``step`` (default: the latest) without touching any live object.

        Tensors in :attr:`Restored.state` share the mapped shard memory (zero copy, copy-on-write:
        modifying one copies the touched pages privately; the stored checkpoint never changes).

        Returns:
            None when ``step`` is None and the job has no complete checkpoint.

        Raises:
            NotFoundError: an explicit ``step`` is not held by any tier.
            TierckptError: not a checkpoint written by this module, or a restore failure.
        """
        got = self._read(step)
        return None if got is None else got[0]

    def _read(self, step: int | None) -> tuple[Restored, dict[int, str]] | None:
        t0 = time.perf_counter()
        if step is None:
            step = self.latest()
            if step is None:
                return None
        ck = restore_same_world(self.client, self.job, self.rank, self.world_size, step)
        if OBJECTS_SHARD not in ck.shards:
            raise FailedPreconditionError(f"{self.job} step {ck.step} rank {self.rank}: not a tierckpt.torch "
                                          f"checkpoint (no {OBJECTS_SHARD} shard)")
        doc = pickle.loads(ck.shards[OBJECTS_SHARD].tobytes())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise FailedPreconditionError(f"{self.job} step {ck.step} rank {self.rank}: unknown checkpoint format")
        raws = {s: bytes_of(ck, s) for s in {loc.shard for loc in doc["tensors"]}}
        table = [view_tensor(raws[loc.shard], loc) for loc in doc["tensors"]]
        state = {k: _join(v, table) for k, v in doc["state"].items()}
        devices = {id(t): loc.device for t, loc in zip(table, doc["tensors"])}
        return Restored(ck.step, ck.tier, ck.source_node, time.perf_counter() - t0,
                        ck.metadata.get("user", {}), state), devices

    def load(self, state: MutableMapping[str, Any], step: int | None = None, *,
             strict: bool = True) -> Restored | None:
        """Restore ``step`` (default: the latest) into ``state`` in place.

        Stateful items get ``load_state_dict`` with their saved state, whose tensors were first
        copied into the item's current tensors (so parameters and existing optimizer buffers keep
        their storage); generators get ``set_state``; tensors are copied into in place; other
        values replace the entries of ``state`` (mutable mappings are updated in place).

        Args:
            strict: every key of ``state`` must be in the checkpoint (else KeyError); also passed
                to ``nn.Module.load_state_dict``.

        Returns:
            None when ``step`` is None and the job has no complete checkpoint.

        Raises:
            KeyError: ``strict`` and a key of ``state`` is not in the checkpoint.
            NotFoundError: an explicit ``step`` is not held by any tier.
        """
        t0 = time.perf_counter()
        got = self._read(step)
        return None if got is None else self._load_into(state, got, strict, t0)

    def _load_into(self, state: MutableMapping[str, Any], got: tuple[Restored, dict[int, str]], strict: bool,
                   t0: float) -> Restored:
        """:meth:`load`'s second half: ``got`` (from ``_read``) into ``state``."""
        restored, saved_on = got
        missing = [k for k in state if k not in restored.state]
        if missing and strict:
            raise KeyError(f"{self.job} step {restored.step}: checkpoint has no {missing} "
                           f"(saved: {sorted(map(str, restored.state))})")

        def device_of(t: torch.Tensor) -> torch.device:
            if self.map_location is not None:
                return self.map_location
            dev = torch.device(saved_on.get(id(t), "cpu"))
            return dev if dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()) else _CPU

        for key in [k for k in state if k in restored.state]:
            obj, saved = state[key], restored.state[key]
            if isinstance(obj, torch.Generator):
                obj.set_state(_fill(obj.get_state(), saved, device_of))
            elif _is_stateful(obj):
                filled = _fill(obj.state_dict(), saved, device_of)
                if isinstance(obj, torch.nn.Module):
                    obj.load_state_dict(filled, strict=strict)
                else:
                    obj.load_state_dict(filled)
            elif isinstance(obj, MutableMapping) and isinstance(saved, Mapping):
                filled = _fill(obj, saved, device_of)
                obj.clear()
                obj.update(filled)
            else:
                state[key] = _fill(obj, saved, device_of)
        return Restored(restored.step, restored.tier, restored.source_node, time.perf_counter() - t0,
                        restored.metadata, restored.state)
