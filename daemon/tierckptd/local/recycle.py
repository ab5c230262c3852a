"""The recycle pool: data files of evicted steps, kept for reuse by same-size shards.

First-touch page faults make writing a fresh tmpfs file 3-5x slower than overwriting one whose
pages exist. Data files of evicted steps move to ``recycle/<size>.<id>`` and a later save with
a shard of exactly the same size reuses one.

Readers: a restore on the node maps the committed files (copy-on-write; a page it never wrote
shows the file's current bytes), so a file must not be rewritten while any reader maps it. Each
Restore that hands out paths is a *loan* (:meth:`RecyclePool.lend`), ended by the client's
Release (:meth:`RecyclePool.unlend`); a file counts its open loans. A file evicted while lent is
moved to the pool directory but *held*: it joins the pool only when its last loan ends. Held
files are charged like pooled ones and are dropped first when room is needed (unlinking never
changes what a reader's map shows), so a client that dies without releasing costs at most
those pages until the next make-room. After a restart every file counts as lent forever (the
pool starts empty and nothing committed before is recyclable).

A pooled file is handed out again only after a check on the open file: a regular file with one
link and exactly the expected size (someone with write access to the local dir may have swapped
it for a symlink or a hard link meanwhile); anything else is discarded.

Warm files (:mod:`.warm`): pre-allocated files the store adds to the pool ahead of need
(:meth:`RecyclePool.add_warm`), charged, taken and dropped exactly like recycled ones.

Not thread-safe by itself: the local store calls it under its lock.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from .localfs import STAGING_MODE, LocalDir, UnsafeFileError

__all__ = ["RecyclePool", "RECYCLE_DIR"]

log = logging.getLogger(__name__)

RECYCLE_DIR = ("recycle",)


class RecyclePool:
    """Evicted files by size, and the set of committed files that may join the pool.

    Args:
        fs: the local dir (the pool lives in ``recycle/``).
        charge: bytes charged against capacity for a file of a given size.
    """

    def __init__(self, fs: LocalDir, charge: Callable[[int], int] = lambda n: n) -> None:
        self.fs = fs
        self._charge = charge
        self._by_size: dict[int, list[str]] = {}
        self._recyclable: set[Path] = set()
        self._readers: dict[Path, int] = {}  # open loans per recyclable file
        self._loans: dict[tuple, tuple[tuple[Path, ...], int]] = {}  # key -> (counted files, open loans)
        self._held: dict[Path, tuple[str, int]] = {}  # evicted while lent: pool name, size
        self._warm: dict[str, int] = {}  # untaken warm files: pool name -> size
        self._touched: set[str] = set()  # the warm files whose every page was touched (written)
        self.bytes = 0  # charged bytes of the pooled files
        self.data_bytes = 0
        self.warm_bytes = 0  # data bytes of the untaken warm files (a part of data_bytes)
        self.warm_taken = 0  # warm files handed to saves
        # Where an evicted file goes first while it wants it (the reserve, see :mod:`.reserve`):
        # sink(dir_fd, name, size) -> moved; not while ``sink_paused`` (a save making room).
        self.sink: Callable[[int, str, int], bool] | None = None
        self.sink_paused = False

    # -- which committed files may be recycled

    def mark_recyclable(self, path: Path) -> None:
        """A freshly committed file that no reader has mapped yet."""
        self._recyclable.add(path)

    def forget(self, path: Path) -> None:
        """A committed file that another name now shares (see :mod:`.links`): never recycled."""
        self._recyclable.discard(path)

    def lend(self, key: tuple, paths: Iterable[Path]) -> None:
        """One more reader maps ``paths`` (the files of loan ``key``: one committed copy)."""
        counted, n = self._loans.get(key, ((), 0))
        if not n:
            counted = tuple(p for p in paths if p in self._recyclable)
        for p in counted:
            self._readers[p] = self._readers.get(p, 0) + 1
        self._loans[key] = (counted, n + 1)

    def unlend(self, key: tuple) -> bool:
        """A reader of loan ``key`` unmapped its files; a held file whose last loan ended joins the
        pool. Returns False when no loan of ``key`` is open."""
        counted, n = self._loans.get(key, ((), 0))
        if not n:
            return False
        if n == 1:
            del self._loans[key]
        else:
            self._loans[key] = (counted, n - 1)
        for p in counted:
            left = self._readers.get(p, 0) - 1
            if left > 0:
                self._readers[p] = left
                continue
            self._readers.pop(p, None)
            held = self._held.pop(p, None)
            if held is not None:
                self._by_size.setdefault(held[1], []).append(held[0])
        return True

    @property
    def loans(self) -> int:
        return sum(n for _, n in self._loans.values())

    # -- the pool

    def release(self, dir_fd: int, name: str, path: Path, size: int) -> None:
        """A committed file (entry ``name`` of ``dir_fd``, known as ``path``) is no longer needed:
        move it into the pool if it may be reused, else remove it. A file with another link
        (shared by another step, see :mod:`.links`) is never pooled: only this name goes."""
        if path in self._recyclable and size > 0 and self._single_link(dir_fd, name):
            self._recyclable.discard(path)
            if (self.sink is not None and not self.sink_paused and not self._readers.get(path)
                    and self.sink(dir_fd, name, size)):
                return
            target = f"{size}.{secrets.token_hex(6)}"
            try:
                with self.fs.dir(RECYCLE_DIR) as rfd:
                    os.rename(name, target, src_dir_fd=dir_fd, dst_dir_fd=rfd)
            except OSError:
                self.fs.unlink(dir_fd, name)
                return
            if self._readers.get(path):
                self._held[path] = (target, size)  # joins the pool when its last reader releases it
            else:
                self._by_size.setdefault(size, []).append(target)
            self.bytes += self._charge(size)
            self.data_bytes += size
        else:
            self._recyclable.discard(path)
            self.fs.unlink(dir_fd, name)

    @staticmethod
    def _single_link(dir_fd: int, name: str) -> bool:
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_nlink == 1
        except OSError:
            return False

    def take(self, size: int) -> tuple[str, bool] | None:
        """Name (in ``recycle/``) of a pooled file of exactly ``size`` bytes, now the caller's, and
        whether it is a warm file whose pages are allocated but were not all touched (its writer
        should pwrite it, not write through a map: see :mod:`.warm`); or None."""
        pool = self._by_size.get(size)
        if not pool or size <= 0:
            return None
        name = pool.pop()
        self.bytes -= self._charge(size)
        self.data_bytes -= size
        touched = name in self._touched
        warm = self._forget_warm(name)
        if warm:
            self.warm_taken += 1
        return name, warm and not touched

    def untake(self, name: str, size: int) -> None:
        """Give back a file :meth:`take` handed out and the caller did not use (it is still in the pool dir)."""
        self._by_size.setdefault(size, []).append(name)
        self.bytes += self._charge(size)
        self.data_bytes += size

    # -- warm files

    def add_warm(self, size: int) -> tuple[int, str]:
        """Create a ``size``-byte file (not yet allocated) in the pool; returns a read-write
        descriptor (the caller closes it) and its pool name."""
        name = f"{size}.{secrets.token_hex(6)}"
        with self.fs.dir(RECYCLE_DIR) as rfd:
            fd = self.fs.create(rfd, name, size)
        self._by_size.setdefault(size, []).append(name)
        self._warm[name] = size
        self.bytes += self._charge(size)
        self.data_bytes += size
        self.warm_bytes += size
        return fd, name

    def mark_touched(self, name: str) -> None:
        """Every page of warm file ``name`` was written (see :func:`.warm.touch_pages`): when taken,
        it is reported as faulted in, like a recycled file. Ignored once it was taken."""
        if name in self._warm:
            self._touched.add(name)

    def is_warm(self, name: str) -> bool:
        """Whether ``name`` is a warm file still in the pool (safe to ask without the lock)."""
        return name in self._warm

    def counts(self) -> dict[int, int]:
        """Pooled files per size (held files excluded: they may never join)."""
        return {size: len(names) for size, names in self._by_size.items()}

    def _forget_warm(self, name: str) -> bool:
        self._touched.discard(name)
        size = self._warm.pop(name, None)
        if size is None:
            return False
        self.warm_bytes -= size
        return True

    def move_out(self, name: str, size: int, dst_fd: int, dst_name: str) -> bool:
        """Move taken file ``name`` to ``dst_name`` in ``dst_fd`` if it is still a regular file with
        one link and ``size`` bytes. Otherwise it is discarded and False is returned."""
        with self.fs.dir(RECYCLE_DIR) as rfd:
            try:
                fd = self.fs.open_regular(rfd, name, os.O_RDONLY, f"recycled file {name}", size=size,
                                          single_link=True)
            except FileNotFoundError:
                return False
            except UnsafeFileError as e:
                log.error("discarding recycled file: %s", e)
                self.fs.remove_tree(rfd, name)
                return False
            try:
                os.fchmod(fd, STAGING_MODE)  # a staging file again: the socket group writes it
                st = os.fstat(fd)
                os.rename(name, dst_name, src_dir_fd=rfd, dst_dir_fd=dst_fd)
            finally:
                os.close(fd)
        if not self.fs.same_file(dst_fd, dst_name, st):  # swapped between the check and the rename
            log.error("discarding recycled file %s: replaced while being reused", name)
            self.fs.remove_tree(dst_fd, dst_name)
            return False
        return True

    def discard(self, names: Iterable[str]) -> None:
        """Remove taken files that were not moved out."""
        with self.fs.dir(RECYCLE_DIR) as rfd:
            for name in names:
                self.fs.remove_tree(rfd, name)

    def drop(self, need: int) -> None:
        """Remove pooled files, held ones first, then largest first, until ``need`` charged bytes are
        freed (or the pool is empty). A held file's readers keep their maps (unlinking never
        changes the mapped pages); it just never joins the pool."""
        if need <= 0 or not (self._by_size or self._held):
            return
        with self.fs.dir(RECYCLE_DIR) as rfd:
            for path in list(self._held):
                if need <= 0:
                    break
                name, size = self._held.pop(path)
                self.fs.remove_tree(rfd, name)
                self.bytes -= self._charge(size)
                self.data_bytes -= size
                need -= self._charge(size)
            for size in sorted(self._by_size, reverse=True):
                pool = self._by_size[size]
                while pool and need > 0:
                    name = pool.pop()
                    self._forget_warm(name)
                    self.fs.remove_tree(rfd, name)
                    self.bytes -= self._charge(size)
                    self.data_bytes -= size
                    need -= self._charge(size)
        self._by_size = {k: v for k, v in self._by_size.items() if v}

    def clear_directory(self) -> None:
        """Start-up: files left in the pool by a previous run are removed (links as links)."""
        with self.fs.dir(RECYCLE_DIR, create=True) as rfd:
            for name, _kind in self.fs.entries(rfd):
                self.fs.remove_tree(rfd, name)
