"""How the drain reads, checks and encodes a local chunk: :class:`ChunkReader`.

Two ways, one contract (the bytes sent are the bytes hashed, and a shard is only published when
all of it matched its checksum): in a child process (:mod:`.chunkproc`, ``KNOBS.drain_processes``:
the daemon's GIL is never held for it), or on the calling drain thread, into a reused buffer
(:mod:`.buffers`: no allocation, page fault or zero-fill under the GIL). Either way the worker
waits, at most ``KNOBS.drain_yield``, while a save is open or committing on the node: a child
is stopped wherever it is (:mod:`.pause`), a drain thread waits before each chunk.
The caller (:class:`.content.ContentStore`) owns the concurrency: a codec slot per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import xxhash
from tierckpt.errors import DataLossError

from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import LocalStore
from .buffers import ChunkBuffers
from .chunkproc import ChunkWorker, ChunkWorkers, encode_checked
from .pause import DrainPause
from .verify import VerifyingReader

__all__ = ["ChunkReader"]

log = logging.getLogger(__name__)


class ChunkReader:
    """Reads, checks and encodes the local chunks of the ranks a drain uploads.

    Args:
        store: the local store (shards are opened through it: no link followed).
        halt: set when the tier stops (a yielding worker stops waiting).
    """

    def __init__(self, store: LocalStore, halt: threading.Event) -> None:
        self.store = store
        self.halt = halt
        self.buffers = ChunkBuffers()  # read buffers of the drain's threads, reused from chunk to chunk
        self.workers = ChunkWorkers()  # child processes doing the reads, hashes and encodes (drain_processes)
        self.pause = DrainPause(self.workers.pids)  # the children stopped while a save is open (drain_yield)
        self.workers.on_start = self.pause.adopt
        self.workers.paused_seconds = self.pause.paused_seconds
        store.watch_saving(self.pause.busy)

    def halted(self) -> None:
        """``halt`` was set: drain threads waiting for saves to end stop waiting."""
        self.pause.wake()

    def close(self) -> None:
        """The tier stops: paused children continue, idle ones end."""
        self.store.unwatch_saving(self.pause.busy)
        self.pause.close()
        self.workers.close()

    @contextlib.contextmanager
    def child(self, size: int) -> Iterator[ChunkWorker | None]:
        """A child process for this call (``KNOBS.drain_processes``), or None: the caller does the
        work on its own thread (the knob is off, or a sandbox forbids the children: warned once)."""
        with contextlib.ExitStack() as stack:
            worker = None
            if KNOBS.drain_processes and not self.workers.failed:
                try:
                    worker = stack.enter_context(self.workers.take(size))
                except OSError:
                    if not self.workers.failed:
                        raise
            yield worker

    def hash_shard(self, held: Manifest, shard: str) -> list[tuple[str, int]]:
        """(xxh3-128 hex, size) of every chunk of a local shard, verifying the shard's checksum
        (read into one reused buffer: no allocation, no page fault, no copy under the GIL)."""
        with self.child(KNOBS.chunk_bytes) as worker:
            if worker is not None:
                return self._hash_in(worker, held, shard)
        entry, size = held.shard(shard), KNOBS.chunk_bytes
        fd = self.open(held, shard)
        try:
            src = VerifyingReader(fd, entry.size, entry.checksum, _what(held, shard))
            out = []
            with self.buffers.take(size) as buf:
                while True:
                    self.yield_to_saves()
                    n = src.readinto(buf)
                    if not n:
                        break
                    with buf[:n] as data:
                        out.append((xxhash.xxh3_128_hexdigest(data), n))
            src.check()
            return out
        finally:
            os.close(fd)

    def _hash_in(self, worker: ChunkWorker, held: Manifest, shard: str) -> list[tuple[str, int]]:
        """:meth:`hash_shard` by a child process (:mod:`.chunkproc`), a request per chunk."""
        entry, size, what = held.shard(shard), KNOBS.chunk_bytes, _what(held, shard)
        if entry.size == 0:
            return self._hash_empty(entry.checksum, what)
        fd = self.open(held, shard)
        try:
            out = []
            for off in range(0, entry.size, size):  # no yield_to_saves: the child is paused (.pause)
                n = min(size, entry.size - off)
                last = off + n >= entry.size
                out.append((worker.hash(fd, off, n, off == 0, entry.checksum if last else None, what), n))
            return out
        finally:
            os.close(fd)

    @staticmethod
    def _hash_empty(expected: str, what: str) -> list[tuple[str, int]]:
        from tierckpt.common import checksum as _checksum

        if _checksum.digest(b"") != expected:
            raise DataLossError(f"{what}: the local copy does not match its checksum while uploading")
        return []

    def open(self, held: Manifest, shard: str) -> int:
        from tierckpt.errors import NotFoundError

        try:
            return self.store.open_shard(held, shard)  # no link followed; a regular file of its size
        except NotFoundError as err:  # evicted or re-saved meanwhile: the rank left the local tier
            raise FileNotFoundError(str(err)) from err

    def encoded_in(self, worker: ChunkWorker, held: Manifest, shard: str, offset: int, digest: str, size: int,
                    codec: str) -> memoryview:
        """:meth:`encoded` by a child process (:mod:`.chunkproc`): a view of its output buffer
        (no :meth:`yield_to_saves`: the child is stopped while a save is open, :mod:`.pause`)."""
        fd = self.open(held, shard)
        try:
            return worker.encode(fd, offset, size, digest, codec, _what(held, shard))
        finally:
            os.close(fd)

    def encoded(self, held: Manifest, shard: str, offset: int, digest: str, size: int, codec: str) -> bytes:
        """The stored form of one local chunk, read again and checked against its hash (a worker thread)."""
        self.yield_to_saves()
        fd = self.open(held, shard)
        with self.buffers.take(size) as data:  # reused: no allocation, no page fault, no zero-fill under the GIL
            try:
                got = os.preadv(fd, [data], offset)
            finally:
                os.close(fd)
            if got != size:
                raise DataLossError(f"{_what(held, shard)}: the local copy changed while uploading "
                                    f"(chunk at {offset}); not published")
            self.yield_to_saves()  # a save that began during the read goes first again
            # a new object: nothing refers to the buffer afterwards
            return encode_checked(data, digest, codec, _what(held, shard), offset)

    def yield_to_saves(self) -> None:
        """Wait (a drain thread) while the drain is paused for a save open or committing on this
        node (:mod:`.pause`: at most ``KNOBS.drain_yield`` seconds at a time): saves get the cores,
        the memory bandwidth and the GIL that the drain's reading, encoding and uploading would
        take (bench/save_during_drain.py)."""
        self.pause.wait_idle(self.halt)


def _what(held: Manifest, shard: str) -> str:
    return f"{held.job} step {held.step} rank {held.rank} shard {shard!r}"
