"""PyTorch's DCP storage tests run against tierckpt: FileSystemWriter/FileSystemReader (and DCP's
own choice of storage for ``checkpoint_id=<a path>``) become :class:`tierckpt.dcp.Writer` and
:class:`tierckpt.dcp.Reader` on one tierckptd daemon.

A directory path names a tierckpt checkpoint: :func:`checkpoint_for` maps it, deterministically,
to a job (a hash of the path) and step 1, so a test that saves into a path and loads from it (in
any process: the gloo worker processes of ``MultiProcessTestCase`` compute the same pair) reads
what it wrote, and saving into the same path again re-saves that step (``overwrite``, DCP's
default, as FileSystemWriter does).

:func:`install` swaps the classes in; call it before the test module imports
``FileSystemWriter``/``FileSystemReader`` by name, in the parent and in every worker process
(importing the test module does it). The daemon's address comes from ``$TIERCKPT_ADDRESS``,
which the parent sets (tests/dcp/upstream/conftest.py) before any worker is spawned: spawned
processes inherit it.

FileSystemWriter's file-layout options (``single_file_per_rank``, ``sync_files``,
``thread_count``, ``per_thread_copy_ahead``, ``cache_staged_state_dict``, ``_extensions``,
``serialization_format``) and FileSystemReader's ``_extension_registry`` are accepted and
ignored: tierckpt stores the bytes DCP hands it, whatever stream transform FileSystemWriter
would have applied to its files.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import tierckpt.dcp as tdcp

__all__ = ["ADDRESS_ENV", "PathReader", "PathWriter", "checkpoint_for", "install", "torch_compat"]

ADDRESS_ENV = "TIERCKPT_ADDRESS"
STEP = 1


def checkpoint_for(path: str | os.PathLike) -> tuple[str, int]:
    """The tierckpt ``(job, step)`` standing for the checkpoint directory ``path``."""
    digest = hashlib.sha256(os.path.abspath(os.fspath(path)).encode()).hexdigest()[:20]
    return f"dcp-upstream-{digest}", STEP


def _tierckpt_id(checkpoint_id: Any) -> str:
    s = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)
    if s.startswith("tierckpt://"):
        return s
    job, step = checkpoint_for(s)
    return f"tierckpt://{job}/{step}"


class PathWriter(tdcp.Writer):
    """``FileSystemWriter(path, ..., overwrite=...)`` as a tierckpt Writer of ``checkpoint_for(path)``."""

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True, **_ignored: Any) -> None:
        job, step = checkpoint_for(path)
        super().__init__(job, step, address=os.environ[ADDRESS_ENV], overwrite=overwrite)

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(_tierckpt_id(checkpoint_id) if checkpoint_id else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return bool(str(checkpoint_id))


class PathReader(tdcp.Reader):
    """``FileSystemReader(path)`` as a tierckpt Reader of ``checkpoint_for(path)``."""

    def __init__(self, path: str | os.PathLike, **_ignored: Any) -> None:
        job, step = checkpoint_for(path)
        super().__init__(job, step, address=os.environ[ADDRESS_ENV])

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(_tierckpt_id(checkpoint_id) if checkpoint_id else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return bool(str(checkpoint_id))


def install() -> None:
    """Make DCP's names for the filesystem storage mean tierckpt: ``torch.distributed.checkpoint``'s
    ``FileSystemWriter``/``FileSystemReader`` (what the tests import and construct) and the
    classes ``dcp.save``/``dcp.load`` pick for ``checkpoint_id=<a path>``."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint._storage_utils as storage_utils

    for mod in (dcp, storage_utils):
        mod.FileSystemWriter = PathWriter  # type: ignore[attr-defined,misc]
        mod.FileSystemReader = PathReader  # type: ignore[attr-defined,misc]


def torch_compat() -> None:
    """Names that PyTorch's newer test files import from torch's test helpers and torch 2.13's
    lack, where a stand-in keeps their meaning on a machine without accelerators:

    * ``common_dtensor._get_device_type(world_size)``: the device type to test on for that many
      ranks; used by ``TestCheckpointOrderingAndOverwrite.backend_str`` of
      e2e/test_e2e_save_and_load.py, whose tests need 4 GPUs (skipped here). "cpu" without an
      accelerator, else the accelerator's type when it has ``world_size`` devices.
    """
    import torch
    from torch.testing._internal.distributed._tensor import common_dtensor

    if not hasattr(common_dtensor, "_get_device_type"):
        def _get_device_type(world_size: int) -> str:
            acc = torch.accelerator.current_accelerator()
            if acc is None or torch.accelerator.device_count() < world_size:
                return "cpu"
            return acc.type

        common_dtensor._get_device_type = _get_device_type  # type: ignore[attr-defined]
