"""The same-node data path of the client: copying into staging files, mapping restored shards.

Saves copy each buffer straight into the daemon's staging files (a memcpy into kept maps of
recycled files, else pwrite); restores map the committed files copy-on-write, or read them over
gRPC when the client does not share the daemon's filesystem.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from . import _pack
from ._buffers import ShardBuffer
from .common import checksum as _checksum
from .common.fileio import digest_file, pwrite_all
from .common.status import error_from_rpc
from .errors import (
    AbortedError,
    CapacityError,
    DataLossError,
    InternalError,
    NotFoundError,
    PermissionDeniedError,
    TierckptError,
)
from .v1 import tierckpt_pb2 as pb

__all__ = ["write_requests", "write_files", "Progress", "StagingMaps", "copy_into", "map_verified", "read_stream",
           "hash_staged", "batches", "run_batched", "MAP_MIN", "UNMAP_HOOKS", "unmap"]

_COPY_PIECE = 64 << 20
"""Bytes per copy task: large shards are split so that several I/O threads copy them."""
_BATCH = 16 << 20
"""Bytes per task for small shards: thousands of them are copied, hashed or mapped in batches,
not one executor task each."""
MAP_MIN = 1 << 20
"""Smaller recycled files are written with pwrite: a kept map (and its warming) per small file
costs more than it saves."""
UNMAP_HOOKS: list[Callable[[mmap.mmap], None]] = []
"""Called with every staging map about to be unmapped (:func:`unmap`): a copier that page-locked
it (``tierckpt._tensorcopy``) unregisters it first."""



def run_pieces(io: cf.Executor, pieces: list[tuple[Any, ...]]) -> None:
    """Run ``fn(*args)`` for each piece on ``io`` and wait for all; the first error is raised once
    none is running any more. No piece may outlive the call: a caller closes the descriptors the
    pieces write to right after, and a late pwrite would write into whatever reuses the number."""
    futs = [io.submit(*p) for p in pieces]
    try:
        for f in futs:
            f.result()
    finally:
        for f in futs:
            f.cancel()
        cf.wait(futs)

def batches(items: list, size_of: Callable[[Any], int], limit: int = _BATCH) -> list[list]:
    """Consecutive items grouped into lists of about ``limit`` bytes (each item in one list)."""
    out: list[list] = []
    cur: list = []
    n = 0
    for it in items:
        cur.append(it)
        n += size_of(it)
        if n >= limit:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def run_batched(io: cf.Executor, fn: Callable[[Any], Any], items: list, size_of: Callable[[Any], int]) -> list:
    """``[fn(x) for x in items]`` on the I/O threads, small items batched; in order."""
    parts = io.map(lambda batch: [fn(x) for x in batch], batches(items, size_of))
    return [r for part in parts for r in part]


def write_files(batch: list[tuple[str, memoryview]]) -> None:
    for path, view in batch:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            pwrite_all(fd, view, 0)
        finally:
            os.close(fd)


class StagingMaps:
    """Writable maps of recycled staging files, by inode, kept for the files of recent saves.

    The daemon recycles the files of evicted steps for saves of the same sizes, so a steady save
    loop cycles through a fixed set of inodes; keeping their maps makes each save a memcpy into
    mapped, faulted-in pages. A map not used for ``keep`` saves is dropped (a dropped file's
    pages are freed only once its map is gone, which bounds what the cache can pin).
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._save = 0
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, int]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Unmap every kept map now (the client is closing: no save is in flight)."""
        with self._lock:
            maps, self._maps = [mm for mm, _ in self._maps.values()], {}
        unmap(maps)

    def new_save(self) -> None:
        """A save begins (maps it does not use age by one)."""
        with self._lock:
            self._save += 1

    def trim(self) -> None:
        """Unmap the maps not used for ``keep`` saves. Called after a save's copy, off the
        caller's blocking path: unmapping a file whose inode was meanwhile dropped frees its pages
        (~0.1 s per GiB), which must not land in the next save's blocking time (nor be left to the
        garbage collector, which would run it at a random point of a later save)."""
        with self._lock:
            stale = [k for k, (_, used) in self._maps.items() if self._save - used > self.keep]
            maps = [self._maps.pop(k)[0] for k in stale]
        unmap(maps)

    def get(self, path: str, size: int) -> mmap.mmap | None:
        """The kept writable map of the file at ``path`` (by inode), mapped (MAP_POPULATE) and
        kept on a miss: populating the page tables of existing tmpfs pages costs far less than a
        pwrite of the same bytes (measured on a quiet machine: the first save that reuses files
        is as fast as the next ones), so the first reuse already copies with memcpy."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with self._lock:
                hit = self._maps.get(key)
                if hit is not None and len(hit[0]) == size:
                    self._maps[key] = (hit[0], self._save)
                    return hit[0]
                if hit is not None:  # the file was resized: its old map goes
                    del self._maps[key]
            if hit is not None:
                unmap([hit[0]])
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):  # resized meanwhile: the caller writes with pwrite
                return None
            with self._lock:
                self._maps[key] = (mm, self._save)
            return mm
        finally:
            os.close(fd)


