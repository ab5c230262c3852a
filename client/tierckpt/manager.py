"""A checkpoint manager in the spirit of Orbax's: when to save, what to keep, what to resume from.

::

    mgr = tierckpt.CheckpointManager("job", policy=100, persist_every=1000)
    restored = mgr.restore(state)                 # in place for torch; None on a fresh start
    start = restored.step + 1 if restored else 0
    for step in range(start, steps):
        train_step(state)
        mgr.save(step, state)                     # saves only when should_save(step); never raises
    mgr.close()                                   # waits for the last commits

``state`` may be a torch training state (modules, optimizers, tensors, ...; through
:class:`tierckpt.torch.Checkpointer`), a flat mapping of names to numpy arrays or bytes, or a
JAX pytree (through :mod:`tierckpt.jax`). Only what a state needs is imported: the manager itself
imports neither torch nor jax.

Retention: an explicit ``max_to_keep`` is enforced through the job's policy on the daemon
(``keep_local`` = ``max_to_keep["local"]``, ``keep_persistent`` = ``max_to_keep["persistent"]``,
set with :meth:`tierckpt.Client.set_job_policy` before the first save); without one the
daemon's flags apply. Peer copies follow the local retention. Steps due in the persistent tier
(``persist_every``, or the goodput policy's persistent interval) are saved with ``persist=True``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._strict import check_raw, check_torch
from .client import Client, SaveFuture
from .common.names import check_job
from .errors import FailedPreconditionError, InvalidArgumentError, TierckptError
from .goodput import Policy

__all__ = ["CheckpointManager", "ManagerStats", "Restored", "FORMATS"]

log = logging.getLogger(__name__)

RAW_FORMAT = "tierckpt.raw/1"
FORMATS = ("auto", "raw", "torch", "jax")
_RAW_TYPES = (bytes, bytearray, memoryview, np.ndarray)


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.restore` found.

    Attributes:
        step: the restored step.
        tier: where the bytes came from ("local", "peer" or "persistent").
        metadata: the user metadata given to :meth:`CheckpointManager.save`.
        state: the restored state (for an in-place torch restore, the given state itself).
        seconds: wall time of the restore.
    """

    step: int
    tier: str
    metadata: dict
    state: Any = field(repr=False)
    seconds: float = 0.0


@dataclass
class ManagerStats:
    """Save counters. A save is counted as committed or failed once observed finished (by the
    next :meth:`CheckpointManager.save`, :meth:`~CheckpointManager.wait_until_finished` or
    :meth:`~CheckpointManager.close`); failures are logged as soon as they happen."""

    started: int = 0
    committed: int = 0
    failed: int = 0
    skipped: int = 0
    last_error: str = ""


def _detect(state: Any) -> str:
    """The format a state is saved in: raw for flat numpy/bytes mappings, else jax or torch."""
    if isinstance(state, Mapping) and state and all(isinstance(v, _RAW_TYPES) for v in state.values()):
        return "raw"
    if "jax" in sys.modules:
        from . import jax as tjax

        if tjax.is_pytree_of_arrays(state):
            return "jax"
    if "torch" in sys.modules and isinstance(state, Mapping):
        return "torch"
    raise InvalidArgumentError(
        "state: cannot tell its format: give a mapping of numpy arrays/bytes, a torch training state "
        "(a mapping) or a JAX pytree, or pass format='raw'|'torch'|'jax' to CheckpointManager")


def _keep(max_to_keep: Any) -> dict[str, int]:
    """``max_to_keep`` as newest steps per tier (an int: that many locally and persistently)."""
    if max_to_keep is None:
        return {"local": 2, "persistent": 5}
    if isinstance(max_to_keep, int) and not isinstance(max_to_keep, bool):
        if max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep: {max_to_keep!r} must be an integer >= 1")
        return {"local": max_to_keep, "persistent": max_to_keep}
    if not isinstance(max_to_keep, Mapping):
        raise InvalidArgumentError(f"max_to_keep: {max_to_keep!r} must be an integer >= 1 or a mapping of tier "
                                   'to integer, e.g. {"local": 2, "persistent": 5}')
    return dict(max_to_keep)


