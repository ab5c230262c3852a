"""A ``bp*`` chunk (:mod:`.compress`) encoded as it is read: :class:`PlaneWriter`.

Issue 28 item 3: a drain slows saves on the same node mostly through memory bandwidth (its CPU is
at ``SCHED_IDLE``), so what counts is how many times each drained byte goes through memory. A
drain worker (:mod:`.chunkproc`) reads a chunk a cache-sized piece at a time. Here each piece,
still in the core's cache, is split into its byte planes (libblosc2's shuffle into a small buffer)
and each piece-plane is copied to where that plane lies in the stored form, in the daemon's shared
output buffer. The stored form is laid out as if every plane were stored raw: ``tag``, then per
plane its mode byte, length and bytes, then the tail. Once every piece is in (and the chunk's hash
checked by the caller), each plane is coded where it lies; a plane stored raw that no earlier
plane shrank before it does not move at all (the mantissa planes, the bulk of a float chunk),
a coded one is written over its own raw bytes, and a raw one after a shrunk plane moves down.

So a chunk is read from the page cache once and written to the output once, plus the coder's
own pass over the planes it codes; against: read into a chunk buffer, split into a plane buffer,
join the parts, copy into the output. The stored bytes are exactly :func:`.compress.encode`'s
(tests/persistent/test_chunkproc.py); a chunk that does not shrink is merged back and stored raw,
as there.
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import byteshuffle
from .compress import _PACKED, _RAW, _pack_plane

__all__ = ["PlaneWriter", "WIDTHS", "slack"]

WIDTHS = {"bp2-zstd": 2, "bp4-zstd": 4}
"""The codecs encoded here, and their element widths."""


def slack(width: int) -> int:
    """Bytes beyond ``size + 1`` that the raw layout of a chunk needs in the output buffer."""
    return 5 * width


class PlaneWriter:
    """Fills ``out`` with the byte planes of a ``size``-byte chunk piece by piece (:meth:`put`,
    in order, every piece but the last a whole number of elements), then codes them in place
    (:meth:`finish`).

    Args:
        width: bytes per element (2 or 4).
        size: the chunk's plain bytes.
        out: a writable buffer of at least ``size + 1 + slack(width)`` bytes (a drain worker's
            shared output buffer; the stored form is at most ``size + 1``).

    Raises:
        ValueError: ``out`` is too short, or libblosc2's shuffle is not available (the caller
            encodes the chunk whole instead).
    """

    def __init__(self, width: int, size: int, out: Any) -> None:
        import numpy as np

        lib = byteshuffle.native()
        if lib is None or not 0 < size <= byteshuffle.MAX:
            raise ValueError("byte planes are split piece by piece only with libblosc2")
        self.shuffle = lib[0]
        self.width, self.size, self.count = width, size, size // width
        self.dst = memoryview(out).cast("B")
        if len(self.dst) < size + 1 + slack(width):
            raise ValueError(f"an output buffer of {len(self.dst)} bytes for the planes of a chunk of {size}")
        self.base = np.frombuffer(self.dst, np.uint8).ctypes.data
        self.done = 0
        self.tmp: Any = None

    def start(self, k: int) -> int:
        """Where plane ``k`` lies in the raw layout, after its mode and length (``k == width``:
        the tail, which has neither)."""
        return 1 + k * (5 + self.count) + (5 if k < self.width else 0)

    def put(self, piece: Any) -> None:
        """The next ``len(piece)`` plain bytes of the chunk (the piece may be reused afterwards)."""
        import numpy as np

        src = np.frombuffer(piece, np.uint8)
        n, width = len(src), self.width
        if self.done + n > self.size or (n % width and self.done + n != self.size):
            raise ValueError(f"a piece of {n} bytes at {self.done} of a {self.size}-byte chunk (whole elements "
                             "but at the chunk's end)")
        if self.tmp is None or len(self.tmp) < n:
            self.tmp = np.empty(n, np.uint8)
        whole = n - n % width
        if whole:
            if self.shuffle(width, whole, src.ctypes.data, self.tmp.ctypes.data) != whole:
                raise ValueError(f"blosc2_shuffle failed on {whole} bytes of width {width}")
            m, at = whole // width, self.done // width
            for k in range(width):
                ctypes.memmove(self.base + self.start(k) + at, self.tmp.ctypes.data + k * m, m)
        if n > whole:  # the chunk's tail (the last piece): bytes after the last whole element
            self.dst[self.start(width):self.start(width) + n - whole] = src[whole:].data
        self.done += n

    def finish(self) -> int:
        """Code every plane where it lies; the stored form's length (at the start of ``out``).

        Raises:
            ValueError: fewer bytes were put than the chunk has.
        """
        if self.done != self.size:
            raise ValueError(f"{self.done} bytes of a {self.size}-byte chunk were put")
        width, count, dst = self.width, self.count, self.dst
        tail = self.size - count * width
        planes = [dst[self.start(k):self.start(k) + count] for k in range(width)]
        coded = [_pack_plane(plane) for plane in planes]  # [mode, length, body] each
        if sum(5 + len(body) for _, _, body in coded) + tail >= self.size:  # nothing to gain: stored raw
            plain = byteshuffle.merge(planes, dst[self.start(width):self.start(width) + tail], width)
            dst[0:1] = _RAW
            dst[1:self.size + 1] = plain
            return self.size + 1
        dst[0:1], pos = _PACKED, 1
        for k, (mode, length, body) in enumerate(coded):  # pos <= the plane's raw place: nothing unread is overwritten
            dst[pos:pos + 1], dst[pos + 1:pos + 5] = mode, length
            pos += 5
            if mode == _RAW:
                if pos != self.start(k):
                    ctypes.memmove(self.base + pos, self.base + self.start(k), count)
            else:
                dst[pos:pos + len(body)] = body
            pos += len(body)
        if tail and pos != self.start(width):
            ctypes.memmove(self.base + pos, self.base + self.start(width), tail)
        return pos + tail