def unmap(maps: list[mmap.mmap]) -> None:
    """Unmap staging maps (the :data:`UNMAP_HOOKS` first)."""
    for mm in maps:
        for hook in list(UNMAP_HOOKS):
            hook(mm)
        try:
            mm.close()
        except BufferError:  # still exported by an in-flight user: unmapped when it lets go
            pass


_STREAM_CHUNK = 4 << 20
"""Bytes per WriteShard message when a client streams (no shared filesystem)."""


def write_requests(save_id: str, buffers: list[ShardBuffer], digests: dict[str, str],
                   pack: tuple[_pack.Layout, list[ShardBuffer]] | None = None) -> Iterator[pb.WriteShardRequest]:
    """The WriteShard stream of a save; fills ``digests`` (shard -> checksum) as it goes.

    With ``pack`` (its layout and the packed buffers), the pack and then its index follow.
    """
    for b in buffers:
        h = _checksum.new()
        for off in range(0, b.nbytes, _STREAM_CHUNK):
            piece = b.view[off : off + _STREAM_CHUNK]
            h.update(piece)
            yield pb.WriteShardRequest(save_id=save_id, shard=b.name, offset=off, data=bytes(piece))
        digests[b.name] = h.hexdigest()
    if pack is not None:
        layout, small = pack
        h, parts = _checksum.new(), list[str]()
        for off, data in _pack.stream_pieces(layout, [b.view for b in small], parts, _STREAM_CHUNK):
            h.update(data)
            yield pb.WriteShardRequest(save_id=save_id, shard=_pack.PACK, offset=off, data=data)
        digests[_pack.PACK] = h.hexdigest()
        index = _pack.encode_index(layout, parts)
        for off in range(0, len(index), _STREAM_CHUNK):
            yield pb.WriteShardRequest(save_id=save_id, shard=_pack.INDEX, offset=off,
                                       data=index[off : off + _STREAM_CHUNK])
        digests[_pack.INDEX] = _checksum.digest(index)


class Progress:
    """``advance(n)``: n more bytes done; calls ``report(done, total)`` (any thread), if given."""

    def __init__(self, total: int, report: Callable[[int, int], None] | None) -> None:
        self.total, self.report, self.done = total, report, 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self.report:
            with self._lock:
                self.done += n
                self.report(self.done, self.total)


