"""Data files shared by several names in the local dir (unchanged shards), counted by inode.

A save may declare shards unchanged since an earlier step of the same rank (``BeginSave``
``unchanged``), and a replica may hold shards byte-identical to a copy the receiver already has:
the store then hard-links the committed file of that step into the new save's staging area
instead of staging a new file. Several names (committed ranks, open saves) hold the inode.

The reference count is the inode's link count; this table mirrors it in memory for the
capacity accounting: a shared inode is charged once, here (not in the manifests that name it),
and its bytes are credited only when its last holder goes. Invariants:

- A file with more than one link is never recycled nor written in place: the recycle pool
  refuses it (:meth:`.recycle.RecyclePool.release` unlinks the name only; taking a pooled file
  requires one link), and a committed path that was ever shared is dropped from the set of
  recyclable files (loans count readers per path, so the other name could not see them).
- Holders are committed files ``(job, step, rank, file)`` and open saves' staging files
  ``("staging", save_id, shard)``.

Not thread-safe by itself: the local store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Hashable

from .retention import charge_file

__all__ = ["Links", "Ino"]

Ino = tuple[int, int]
"""(st_dev, st_ino) of a file."""


class Links:
    """Holders per shared inode, and the bytes charged for those inodes."""

    def __init__(self) -> None:
        self._holders: dict[Ino, set[Hashable]] = {}
        self._of: dict[Hashable, tuple[Ino, int]] = {}
        self.charged = 0  # charged bytes of the shared inodes (each once)
        self.data_bytes = 0

    def holds(self, holder: Hashable) -> bool:
        return holder in self._of

    def hold(self, ino: Ino, holder: Hashable, size: int) -> None:
        """``holder`` names inode ``ino`` of ``size`` bytes (charged here when it is the first)."""
        if holder in self._of:
            return
        holders = self._holders.setdefault(ino, set())
        if not holders:
            self.charged += charge_file(size)
            self.data_bytes += size
        holders.add(holder)
        self._of[holder] = (ino, size)

    def drop(self, holder: Hashable) -> None:
        """``holder`` no longer names its inode; the last one's going credits the inode's bytes."""
        entry = self._of.pop(holder, None)
        if entry is None:
            return
        ino, size = entry
        holders = self._holders[ino]
        holders.discard(holder)
        if not holders:
            del self._holders[ino]
            self.charged -= charge_file(size)
            self.data_bytes -= size

    def others(self, holder: Hashable) -> int:
        """How many other holders name the inode ``holder`` names (0: not shared, or only it)."""
        entry = self._of.get(holder)
        return 0 if entry is None else len(self._holders[entry[0]]) - 1