def _dist_place() -> tuple[int, int] | None:
    """(rank, world_size) from an initialised torch.distributed, without importing torch."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class CheckpointManager:
    """Saves a training state at the steps a policy picks, and resumes from the newest one.

    Args:
        job: the tierckpt job name.
        address: the daemon's address (default ``$TIERCKPT_ADDRESS``, else the standard socket).
        client: an existing :class:`tierckpt.Client` (then ``address`` is ignored and the client
            is not closed by :meth:`close`).
        policy: when to save: an int (every that many steps), a :class:`tierckpt.goodput.Policy`
            (the planner's per-tier intervals: the manager saves at the cheapest tier's interval
            and persists where the persistent interval falls), or None (every step).
        max_to_keep: newest steps wanted per tier, e.g. ``{"local": 2, "persistent": 5}``, or
            an int as Orbax's ``CheckpointManagerOptions(max_to_keep=3)``: that many in the
            local and the persistent tier. When given, enforced as the job's ``keep_local`` /
            ``keep_persistent`` policy on the daemon (default: the daemon's flags; ``peer``
            follows ``local``).
        persist_every: also persist steps that are multiples of this (0: only the policy's).
        async_: return from :meth:`save` once the bytes are staged (the commit runs in the
            background); False waits for the local commit.
        rank, world_size: this process's place; default: torch.distributed when initialised,
            else 0 and 1.
        raise_on_error: storage failures raise from :meth:`save` (and a failed background
            commit from the next :meth:`save` or :meth:`wait_until_finished`) instead of being
            logged, counted in :attr:`stats` and returned as a failed future.
        format: "auto" (from the state), "raw", "torch" or "jax".
        group: the torch.distributed process group through which ranks agree on the restore step.
    """

    def __init__(self, job: str, *, address: str | None = None, client: Client | None = None,
                 policy: Policy | int | None = None, max_to_keep: Mapping[str, int] | int | None = None,
                 persist_every: int = 0, async_: bool = True, rank: int | None = None,
                 world_size: int | None = None, raise_on_error: bool = False, format: str = "auto",
                 group: Any = None) -> None:
        check_job(job)
        if format not in FORMATS:
            raise InvalidArgumentError(f"format: {format!r} must be one of {', '.join(FORMATS)}")
        if isinstance(policy, bool) or (isinstance(policy, int) and policy < 1):
            raise InvalidArgumentError(f"policy: {policy!r} must be an interval >= 1 or a goodput Policy")
        if not isinstance(persist_every, int) or isinstance(persist_every, bool) or persist_every < 0:
            raise InvalidArgumentError(f"persist_every: {persist_every!r} must be an integer >= 0")
        self.job = job
        self._keep_pending = max_to_keep is not None  # set the job's policy before the first save
        self.max_to_keep = _keep(max_to_keep)
        for tier, n in self.max_to_keep.items():
            if tier not in ("local", "peer", "persistent") or not isinstance(n, int) or n < 1:
                raise InvalidArgumentError(f"max_to_keep[{tier!r}]: {n!r} must be an integer >= 1 for a tier")
        self.policy, self.persist_every, self.async_ = policy, persist_every, async_
        self.raise_on_error, self.format, self.group = raise_on_error, format, group
        placed = _dist_place()
        self.rank = rank if rank is not None else (placed[0] if placed else 0)
        self.world_size = world_size if world_size is not None else (placed[1] if placed else 1)
        self._own_client = client is None
        self.client = client or Client(address)
        self.stats = ManagerStats()
        self._lock = threading.Lock()
        self._pending: dict[cf.Future, None] = {}  # an ordered set: failures are raised oldest first
        self._torch: Any = None  # tierckpt.torch.Checkpointer, made on first torch use

    # ------------------------------------------------------------------ when

    def should_save(self, step: int) -> str | None:
        """The most durable tier due at ``step`` ("local" or "persistent"; "peer" with a goodput
        policy), or None. Truthy exactly when :meth:`save` without ``force`` would save."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step: must be an integer >= 0, got {step!r}")
        if isinstance(self.policy, Policy):
            tier = self.policy.should_save(step)
        else:
            tier = "local" if step % (self.policy or 1) == 0 else None
        if self.persist_every and step and step % self.persist_every == 0:
            return "persistent"
        return tier

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Any, *, force: bool = False,
             metadata: Mapping[str, Any] | None = None) -> SaveFuture | None:
        """Save ``state`` as ``step`` if :meth:`should_save` says so (or ``force``).

        Returns:
            None when the step is not due; else a future resolving when the rank is committed
            locally. A storage failure (daemon down, local tier full) is logged, counted in
            :attr:`stats` and carried by the returned (failed) future, unless ``raise_on_error``.

        Raises:
            InvalidArgumentError: a bad step, metadata or state (always: a bug in the caller).
            TierckptError, OSError: storage failures, only with ``raise_on_error``.
        """
        self._raise_deferred()
        tier = self.should_save(step)
        if not tier and not force:
            with self._lock:
                self.stats.skipped += 1
            return None
        persist = tier == "persistent"
        with self._lock:
            self.stats.started += 1
        try:
            fut = self._save(step, state, metadata, persist)
        except InvalidArgumentError:
            raise
        except (TierckptError, OSError) as e:
            if self.raise_on_error:
                self._count_failure(e)
                raise
            fut = SaveFuture(self.client, self.job, step, self.rank)
            fut.set_exception(e)
        if self.raise_on_error and fut.done() and fut.exception() is not None:  # failed before staging
            self._count_failure(fut.exception())  # type: ignore[arg-type]
            raise fut.exception()  # type: ignore[misc]
        with self._lock:
            self._pending[fut] = None
        fut.add_done_callback(self._log_failure)
        if not self.async_:
            cf.wait([fut])
            self._raise_deferred()
        return fut

    def _apply_max_to_keep(self) -> None:
        if not self._keep_pending:
            return
        from ._admin import JobPolicy

        self.client.set_job_policy(self.job, JobPolicy(keep_local=self.max_to_keep.get("local"),
                                                       keep_persistent=self.max_to_keep.get("persistent")))
        self._keep_pending = False

    def _save(self, step: int, state: Any, metadata: Mapping[str, Any] | None, persist: bool) -> SaveFuture:
        self._apply_max_to_keep()
        fmt = self.format if self.format != "auto" else _detect(state)
        if fmt == "torch":
            return self._checkpointer().save(step, state, metadata=metadata, persist=persist)
        if fmt == "jax":
            from . import jax as tjax

            return tjax.save_pytree(self.client, self.job, step, state, rank=self.rank, world_size=self.world_size,
                                    metadata=metadata, persist=persist)
        if not isinstance(state, Mapping) or not all(isinstance(v, _RAW_TYPES) for v in state.values()):
            raise InvalidArgumentError("state: format 'raw' needs a mapping of shard names to numpy arrays or bytes")
        kinds = {str(k): "array" if isinstance(v, np.ndarray) else "bytes" for k, v in state.items()}
        meta = {"tierckpt.format": RAW_FORMAT, "kinds": kinds, "user": dict(metadata or {})}
        return self.client.save(self.job, step, self.rank, self.world_size, state, metadata=meta, persist=persist)

    def _checkpointer(self) -> Any:
        if self._torch is None:
            from .torch import Checkpointer

            self._torch = Checkpointer(self.job, client=self.client, rank=self.rank, world_size=self.world_size)
        return self._torch

    def _count_failure(self, err: BaseException) -> None:
        with self._lock:
            self.stats.failed += 1
            self.stats.last_error = repr(err)

    def _log_failure(self, fut: cf.Future) -> None:
        if (err := fut.exception()) is not None:
            log.warning("checkpoint save of %s step %s rank %d failed%s: %s: %s", self.job, getattr(fut, "step", "?"),
                        self.rank, "" if self.raise_on_error else "; training goes on", type(err).__name__, err)

    def _reap(self) -> BaseException | None:
        """Count the finished saves; the first failure among them (to raise with raise_on_error)."""
        with self._lock:
            done = [f for f in self._pending if f.done()]
            for f in done:
                del self._pending[f]
        first = None
        for f in done:
            err = f.exception()
            if err is None:
                with self._lock:
                    self.stats.committed += 1
            else:
                self._count_failure(err)
                first = first or err
        return first

    def _raise_deferred(self) -> None:
        err = self._reap()
        if err is not None and self.raise_on_error:
            raise err

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Wait until every save started so far has committed or failed; :attr:`stats` is then exact.

        Raises:
            The first failure not raised before, only with ``raise_on_error``.
        """
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending, timeout)
        self._raise_deferred()

    def close(self) -> None:
        """Wait for pending saves (failures are only logged and counted) and close an owned client."""
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending)
        self._reap()
        if self._torch is not None:
            self._torch.close()  # its pre-step hook goes (the client is this manager's to close)
        if self._own_client:
            self.client.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ what exists

    def latest_step(self) -> int | None:
        """The newest step every rank can restore, or None.

        With torch.distributed initialised this is a collective: the ranks agree through their
        process group (:func:`tierckpt.agree.agree_restore_step`). Otherwise the daemon's newest
        complete step.
        """
        if _dist_place() is not None:
            from .agree import agree_restore_step

            return agree_restore_step(self.client, self.job, self.rank, group=self.group, world_size=self.world_size)
        return self.client.latest(self.job)

    def all_steps(self) -> list[int]:
        """Every step complete (all ranks held) in some tier, oldest first."""
        return [info.step for info in self.client.list(self.job) if info.complete]

    # ------------------------------------------------------------------ restoring

    def restore(self, state: Any = None, step: int | None = None, *, strict: bool = True) -> Restored | None:
        """Restore ``step`` (default: :meth:`latest_step`).

        Args:
            state: for a torch state, the live state to load into (in place, as
                :meth:`tierckpt.torch.Checkpointer.load`); for a JAX pytree, the target whose
                structure and shardings the result takes; for a raw mapping, the arrays are
                filled in place. None: return what is stored.
            strict: ``state`` must match the checkpoint: the same keys (key paths inside torch
                modules and mappings, leaves of a pytree), and the same shape and dtype for
                every array or tensor; checked before anything is changed. False: what matches
                is filled, keys the checkpoint lacks keep their values, stored keys the state
                lacks are added (raw) or left out (torch).

        Returns:
            None when ``step`` is None and there is no checkpoint yet.

        Raises:
            InvalidArgumentError: ``strict`` and ``state`` does not match (the message names
                each key path: missing in the checkpoint, not in the state, or expected
                (the state's) against stored shape and dtype); ``state`` is unchanged.
            NotFoundError: an explicit ``step`` is not held by any tier.
            FailedPreconditionError: the step (or the newest one, collectively) was saved with
                another world size (the message names both).
        """
        t0 = time.perf_counter()
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        fmt = self.format if self.format != "auto" or state is None else _detect(state)
        if fmt == "torch":
            return self._restore_torch(state, step, t0, strict)
        from .agree import restore_same_world

        ck = restore_same_world(self.client, self.job, self.rank, self.world_size, step)
        stored = ck.metadata.get("tierckpt.format") or ("torch" if "tierckpt.torch" in ck.metadata else "")
        if stored == "torch":
            return self._restore_torch(None, ck.step, t0, strict)
        if stored.startswith("tierckpt.jax"):
            from . import jax as tjax

            out = tjax.decode(ck, state, strict=strict)
        elif stored == RAW_FORMAT:
            kinds = ck.metadata.get("kinds", {})
            if strict and state is not None:
                if not isinstance(state, Mapping):
                    raise InvalidArgumentError(f"state: {self.job} step {ck.step} holds a mapping of arrays/bytes, "
                                               f"got {type(state).__name__}")
                check_raw(state, ck.shards, kinds, f"{self.job} step {ck.step}")
            out = _fill_raw(state, ck.shards, kinds)
        else:
            raise FailedPreconditionError(f"{self.job} step {ck.step}: not written by CheckpointManager "
                                          f"(format {stored!r})")
        return Restored(ck.step, ck.tier, ck.metadata.get("user", {}), out, time.perf_counter() - t0)

    def _restore_torch(self, state: Any, step: int, t0: float, strict: bool) -> Restored:
        ckpt = self._checkpointer()
        if state is None:
            got = ckpt.read(step)
            return Restored(got.step, got.tier, got.metadata, owned_copies(got.state), time.perf_counter() - t0)
        read = ckpt._read(step)
        if read is None:  # pragma: no cover - an explicit step raises NotFoundError instead
            raise FailedPreconditionError(f"{self.job} step {step}: nothing to restore")
        if strict:
            check_torch(state, read[0].state, f"{self.job} step {read[0].step}")
        got = ckpt._load_into(state, read, strict, t0)
        return Restored(got.step, got.tier, got.metadata, state, time.perf_counter() - t0)


def _fill_raw(state: Any, shards: Mapping[str, np.ndarray], kinds: Mapping[str, str]) -> Any:
    """Stored raw shards as writable arrays / bytes; into ``state``'s arrays where they match."""
    out: dict[str, Any] = {}
    for name, arr in shards.items():
        if kinds.get(name) == "bytes":
            out[name] = arr.tobytes()
            continue
        cur = state.get(name) if isinstance(state, Mapping) else None
        if isinstance(cur, np.ndarray) and cur.shape == arr.shape and cur.dtype == arr.dtype and cur.flags.writeable:
            np.copyto(cur, arr)
            out[name] = cur
        else:
            out[name] = np.array(arr)
    if isinstance(state, MutableMapping):
        state.update(out)
        return state
    return out


def owned_copies(obj: Any) -> Any:
    """``obj`` with every torch tensor in nested dicts, lists and tuples replaced by a private copy.

    :meth:`tierckpt.torch.Checkpointer.read` hands out tensors over the mapped shard files; a
    state that lives on (an optimizer's buffers) must not depend on files the daemon may evict
    and recycle later.
    """
    torch = sys.modules["torch"]
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, Mapping):
        try:
            out: Any = type(obj)()
        except TypeError:
            out = {}
        if hasattr(obj, "_metadata"):  # nn.Module state dicts carry per-module versions here
            out._metadata = obj._metadata
        for k, v in obj.items():
            out[k] = owned_copies(v)
        return out
    if isinstance(obj, list):
        return [owned_copies(v) for v in obj]
    if isinstance(obj, tuple):
        items = [owned_copies(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