def copy_into(io: cf.Executor, kept: StagingMaps, buffers: list[ShardBuffer], staged: dict[str, pb.StagedShard],
              pack: tuple[_pack.Layout, list[ShardBuffer]] | None = None) -> dict[str, Any]:
    """Copy each buffer into its staging file; returns the writable maps used (for hashing).

    With ``pack`` (its layout and the packed buffers), those are copied into the one staging
    file of the pack at their offsets, in batches of about 16 MiB (same choice of map or pwrite).

    A recycled staging file whose map is kept (see :class:`StagingMaps`) gets a plain memcpy
    into mapped, faulted-in pages; any other file is filled with pwrite (into the existing pages
    of a recycled file, or allocating pages, which pwrite does faster than first-touch faults
    through a map), while the map of a recycled file is built in the background for next time.
    """
    kept.new_save()
    fds: dict[str, int] = {}
    maps: dict[str, Any] = {}
    try:
        pieces: list[tuple] = []
        small: list[tuple[str, memoryview]] = []
        for b in buffers:
            s = staged[b.name]
            if b.nbytes < MAP_MIN:
                if b.nbytes:
                    small.append((s.path, b.view))
                continue
            mm = kept.get(s.path, b.nbytes) if s.recycled else None
            if mm is not None:
                maps[b.name] = mm
                dst = np.frombuffer(mm, dtype=np.uint8)
                src = np.frombuffer(b.view, dtype=np.uint8)
                for off in range(0, b.nbytes, _COPY_PIECE):
                    pieces.append((np.copyto, dst[off : off + _COPY_PIECE], src[off : off + _COPY_PIECE]))
                continue
            fds[b.name] = os.open(s.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            for off in range(0, b.nbytes, _COPY_PIECE):
                pieces.append((pwrite_all, fds[b.name], b.view[off : off + _COPY_PIECE], off))
        pieces.extend((write_files, batch) for batch in batches(small, lambda x: len(x[1])))
        if pack is not None:
            layout, packed = pack
            s = staged[_pack.PACK]
            mm = kept.get(s.path, layout.size) if s.recycled and layout.size >= MAP_MIN else None
            into: Any
            if mm is not None:
                maps[_pack.PACK] = mm
                into = np.frombuffer(mm, dtype=np.uint8)
            else:
                into = fds[_pack.PACK] = os.open(s.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            pieces.extend((_pack.fill, into, batch) for batch in _pack.fill_batches(layout, [b.view for b in packed]))
        run_pieces(io, pieces)
    except OSError as e:
        raise typed_os_error(e, "copying into the staging file") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    return maps


def map_verified(job: str, step: int, rank: int, s: pb.RestoredShard, advance: Callable[[int], None],
                 verify: bool) -> Any:
    """Map a restored shard of the shared local dir copy-on-write, verifying it when asked."""
    if s.size == 0:
        buf: Any = b""
    else:
        try:
            fd = os.open(s.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted or re-saved since the daemon answered (not corrupt)
            raise NotFoundError(f"{job} step {step} rank {rank} shard {s.name!r}: the local copy was removed "
                                "while restoring") from None
        try:
            # Private (copy-on-write) map: reads share the page cache with the stored file;
            # a caller that writes into a tensor made from it gets private pages instead of a
            # crash, and the stored copy never changes. (No MAP_POPULATE: on a private
            # writable map it would copy every page.)
            buf = mmap.mmap(fd, s.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except ValueError:  # the file is shorter than the manifest says
            raise DataLossError(f"{job} step {step} rank {rank} shard {s.name!r}: the local copy is shorter "
                                f"than {s.size} bytes") from None
        finally:
            os.close(fd)
    if verify:
        actual = _checksum.digest(buf)
        if actual != s.checksum:
            raise DataLossError(f"{job} step {step} rank {rank} shard {s.name!r}: checksum mismatch "
                                f"(expected {s.checksum}, got {actual})")
    advance(s.size)
    return buf


def read_stream(stub: Any, address: str, job: str, step: int, rank: int, s: pb.RestoredShard,
                advance: Callable[[int], None]) -> bytearray:
    """Read a restored shard over gRPC (no shared dir), verifying it."""
    buf = bytearray(s.size)
    h = _checksum.new()
    req = pb.ReadShardRequest(job=job, step=step, rank=rank, shard=s.name)
    try:
        got = 0
        for chunk in stub.ReadShard(req, timeout=None):
            n = len(chunk.data)
            if chunk.offset != got or got + n > s.size:
                raise DataLossError(f"shard {s.name!r}: out-of-order or oversized stream at {chunk.offset}")
            buf[got : got + n] = chunk.data
            h.update(chunk.data)
            got += n
            advance(n)
    except grpc.RpcError as e:
        raise error_from_rpc(e, f"ReadShard at {address}") from None
    if got != s.size or h.hexdigest() != s.checksum:
        raise DataLossError(f"{job} step {step} rank {rank} shard {s.name!r}: checksum mismatch after streaming")
    return buf


def typed_os_error(e: OSError, what: str) -> TierckptError:
    """The typed error for an I/O failure on a save's staging files in the shared local dir."""
    if isinstance(e, FileNotFoundError):
        return AbortedError(f"{what}: a staging file vanished (the save was superseded by another save of "
                            f"the rank, aborted or expired): {e.filename}")
    if e.errno == errno.ENOSPC:
        return CapacityError(f"{what}: local_dir is full: {e}")
    if isinstance(e, PermissionError):
        return PermissionDeniedError(f"{what}: {e}")
    return InternalError(f"{what} failed: {e}")


def hash_staged(target: str | mmap.mmap, size: int) -> str:
    """Checksum of a staged shard: through the kept map when there is one, else from the file."""
    return _checksum.digest(target) if isinstance(target, mmap.mmap) else digest_file(target, size)
