"""A rank's bytes as one range: its shards concatenated in manifest order (what parity cuts
into chunks). Reading from committed shards, writing into a staging area's files."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator

from tierckpt.errors import DataLossError

from ..local.manifest import Manifest

__all__ = ["PIECE", "spans", "read_range", "write_range"]

PIECE = 4 << 20
"""Bytes per streamed piece (below the default 16 MiB gRPC message limit, `max_message_bytes`)."""


def spans(man: Manifest, offset: int, length: int) -> Iterator[tuple[str, int, int, int]]:
    """(shard, offset in the shard, length, offset in the range) of each shard overlapping
    ``[offset, offset + length)`` of the rank's concatenated bytes."""
    pos, end = 0, offset + length
    for s in man.shards:
        lo, hi = max(offset, pos), min(end, pos + s.size)
        if lo < hi:
            yield s.name, lo - pos, hi - lo, lo - offset
        pos += s.size


def read_range(open_shard: Callable[[str], int], man: Manifest, offset: int, length: int,
               piece: int = PIECE) -> Generator[bytes, None, None]:
    """The bytes ``[offset, offset + length)`` of a committed rank, ``piece`` at a time
    (``open_shard(name)`` returns a read-only fd the caller closes)."""
    for name, start, count, _ in spans(man, offset, length):
        fd = open_shard(name)
        at, left = start, count
        try:
            while left > 0:
                b = os.pread(fd, min(piece, left), at)
                if not b:
                    raise DataLossError(f"{man.job} step {man.step} rank {man.rank}/{name} is shorter than its "
                                        "manifest")
                yield b
                at += len(b)
                left -= len(b)
        finally:
            os.close(fd)


def write_range(open_staged: Callable[[str], int], man: Manifest, offset: int, data) -> None:
    """Write ``data`` at ``offset`` of the rank's concatenated bytes into its staged shard files
    (``open_staged(name)`` returns a writable fd the caller closes)."""
    mv = memoryview(data).cast("B")
    for name, at, n, rel in spans(man, offset, len(mv)):
        fd = open_staged(name)
        try:
            done = 0
            while done < n:
                done += os.pwrite(fd, mv[rel + done:rel + n], at + done)
        finally:
            os.close(fd)
