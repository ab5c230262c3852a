"""PyTorch Lightning: checkpoints through tierckpt with a ``CheckpointIO`` plugin.

::

    io = tierckpt.lightning.TierckptCheckpointIO("job")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)])
    trainer.fit(model, ckpt_path="last")          # resumes from tierckpt when there is a last checkpoint

The checkpoint dictionary Lightning builds is saved through :class:`tierckpt.torch.Checkpointer`
as step ``checkpoint["global_step"]`` of the job (rank 0 of 1: Lightning calls the plugin on the
global-zero rank with the full state, as its default ``TorchCheckpointIO`` does). At the path
Lightning asked for, the plugin writes a small JSON *pointer* (``{"tierckpt": {"job", "step"}}``)
once the step is committed in the local tier, so ``ModelCheckpoint``'s bookkeeping (top-k,
``last.ckpt``, ``save_last="link"``, ``ckpt_path="last"``) works unchanged on files of a few
hundred bytes. :meth:`~TierckptCheckpointIO.remove_checkpoint` removes the pointer; the step's
data is retained and evicted by the daemon's policy. Loading a path that is not a pointer falls
back to Lightning's ``TorchCheckpointIO`` (ordinary ``.ckpt`` files keep working).

Two paths saved at the same global step (``epoch=0-step=10.ckpt`` and ``last.ckpt``) share one
tierckpt step; the later save replaces the earlier (Lightning saves the same state for both).
Sharded strategies (FSDP, DeepSpeed) bring their own checkpoint IO and are not covered.

``Model.load_from_checkpoint(path)`` reads the file itself (``torch.load``), so on a pointer it
fails with an ``UnpicklingError``; :func:`load_from_checkpoint` is its counterpart::

    model = tierckpt.lightning.load_from_checkpoint(Model, trainer.checkpoint_callback.best_model_path)
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from .client import Client, SaveFuture
from .common.names import check_job
from .manager import owned_copies
from .torch import Checkpointer

if "lightning" in sys.modules or "pytorch_lightning" not in sys.modules:
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.fabric.utilities.cloud_io import get_filesystem
    except ImportError:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning_fabric.utilities.cloud_io import get_filesystem
else:  # pytorch_lightning already imported: its (lightning_fabric) classes
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning_fabric.utilities.cloud_io import get_filesystem

__all__ = ["TierckptCheckpointIO", "read_pointer", "load_from_checkpoint"]

log = logging.getLogger(__name__)

POINTER_KEY = "tierckpt"
_POINTER_MAX = 4096


def read_pointer(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``{"job", "step", ...}`` of a pointer file, or None if ``path`` is not one."""
    fs = get_filesystem(path)
    try:
        with fs.open(str(path), "rb") as fh:
            head = fh.read(_POINTER_MAX + 1)
    except (FileNotFoundError, IsADirectoryError):
        return None
    if len(head) > _POINTER_MAX or not head.startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except (UnicodeDecodeError, ValueError):
        return None
    ptr = doc.get(POINTER_KEY) if isinstance(doc, dict) else None
    return ptr if isinstance(ptr, dict) and "job" in ptr and "step" in ptr else None


def _write_pointer(path: str, doc: Mapping[str, Any]) -> None:
    """Write the pointer atomically (temporary name, then rename) where the filesystem allows."""
    fs = get_filesystem(path)
    data = json.dumps({POINTER_KEY: dict(doc)}, indent=1).encode()
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tierckpt-tmp"
    with fs.open(tmp, "wb") as fh:
        fh.write(data)
    fs.mv(tmp, path)


class TierckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints in tierckpt.

    Args:
        job: the tierckpt job name.
        address: the daemon's address (default ``$TIERCKPT_ADDRESS``, else the standard socket).
        client: an existing :class:`tierckpt.Client` (not closed by :meth:`teardown`).
        persist_every: steps that are multiples of this are saved with ``persist=True`` (0: none
            beyond the daemon's own ``persist_every``).
        async_: return from :meth:`save_checkpoint` once the bytes are staged, writing the pointer
            when the commit lands (True); or wait for the commit (False).
        raise_on_error: a failed save raises (from :meth:`save_checkpoint`, or from the next call
            for a background commit) instead of being logged and skipped (no pointer is written
            for a failed save either way).
    """

    def __init__(self, job: str, *, address: str | None = None, client: Client | None = None,
                 persist_every: int = 0, async_: bool = True, raise_on_error: bool = True) -> None:
        check_job(job)
        self.job, self.persist_every, self.async_ = job, persist_every, async_
        self._address, self._client = address, client
        self._raise_on_error = raise_on_error
        self._ckpt: Checkpointer | None = None
        self._lock = threading.Lock()
        # path -> (step, event set once its save finished and its pointer is written)
        self._pending: dict[str, tuple[int, threading.Event]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for spawn-based strategies: the connection and pending saves stay behind."""
        self._wait()
        state = dict(self.__dict__)
        state.update(_ckpt=None, _lock=None, _pending={})
        if self._client is not None:
            state["_address"], state["_client"] = self._client.address, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`tierckpt.torch.Checkpointer` (connects on first use: the plugin pickles cleanly)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.job, client=self._client, address=self._address, rank=0, world_size=1,
                                      raise_on_error=self._raise_on_error)
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]``; the pointer at ``path`` follows the commit."""
        if storage_options is not None:
            raise TypeError("TierckptCheckpointIO.save_checkpoint takes no storage_options")
        path = os.fspath(path)
        step = int(checkpoint.get("global_step", 0))
        # The daemon aborts an open save when the same (job, step, rank) is begun again: let an
        # earlier save of this step (epoch=N-step=S.ckpt before last.ckpt) commit first.
        self._wait(path, step)
        persist = bool(self.persist_every) and step > 0 and step % self.persist_every == 0
        fut = self.checkpointer.save(step, checkpoint, persist=persist,
                                     metadata={"lightning_path": os.path.basename(path)})
        self._publish_when_committed(fut, path, {"job": self.job, "step": step, "epoch": checkpoint.get("epoch")})
        if not self.async_:
            self._wait(path)
            self.checkpointer.wait()

    def _publish_when_committed(self, fut: SaveFuture, path: str, pointer: Mapping[str, Any]) -> None:
        done = threading.Event()
        with self._lock:
            self._pending[path] = (pointer["step"], done)

        def publish(f: Any) -> None:  # in the commit thread (a failure was logged by the Checkpointer)
            try:
                if f.exception() is None:
                    _write_pointer(path, pointer)
            except OSError as e:  # thread boundary: logged, the checkpoint just has no pointer
                log.warning("could not write the checkpoint pointer %s: %s", path, e)
            finally:
                done.set()
                with self._lock:
                    if self._pending.get(path, (0, None))[1] is done:
                        del self._pending[path]

        fut.add_done_callback(publish)

    def _wait(self, path: str | None = None, step: int | None = None) -> None:
        """Wait until the pending saves of ``path`` or ``step`` (of everything when both are None)
        are committed or failed, and their pointers written."""
        with self._lock:
            events = [done for p, (s, done) in self._pending.items()
                      if (path is None and step is None) or p == path or s == step]
        for done in events:
            done.wait()

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint a pointer at ``path`` names (any other file: ``TorchCheckpointIO``).

        Tensors come back on the CPU as private copies (as ``torch.load`` gives them); Lightning
        copies them to the module's device when it loads the state dicts. ``map_location`` and
        ``weights_only`` apply only to the fallback (the stored objects are trusted as a pickle).

        Raises:
            FileNotFoundError: no file at ``path``.
            tierckpt.NotFoundError: the pointer names a step no tier holds any more.
        """
        path = os.fspath(path)
        self._wait(path)
        ptr = read_pointer(path)
        if ptr is None:
            if not get_filesystem(path).exists(path):
                raise FileNotFoundError(f"checkpoint file not found: {path}")
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if ptr["job"] != self.job:
            log.info("checkpoint %s belongs to tierckpt job %s (this plugin's job: %s)", path, ptr["job"], self.job)
        reader = self.checkpointer if ptr["job"] == self.job else Checkpointer(
            ptr["job"], client=self.checkpointer.client, rank=0, world_size=1)
        restored = reader.read(int(ptr["step"]))  # an explicit step: NotFoundError rather than None
        if restored is None:
            raise FileNotFoundError(f"{path}: tierckpt step {ptr['step']} not found")
        return owned_copies(dict(restored.state))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (the data is evicted by the daemon's retention)."""
        path = os.fspath(path)
        self._wait(path)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def teardown(self) -> None:
        """Wait for pending saves and their pointers; close an owned client."""
        self._wait()
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None



def load_from_checkpoint(cls: Any, checkpoint_path: Any, *, map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, address: str | None = None, client: Client | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a tierckpt pointer (see the module docstring).

    The pointer's step is restored from the nearest tier holding it and handed to Lightning's
    own ``cls.load_from_checkpoint`` as an in-memory checkpoint, so its semantics hold unchanged:
    the saved hyperparameters build the model (``kwargs`` override them), ``hparams_file``
    replaces them, ``strict`` applies to the state dict and ``map_location`` places the tensors
    (default: the CPU, where the restored tensors are; ``model.to(device)`` moves them). The bytes are
    serialized once more in memory (the model's size, briefly). A path that is not a pointer
    goes to ``cls.load_from_checkpoint`` as is.

    Args:
        cls: a ``LightningModule`` (or ``LightningDataModule``) class.
        checkpoint_path: a pointer written by :class:`TierckptCheckpointIO` (e.g. ``best_model_path``).
        address, client: the daemon to restore from (default ``$TIERCKPT_ADDRESS``, else the
            standard socket).

    Raises:
        FileNotFoundError: no file at ``checkpoint_path``.
        tierckpt.NotFoundError: the pointer names a step no tier holds any more.
    """
    ptr = read_pointer(checkpoint_path)
    if ptr is None:
        return cls.load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                        strict=strict, **kwargs)
    plugin = TierckptCheckpointIO(str(ptr["job"]), address=address, client=client)
    try:
        checkpoint = plugin.load_checkpoint(checkpoint_path)
    finally:
        plugin.teardown()
    import torch

    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    del checkpoint
    buf.seek(0)
    # The bytes were unpickled from tierckpt already; they are as trusted as the store itself.
    return cls.load_from_checkpoint(buf, map_location=map_location, hparams_file=hparams_file, strict=strict,
                                    weights_only=False, **kwargs)
