"""Reusable chunk buffers of the drain: :class:`ChunkBuffers`.

Why: a fresh ``bytearray(8 MiB)`` per chunk is zero-filled by CPython while it holds the GIL, and
each of its 2048 pages is faulted in there (~7 ms per chunk on the 2-core bench machine): the
event loop serving a save's RPCs waits that long for the GIL, and the page faults contend with
the saver's own (bench/save_during_drain.py). A buffer here is an anonymous mapping populated
once by the kernel (``MAP_POPULATE``: no GIL held, no fault later) and filled by ``preadv``
(the GIL released), then reused by the next chunk.

How many: a buffer is only taken by a worker holding a codec slot (``KNOBS.codec_threads``), so
at most that many exist at once; idle ones are kept while a drain is in flight and dropped by
:meth:`ChunkBuffers.trim` when the tier has none (the memory goes back between checkpoints).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

__all__ = ["ChunkBuffers"]


class ChunkBuffers:
    """A pool of pre-faulted anonymous buffers of at least a given size.

    ``created`` counts the buffers ever mapped (tests: reuse keeps it at the peak concurrency).
    """

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.created = 0

    @contextlib.contextmanager
    def take(self, size: int) -> Iterator[memoryview]:
        """A writable view of ``size`` bytes, this caller's alone until the block ends. The caller
        must keep no reference to it (nor to a numpy array over it) past the block: the next
        chunk overwrites it."""
        with self._lock:
            buf = next((b for b in self._free if len(b) >= size), None)
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            with self._lock:
                self.created += 1
        view = memoryview(buf)[:size]
        try:
            yield view
        finally:
            try:
                view.release()
            except BufferError:  # still exported (a caller kept an array over it): never handed out again
                buf = None
            if buf is not None:
                with self._lock:
                    self._free.append(buf)

    def idle(self) -> int:
        """Buffers mapped and not in use."""
        with self._lock:
            return len(self._free)

    def trim(self) -> None:
        """Unmap the idle buffers (no drain in flight)."""
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            with contextlib.suppress(BufferError):  # a stray view still exported: the GC unmaps it later
                buf.close()


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
