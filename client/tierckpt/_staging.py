"""Copies that land in the local tier's staging files after ``save()`` returned.

A shard given to :meth:`tierckpt.Client.save` as a :class:`Deferred` is not copied in the
caller's thread: ``save()`` begins the save, lets the :class:`Copier` mark the point whose bytes
are saved (:meth:`Copier.mark`: on a GPU, an event on the current stream), and returns. The
client's staging thread then maps each staging file and has the copier copy the source straight
into the mapping (one host copy), and resolves the future's ``staged`` point; the commit thread
waits for it before hashing and committing, and a copy that fails aborts the save on the daemon
and fails the future (nothing is committed).

Call order of a :class:`Copier`, per save::

    1) mark(sources)            in save(), on the caller's thread; cheap
    2) copy(mark, pairs, io)    on the client's staging thread; returns once every byte landed
                                (or raises); the destinations are writable uint8 arrays over the
                                staging mappings
    3) host_copy(source)        instead of 1-2 when the bytes are streamed over gRPC (no shared
                                filesystem): a host copy, in save()
    close()                     when its saver closes: release what it holds between saves

Until ``staged`` the caller must not change a deferred source: the torch integrations wait for it
before the next optimizer step (:mod:`tierckpt._hooks`), never in ``save()``.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._transfer import run_pieces

__all__ = ["Deferred", "Copier", "HostCopier", "Destinations"]

_PIECE = 64 << 20  # bytes per host copy task (as _transfer._COPY_PIECE)


@dataclass(frozen=True)
class Deferred:
    """A shard whose bytes a :class:`Copier` copies into the staging file after ``save()`` returned.

    Attributes:
        source: what the copier copies from (a numpy array, a torch tensor on any device...).
        nbytes: its size in bytes.
        dtype: the dtype recorded in the manifest (as :func:`tierckpt._buffers.as_buffer` records it).
        shape: its shape.
    """

    source: Any
    nbytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()


class Copier(ABC):
    """Copies deferred sources into staging mappings (see the module docstring for the call order)."""

    def mark(self, sources: list[Any]) -> Any:
        """The point of the caller's work whose bytes are saved (on the caller's thread, in save())."""
        return None

    @abstractmethod
    def copy(self, mark: Any, pairs: list[tuple[Any, np.ndarray]], io: cf.Executor) -> None:
        """Copy each source into its destination; return once every byte has landed.

        Raises:
            Anything: the save is aborted and its future fails with the error.
        """

    @abstractmethod
    def host_copy(self, source: Any) -> memoryview:
        """A contiguous host copy (or view) of ``source``'s bytes, for a streamed save."""

    def close(self) -> None:
        """Release what the copier holds between saves (no copy may be in flight)."""


def _host_bytes(source: Any) -> np.ndarray:
    """A flat uint8 view of a host source (a contiguous numpy array or buffer)."""
    arr = source if isinstance(source, np.ndarray) else np.frombuffer(source, dtype=np.uint8)
    return arr.reshape(-1).view(np.uint8)


class HostCopier(Copier):
    """Host sources (numpy arrays, buffers): ``np.copyto`` on the client's I/O threads."""

    def copy(self, mark: Any, pairs: list[tuple[Any, np.ndarray]], io: cf.Executor) -> None:
        copy_host(pairs, io, _host_bytes)

    def host_copy(self, source: Any) -> memoryview:
        return _host_bytes(source).data


def copy_host(pairs: list[tuple[Any, np.ndarray]], io: cf.Executor, as_bytes: Callable[[Any], np.ndarray]) -> None:
    """Copy host sources into their destinations in pieces on ``io``; raises the first failure."""
    pieces: list[tuple[Any, ...]] = []
    for src, dst in pairs:
        raw = as_bytes(src)
        if raw.nbytes != dst.nbytes:
            raise ValueError(f"source of {raw.nbytes} bytes for a staging file of {dst.nbytes}")
        for off in range(0, dst.nbytes, _PIECE):
            pieces.append((np.copyto, dst[off : off + _PIECE], raw[off : off + _PIECE]))
    run_pieces(io, pieces)


class Destinations:
    """The writable mappings of one save's deferred shards: kept maps (recycled files, see
    :class:`tierckpt._transfer.StagingMaps`) or maps of their own, unmapped by :meth:`close`."""

    def __init__(self, kept: Any) -> None:
        self._kept = kept
        self.maps: dict[str, mmap.mmap] = {}
        self._own: list[mmap.mmap] = []

    def open(self, name: str, path: str, size: int, recycled: bool) -> np.ndarray:
        """A writable uint8 array over the staging file of ``name`` (already sized by the daemon)."""
        mm = self._kept.get(path, size) if recycled else None
        if mm is None:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._own.append(mm)
        self.maps[name] = mm
        return np.frombuffer(mm, dtype=np.uint8)

    def close(self) -> None:
        """Unmap the maps of their own (after the commit or the abort; a page-locked one is
        unregistered first, see :data:`tierckpt._transfer.UNMAP_HOOKS`)."""
        from ._transfer import unmap

        self.maps.clear()
        own, self._own = self._own, []
        unmap(own)


class Stager:
    """The client's staging thread: the deferred copies of its saves, one save after another.

    :meth:`submit` returns a future of the save's :class:`Destinations` (the commit thread hashes
    through them, then closes them) and resolves ``staged`` once every byte landed, or fails
    both with the typed error.
    """

    def __init__(self, kept: Any, io: cf.Executor) -> None:
        self._kept, self._io = kept, io
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-stage")

    def submit(self, staged: cf.Future, copier: Copier, mark: Any,
               later: list[tuple[str, Deferred, Any]]) -> cf.Future:
        """Copy ``later`` ((name, deferred, StagedShard) per shard) in the background."""
        return self._thread.submit(self._run, staged, copier, mark, later)

    def _run(self, staged: cf.Future, copier: Copier, mark: Any, later: list[tuple[str, Deferred, Any]]
             ) -> Destinations:
        from ._transfer import typed_os_error
        from .errors import InternalError, TierckptError

        dests = Destinations(self._kept)
        try:
            pairs = [(d.source, dests.open(name, s.path, d.nbytes, s.recycled)) for name, d, s in later if d.nbytes]
            copier.copy(mark, pairs, self._io)
            del pairs
        except BaseException as e:  # thread boundary: staged and the save's future carry it, typed
            dests.close()
            if isinstance(e, OSError):
                e = typed_os_error(e, "copying into the staging file")
            elif not isinstance(e, TierckptError):
                e = InternalError(f"copying into the staging files failed: {e!r}")
            staged.set_exception(e)
            raise e from None
        staged.set_result(None)
        return dests

    def shutdown(self) -> None:
        """Finish the copies in flight (their commits follow), then end the thread."""
        self._thread.shutdown(wait=True)
