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

from collections.abc import Callable, Collection, Hashable, Mapping
from typing import TYPE_CHECKING

from tierckpt.errors import InvalidArgumentError

from .manifest import Manifest, ShardEntry
from .rules import charge_file
from .staging import StagedFile, Staging

if TYPE_CHECKING:
    from .index import Catalog

__all__ = ["Links", "Ino", "share_fn", "share_sources_locked", "shared_digests"]

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


def _same_bytes(base: Manifest, f: StagedFile, checksums: Mapping[str, str] | None) -> ShardEntry | None:
    """``base``'s entry for ``f`` if it has the same name, size, dtype, shape (and checksum, when given)."""
    try:
        entry = base.shard(f.name)
    except KeyError:
        return None
    if (entry.size, entry.dtype, tuple(entry.shape)) != (f.size, f.dtype, f.shape):
        return None
    if checksums is not None and checksums.get(f.name) != entry.checksum:
        return None
    return entry


def share_sources_locked(catalog: Catalog, st: Staging, wanted: frozenset[str], base_step: int | None,
                         checksums: Mapping[str, str] | None,
                         generation: str | None = None) -> dict[str, tuple[Manifest, ShardEntry]]:
    """The committed files (see :meth:`.store.LocalStore.begin`, ``unchanged``) holding shards of ``st``."""
    if base_step is not None:
        found = [catalog.get(st.job, base_step, st.rank)]
    else:  # an inbound replica: any copy of the rank held here, newest first
        steps = catalog.steps(st.job)
        found = [steps[s].get(st.rank) for s in sorted(steps, reverse=True)]
    bases = [m for m in found if m is not None and generation in (None, m.generation)]
    out: dict[str, tuple[Manifest, ShardEntry]] = {}
    for f in st.files.values():
        if f.name not in wanted or f.size <= 0:
            continue
        for base in bases:
            entry = _same_bytes(base, f, checksums)
            if entry is not None:
                out[f.name] = (base, entry)
                break
    return out


def share_fn(catalog: Catalog, unchanged: Collection[str], base_step: int | None,
             checksums: Mapping[str, str] | None, generation: str | None
             ) -> Callable[[Staging], dict[str, tuple[Manifest, ShardEntry]]] | None:
    """The ``share`` rule of :meth:`.saves.OpenSaves.begin` for a save's ``unchanged`` hint (called
    with the store's lock held), or None when the hint names no source."""
    if not (unchanged and (base_step is not None or checksums is not None)):
        return None
    wanted = frozenset(unchanged)

    def share(st: Staging) -> dict[str, tuple[Manifest, ShardEntry]]:
        return share_sources_locked(catalog, st, wanted, base_step, checksums, generation)

    return share


def shared_digests(st: Staging, digests: dict[str, str]) -> dict[str, str]:
    """The writer's digests plus the kept checksum of each shared file (the writer sent none,
    or the same one)."""
    out = dict(digests)
    for f in st.files.values():
        if not f.shared:
            continue
        given = out.setdefault(f.name, f.checksum)
        if given != f.checksum:
            raise InvalidArgumentError(f"digests[{f.name}].checksum: {given!r}, but the shard shares a committed "
                                       f"file whose checksum is {f.checksum}")
    return out
