"""Hugging Face ``Trainer``: its checkpoints saved through tierckpt, and resumed from it.

::

    cb = tierckpt.hf.TierckptCallback("job")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.restore(args.output_dir))   # None: a fresh start

The Trainer keeps deciding when to save (``save_strategy``, ``save_steps``) and what a
checkpoint holds (model weights, optimizer, scheduler, scaler, RNG states, ``trainer_state.json``):
at each save point, after it has written ``output_dir/checkpoint-<step>``,
:meth:`TierckptCallback.on_save` stores every file of that folder as one shard of tierckpt step
``<step>`` (the files are mapped and copied straight into the daemon's staging files after
``on_save`` returned, on the client's staging thread; the commit follows in the background).
Nothing waits for ``staged`` at the next optimizer step: the sources are the Trainer's files,
which the next update does not overwrite. :meth:`TierckptCallback.restore` writes the newest step every rank can
restore back into ``output_dir/checkpoint-<step>`` (from the nearest tier: after a node loss, a
peer or the object store) and returns that path for ``resume_from_checkpoint``, so the Trainer
resumes exactly as from its own folder, data-loader position and RNG states included.

The folder on disk is then only a staging area: put ``output_dir`` on a RAM disk or local NVMe
and keep ``save_total_limit`` small; tierckpt holds the history (per the daemon's retention).

Ranks: process 0 stores the folder, less other processes' ``rng_state_<i>.pth``; process ``i``
stores its own ``rng_state_<i>.pth``, so a step is complete when every process has saved. Tested
with one process; with several nodes the folder must be on a filesystem process 0 sees.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from typing import Any

import numpy as np
from transformers import TrainerCallback

from ._staging import Deferred
from .agree import agree_restore_step
from .client import Client, SaveFuture
from .common.names import check_job
from .errors import FailedPreconditionError, InvalidArgumentError, TierckptError

__all__ = ["TierckptCallback", "FORMAT"]

log = logging.getLogger(__name__)

FORMAT = "tierckpt.hf/1"
PREFIX = "checkpoint-"
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth$")
_BAD = re.compile(r"[^A-Za-z0-9._-]")


def _owner(rel: str) -> int:
    """The process that stores file ``rel`` of a checkpoint folder."""
    m = _RNG_FILE.fullmatch(os.path.basename(rel))
    return int(m.group(1)) if m else 0


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def _shard_names(rels: list[str]) -> dict[str, str]:
    """A unique valid shard name for each relative path: shard -> path."""
    out: dict[str, str] = {}
    for rel in rels:
        base = re.sub(r"\.{2,}", ".", _BAD.sub("_", rel.replace(os.sep, "__")))[:200] or "file"
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base}-{n}"
        out[name] = rel
    return out


def _safe_rel(rel: str) -> str:
    """``rel`` if it stays inside the folder (a manifest is data, not a path to trust)."""
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm.startswith(".."):
        raise InvalidArgumentError(f"file name: {rel!r} leaves the checkpoint folder")
    return norm


def _write_file(path: str, data: np.ndarray) -> None:
    """Write ``path`` under a temporary name, then rename (no half-written file is ever seen)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tierckpt-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class TierckptCallback(TrainerCallback):
    """Stores each Trainer checkpoint folder in tierckpt; :meth:`restore` brings the newest back.

    Args:
        job: the tierckpt job name.
        address: the daemon's address (default ``$TIERCKPT_ADDRESS``, else the standard socket).
        client: an existing :class:`tierckpt.Client` (not closed by :meth:`close`).
        persist_every: steps that are multiples of this are saved with ``persist=True``.
        raise_on_error: a failed save raises into the Trainer instead of being logged and counted
            in :attr:`failed` (training goes on: the folder on disk is still there).
    """

    def __init__(self, job: str, *, address: str | None = None, client: Client | None = None,
                 persist_every: int = 0, raise_on_error: bool = False) -> None:
        check_job(job)
        self.job, self.persist_every, self.raise_on_error = job, persist_every, raise_on_error
        self._address, self._client = address, client
        self._own_client = client is None
        self._lock = threading.Lock()
        self._pending: list[SaveFuture] = []
        self.saved: list[int] = []  # steps committed (counted by wait(), on_train_end and close())
        self.failed = 0

    @property
    def client(self) -> Client:
        """The client (connects on first use)."""
        if self._client is None:
            self._client = Client(self._address)
        return self._client

    # ------------------------------------------------------------------ saving

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Store ``output_dir/checkpoint-<global_step>`` as tierckpt step ``global_step``."""
        step = int(state.global_step)
        folder = os.path.join(args.output_dir, f"{PREFIX}{step}")
        rank, world = int(args.process_index), int(args.world_size)
        rels = [r for r in _files(folder) if _owner(r) == rank or (rank == 0 and _owner(r) >= world)]
        names = _shard_names(rels)
        shards: dict[str, Any] = {}
        for name, rel in names.items():
            path = os.path.join(folder, rel)
            if os.path.getsize(path):
                mm = np.memmap(path, mode="r")
                shards[name] = Deferred(mm, mm.nbytes, mm.dtype.str, mm.shape)  # copied after on_save returned
            else:
                shards[name] = b""
        if not shards:
            shards["empty"] = b""  # this process wrote nothing here; it still commits its rank
        meta = {"tierckpt.format": FORMAT, "files": names, "global_step": step, "epoch": state.epoch}
        persist = bool(self.persist_every) and step % self.persist_every == 0
        try:
            fut = self.client.save(self.job, step, rank, world, shards, metadata=meta, persist=persist)
        except InvalidArgumentError:
            raise
        except (TierckptError, OSError) as e:
            if self.raise_on_error:
                raise
            self._failed(step, e)
            return
        finally:
            shards.clear()  # the staging thread holds the file maps until they are copied
        with self._lock:
            self._pending.append(fut)
        fut.add_done_callback(self._done)

    def _failed(self, step: int, err: BaseException, count: bool = True) -> None:
        if count:
            with self._lock:
                self.failed += 1
        log.warning("tierckpt save of %s step %d failed (the Trainer's folder is kept): %s: %s",
                    self.job, step, type(err).__name__, err)

    def _done(self, fut: Any) -> None:  # in the commit thread: log at once; counted by wait()
        err = fut.exception()
        if err is not None:
            self._failed(fut.step, err, count=False)

    def wait(self) -> None:
        """Wait for every save started so far; then :attr:`saved` and :attr:`failed` are exact.

        Raises:
            The first failure, only with ``raise_on_error``.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        first = None
        for fut in pending:
            err = fut.exception()
            with self._lock:
                if err is None:
                    self.saved.append(fut.step)
                else:
                    self.failed += 1
            first = first or err
        if first is not None and self.raise_on_error:
            raise first

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait for the last commits before the Trainer returns."""
        self.wait()

    def close(self) -> None:
        """Wait for pending saves and close an owned client."""
        self.wait()
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ restoring

    def restore(self, output_dir: str, step: int | None = None, *, rank: int | None = None) -> str | None:
        """Write step ``step`` (default: the newest every rank can restore) into
        ``output_dir/checkpoint-<step>`` and return that path, or None when there is none.

        Collective when torch.distributed is initialised (the ranks agree on the step).

        Raises:
            NotFoundError: an explicit ``step`` is not held by any tier.
        """
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if step is None:
            step = agree_restore_step(self.client, self.job, rank)
            if step is None:
                return None
        ck = self.client.restore(self.job, rank, step)
        if ck.metadata.get("tierckpt.format") != FORMAT:
            raise FailedPreconditionError(f"{self.job} step {ck.step}: not a Trainer checkpoint saved by "
                                          "TierckptCallback")
        folder = os.path.join(output_dir, f"{PREFIX}{ck.step}")
        for name, rel in ck.metadata["files"].items():
            _write_file(os.path.join(folder, _safe_rel(rel)), ck.shards[name])
        log.info("restored %s step %d from the %s tier into %s", self.job, ck.step, ck.tier, folder)
        return folder
