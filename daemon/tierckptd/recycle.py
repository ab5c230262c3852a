"""The recycle pool: data files of evicted steps, kept for reuse by same-size shards.

First-touch page faults make writing a fresh tmpfs file 3-5x slower than overwriting one whose
pages exist. Data files of evicted steps move to ``recycle/<size>.<id>`` and a later save with
a shard of exactly the same size reuses one. Files ever handed to a reader (restore maps them)
are never recycled, since a reader's mapping would see the new bytes; after a restart every
file counts as lent (the pool starts empty and nothing is recyclable).

Not thread-safe by itself: the local store calls it under its lock.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Iterable

__all__ = ["RecyclePool"]


class RecyclePool:
    """Evicted files by size, and the set of committed files that may join the pool.

    Args:
        directory: the pool's directory (``<local_dir>/recycle``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._by_size: dict[int, list[Path]] = {}
        self._recyclable: set[Path] = set()
        self.bytes = 0

    # -- which committed files may be recycled

    def mark_recyclable(self, path: Path) -> None:
        """A freshly committed file that no reader has mapped yet."""
        self._recyclable.add(path)

    def lent(self, paths: Iterable[Path]) -> None:
        """Files handed to a reader: never recycled afterwards."""
        self._recyclable.difference_update(paths)

    # -- the pool

    def release(self, path: Path, size: int) -> None:
        """A committed file is no longer needed: move it into the pool if it may be reused, else remove it."""
        if path in self._recyclable and size > 0:
            self._recyclable.discard(path)
            target = self.directory / f"{size}.{secrets.token_hex(6)}"
            try:
                os.rename(path, target)
            except OSError:
                path.unlink(missing_ok=True)
                return
            self._by_size.setdefault(size, []).append(target)
            self.bytes += size
        else:
            self._recyclable.discard(path)
            path.unlink(missing_ok=True)

    def take(self, size: int) -> Path | None:
        """A pooled file of exactly ``size`` bytes (now the caller's), or None."""
        pool = self._by_size.get(size)
        if not pool or size <= 0:
            return None
        path = pool.pop()
        self.bytes -= size
        return path

    def drop(self, need: int) -> None:
        """Remove pooled files, largest first, until ``need`` bytes are freed (or the pool is empty)."""
        for size in sorted(self._by_size, reverse=True):
            pool = self._by_size[size]
            while pool and need > 0:
                pool.pop().unlink(missing_ok=True)
                self.bytes -= size
                need -= size
        self._by_size = {k: v for k, v in self._by_size.items() if v}

    def clear_directory(self) -> None:
        """Start-up: files left in the pool by a previous run are removed."""
        for entry in self.directory.iterdir():
            entry.unlink(missing_ok=True)
