"""The local store's commit path: check an open save, place its files, publish the manifest last.

See :mod:`.store` for the commit protocol. The file steps are :class:`.layout.StoreLayout`'s;
this module orders them against the open saves (:mod:`.saves`) and the catalog, under the
store's lock where the catalog changes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from tierckpt.common.names import MAX_METADATA_BYTES
from tierckpt.errors import FailedPreconditionError, InvalidArgumentError

from ..knobs import KNOBS
from .eviction import charge
from .index import Catalog
from .links import shared_digests
from .localfs import UnsafeFileError
from .manifest import Manifest, ShardEntry
from .paths import StoreLayout
from .recycle import RecyclePool
from .rules import Eviction
from .saves import OpenSaves
from .staging import Staging

__all__ = ["Committer"]


def _check_digests(save_id: str, files: Iterable[str], digests: dict[str, str], metadata_json: str,
                   max_metadata: int) -> None:
    size = len(metadata_json.encode("utf-8", "surrogatepass"))
    if size > min(max_metadata, MAX_METADATA_BYTES):
        raise InvalidArgumentError(f"metadata: {size} bytes exceed max_metadata_bytes "
                                   f"({min(max_metadata, MAX_METADATA_BYTES)})")
    missing = set(files) - set(digests)
    extra = set(digests) - set(files)
    if missing or extra:
        raise InvalidArgumentError(f"digests: missing {sorted(missing)} / unknown {sorted(extra)} for save {save_id}")
    for name, d in digests.items():
        if not isinstance(d, str) or len(d) != 16 or any(c not in "0123456789abcdef" for c in d):
            raise InvalidArgumentError(f"digests[{name}].checksum: {d!r} is not 16 lowercase hex digits")


class Committer:
    """Publishes open saves of one local store (see :meth:`.store.LocalStore.commit`).

    Args:
        lock: the store's lock (guards ``saves``, ``catalog`` and ``recycle``).
        retain_locked: applies the job's retention after a publish (called with ``lock`` held).
    """

    def __init__(self, lock: threading.RLock, saves: OpenSaves, layout: StoreLayout, catalog: Catalog,
                 recycle: RecyclePool, retain_locked: Callable[[str], list[Eviction]],
                 max_metadata: int = MAX_METADATA_BYTES) -> None:
        self.max_metadata = max_metadata
        self._lock = lock
        self._saves = saves
        self._layout = layout
        self._catalog = catalog
        self._recycle = recycle
        self._retain_locked = retain_locked

    def commit(self, st: Staging, digests: dict[str, str], metadata_json: str, *, persist: bool, verify: bool,
               node: str, generation: str | None, created: float | None, pin: str | None,
               fsync: bool) -> tuple[Manifest, list[Eviction]]:
        """Check ``st``, move its files into place and write the manifest last (see
        :meth:`.store.LocalStore.commit` for the arguments). Returns the manifest and the
        evictions retention made afterwards (not yet notified)."""
        digests = shared_digests(st, digests)
        _check_digests(st.save_id, st.files, digests, metadata_json, self.max_metadata)
        man = Manifest(
            job=st.job, step=st.step, rank=st.rank, world_size=st.world_size,
            node=node, generation=generation or st.save_id,
            shards=tuple(ShardEntry(f.name, f.size, digests[f.name], f.dtype, f.shape, f"{f.name}.{st.save_id}")
                         for f in st.files.values()),
            metadata_json=metadata_json, created=created if created is not None else time.time(), persist=persist,
            job_owner=st.job_owner,
        )
        self._saves.charge_manifest(st, man.stored_bytes)  # metadata counts against the capacity
        stats = self._saves.check_staged(st, digests, verify=verify or st.stream, fsync=fsync)
        self._saves.take_for_commit(st)
        tmp = self.place(st, man, stats, fsync)
        if KNOBS.debug_commit_delay:  # test hook: the data files are in place, the manifest is not
            time.sleep(KNOBS.debug_commit_delay)
        with self._lock:
            self._saves.committed_locked(st)
            evictions = self._publish_locked(st, man, tmp, pin)
        if fsync:
            self._layout.fsync_rank(st.job, st.step, st.rank)
        return man, evictions

    def place(self, st: Staging, man: Manifest, stats: dict[str, os.stat_result], fsync: bool) -> str:
        """Rename the staged files into the rank directory and write the manifest under a temporary name."""
        try:
            return self._layout.place(st, man, stats, fsync=fsync)
        except BaseException as e:
            with self._lock:
                self._saves.committed_locked(st)
            if isinstance(e, OSError):
                self._layout.remove_staging(st.save_id)
                self._layout.unplace(st)
            if isinstance(e, UnsafeFileError):
                raise FailedPreconditionError(f"shards: {e.strerror}; the save is refused") from None
            raise
        finally:
            self._layout.remove_staging(st.save_id, only_if_empty=True)

    def _publish_locked(self, st: Staging, man: Manifest, tmp: str, pin: str | None) -> list[Eviction]:
        # The manifest goes into place in the critical section that updates the catalog, so
        # overlapping commits of one rank (and evictions) change disk and catalog in one order.
        try:
            self._layout.publish(st, tmp)
        except OSError:
            self._layout.unplace(st, tmp)
            raise
        shared = {f"{f.name}.{st.save_id}": f.ino for f in st.files.values() if f.shared and f.ino}
        old = self._catalog.add(man, charge(man), shared)
        for s in man.shards:
            if s.file not in shared:
                self._recycle.mark_recyclable(self._layout.shard_path(man, s.name))
        if old is not None:
            self._catalog.uncharge(old, charge(old))
            self._layout.remove_rank_files(old, keep_manifest=True)
        if pin:
            self._catalog.pin(st.job, st.step, pin)
        return self._retain_locked(st.job)
