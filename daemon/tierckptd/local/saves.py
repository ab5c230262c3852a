"""Saves in flight on the local tier: begun (staging files created), not yet committed.

:class:`OpenSaves` owns the open saves and their staging files: reserving capacity (through the
store's eviction callback), recycled files, the open-save limit, superseding an older save of
the same rank, streamed writes, abort and reclaim. It shares the store's lock; methods whose
name ends in ``_locked`` expect the caller to hold it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from tierckpt.common.fileio import pwrite_all
from tierckpt.common.names import MAX_SHARDS_PER_RANK, check_job, check_rank, check_step
from tierckpt.errors import (
    AbortedError,
    CapacityError,
    FailedPreconditionError,
    InvalidArgumentError,
)

from .eviction import charge
from .index import Catalog, check_job_owner
from .localfs import LocalDir
from .manifest import Manifest, ShardEntry
from .paths import StoreLayout
from .recycle import RecyclePool
from .rules import charge_file
from .staging import ShardSpec, StagedFile, Staging, check_specs

__all__ = ["OpenSaves", "ShareFn"]

ShareFn = Callable[[Staging], dict[str, tuple[Manifest, ShardEntry]]]
"""Under the lock: the committed files holding the bytes of some of a save's shards (see
:meth:`.store.LocalStore.begin`, ``unchanged``)."""

log = logging.getLogger(__name__)

_SAVE_ID = re.compile(r"[0-9a-f]{16}")


def _vanished(save_id: str, err: Exception, still_open: bool) -> Exception:
    """What a missing staging file means: AbortedError when the save is no longer open (a newer
    save of the rank superseded it, or it was aborted or expired), else ``err`` itself."""
    if not still_open:
        return AbortedError(f"save_id: {save_id!r} was superseded by a newer save of the rank, aborted or "
                            f"expired while in use ({err})")
    return err


def _check_owner(staging: Staging, catalog: Catalog, open_saves: Iterable[Staging]) -> None:
    """A job belongs to the identity that first saved it (DESIGN.md, trust model): a save or an
    inbound copy for another owner of a job held or being saved here is refused."""
    owners = catalog.owners(staging.job)
    owners.update(st.job_owner for st in open_saves if st.job == staging.job and not st.inbound)
    check_job_owner(staging.job, owners, staging.job_owner, "copy" if staging.inbound else "save")


class BusyWatch:
    """Listeners told (under the store's lock) when ``busy()`` changes: a save opened here, or the
    last one left (the drain's pause, :mod:`tierckptd.persistent.pause`)."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self._busy = busy
        self._was = False
        self.listeners: list[Callable[[bool], None]] = []

    def changed_locked(self) -> None:
        """Tell every listener if ``busy()`` changed since the last call (the store's lock held)."""
        busy = self._busy()
        if busy != self._was:
            self._was = busy
            for fn in self.listeners:
                fn(busy)


class OpenSaves:
    """Args:
        lock: the store's lock (guards this state together with the catalog).
        make_room: ``make_room(bytes, evictable, job)`` under the lock: evict what may be evicted
            (the reserving job's own steps and steps safe in another tier, of the jobs
            ``evictable`` accepts; None: any), or raise CapacityError.
        catalog: the committed ranks (shared files are counted there, see :mod:`.links`).
    """

    def __init__(self, lock: threading.RLock, fs: LocalDir, layout: StoreLayout, recycle: RecyclePool,
                 make_room: Callable[[int, Callable[[str], bool] | None, str], None], *, max_open_saves: int,
                 max_shard_bytes: int, counters: dict[str, int], catalog: Catalog,
                 max_shards: int = MAX_SHARDS_PER_RANK) -> None:
        self._lock, self._fs, self._layout, self._recycle = lock, fs, layout, recycle
        self._catalog = catalog
        self._make_room = make_room
        self.max_open_saves, self.max_shard_bytes, self.counters = max_open_saves, max_shard_bytes, counters
        self.max_shards = max_shards
        self._open: dict[str, Staging] = {}
        self._by_key: dict[tuple[str, int, int], str] = {}
        self.last_begin = time.monotonic()
        self.committing_bytes = 0  # saves between leaving the open ones and entering the catalog (charged)
        self.committing_data = 0  # the same saves' shard bytes
        self.watch = BusyWatch(self.busy)

    def begin(self, job: str, step: int, rank: int, world_size: int, specs: Sequence[ShardSpec], *,
              stream: bool = False, prefault: Callable[[int, int], None] | None = None,
              evictable: Callable[[str], bool] | None = None, share: ShareFn | None = None,
              inbound: bool = False, job_owner: str = "") -> Staging:
        """Reserve capacity and create sized staging files (see :meth:`LocalStore.begin`).

        ``prefault(fd, size)``: takes each freshly created (not recycled) staging file, to
        allocate its pages ahead of the writer. ``share``: committed files to link instead of
        staging new ones."""
        check_job(job)
        check_step(step)
        check_rank(rank, world_size)
        check_specs(specs, self.max_shard_bytes, self.max_shards)
        save_id = secrets.token_hex(8)  # the form _SAVE_ID checks
        sdir = self._fs.path(StoreLayout.staging_rel(save_id))
        staging = Staging(save_id=save_id, job=job, step=step, rank=rank, world_size=world_size,
                          files={}, dir=sdir, stream=stream, evictable=evictable, inbound=inbound,
                          job_owner=job_owner)
        for name, size, dtype, shape in specs:
            staging.files[name] = StagedFile(name, size, sdir / name, dtype, tuple(int(d) for d in shape))
        with self._lock:
            reused = self._reserve_locked(staging, share)
        try:
            self._layout.create_staging(staging, reused, prefault)
        except OSError as e:
            superseded = not self.is_open(save_id)  # a newer save of the rank began meanwhile
            self.abort(save_id)
            self._recycle.discard(reused.values())  # taken from the pool (and its bytes) but not moved yet
            if staging.grant is not None and self._layout.reserve is not None:
                self._layout.reserve.discard(staging.grant)
            if e.errno == errno.ENOSPC:
                raise CapacityError(f"local_dir {self._fs.root} is full: {e.strerror}") from e
            if superseded:
                raise _vanished(save_id, e, self.is_open(save_id)) from None
            raise
        return staging

    def _reserve_locked(self, staging: Staging, share: ShareFn | None = None) -> dict[str, str]:
        """Supersede an older open save of the rank, bound open saves, link shared files, make
        room, take recycled files."""
        self.last_begin = time.monotonic()
        key = (staging.job, staging.step, staging.rank)
        _check_owner(staging, self._catalog, self._open.values())
        older = self._by_key.get(key)
        if older is not None and staging.inbound and not self._open[older].inbound:
            raise FailedPreconditionError(f"{key[0]} step {key[1]} rank {key[2]}: a trainer's save of this rank is "
                                          "open on this node; a copy never supersedes it")
        if older is not None:
            log.info("save %s of %s/%d/%d superseded by a new save; aborting it", older, *key)
            self.abort_locked(older)
        if len(self._open) >= self.max_open_saves:
            raise CapacityError(f"saves: {len(self._open)} saves are open on this node (limit {self.max_open_saves});"
                                " commit or abort some first")
        if share is not None:
            self._link_locked(staging, share(staging))
        try:
            return self._take_room_locked(staging, key)
        except BaseException:
            self._unshare_locked(staging)
            if share is not None:
                self._layout.remove_staging(staging.save_id)
            raise

    def _link_locked(self, staging: Staging, sources: dict[str, tuple[Manifest, ShardEntry]]) -> None:
        """Link the committed files ``sources`` names into the staging area (see :mod:`.links`)."""
        if not sources:
            return
        for name, ino in self._layout.link_shared(staging, sources).items():
            man, entry = sources[name]
            f = staging.files[name]
            f.shared, f.ino, f.checksum = True, ino, entry.checksum
            self._catalog.share(man, entry, ino, ("staging", staging.save_id, name))
            self._recycle.forget(self._layout.shard_path(man, entry.name))  # never recycled again

    def _unshare_locked(self, staging: Staging) -> None:
        for f in staging.files.values():
            if f.shared:
                self._catalog.links.drop(("staging", staging.save_id, f.name))

    def _take_room_locked(self, staging: Staging, key: tuple[str, int, int]) -> dict[str, str]:
        # Pooled files of the right sizes first: they become this save's, so room is made only for
        # the rest (making room first could drop the very files the save would reuse).
        # Then the reserve, for the rest (see :mod:`.reserve`): its charge is released before room is made.
        reused: dict[str, str] = {}
        for f in staging.files.values():
            taken = None if f.shared else self._recycle.take(f.size)
            if taken is not None:
                reused[f.name], f.warm = taken
        reserve = self._layout.reserve
        if reserve is not None:
            staging.grant = reserve.take_locked((f.name, f.size) for f in staging.files.values()
                                                if not f.shared and f.name not in reused)
        try:
            self._make_room(charge(staging), staging.evictable, staging.job)
        except BaseException:
            for shard, name in reused.items():
                self._recycle.untake(name, staging.files[shard].size)
            if staging.grant is not None and reserve is not None:
                reserve.untake_locked(staging.grant)
                staging.grant = None
            raise
        for shard in reused:
            staging.files[shard].recycled = True
        if staging.grant is not None:
            for shard, (_name, fsize) in staging.grant.whole.items():
                staging.files[shard].reserved = fsize >= staging.files[shard].size
        self._open[staging.save_id] = staging
        self._by_key[key] = staging.save_id
        self.watch.changed_locked()
        return reused

    def get(self, save_id: str) -> Staging:
        """The open save ``save_id``.

        Raises:
            InvalidArgumentError: ``save_id`` is not a save id (16 hex digits).
            AbortedError: it names no open save (aborted, superseded, expired or committed).
        """
        with self._lock:
            st = self._open.get(save_id)
        if st is None and not _SAVE_ID.fullmatch(save_id):
            raise InvalidArgumentError(f"save_id: {save_id[:40]!r} is not a save id (16 hex digits)")
        if st is None:
            raise AbortedError(f"save_id: {save_id!r} is not an open save (aborted, superseded, expired, "
                               "committed already or never begun)")
        return st

    def is_open(self, save_id: str) -> bool:
        """Whether ``save_id`` is an open save (begun, not yet committed, aborted or reclaimed)."""
        try:
            self.get(save_id)
        except AbortedError:
            return False
        return True

    def open_staged(self, save_id: str, shard: str, flags: int = os.O_WRONLY) -> int:
        """A descriptor of an open save's staging file (see :meth:`LocalStore.open_staged`)."""
        st = self.get(save_id)
        f = st.files.get(shard)
        if f is None:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of save {save_id}")
        try:
            return self._layout.open_staged(st, f, flags)
        except (FileNotFoundError, FailedPreconditionError) as e:
            raise _vanished(save_id, e, self.is_open(save_id)) from None

    def write_chunk(self, save_id: str, shard: str, offset: int, data: bytes | memoryview, fd_cache: dict) -> None:
        """Write streamed bytes into a staging file (stream transfers). ``fd_cache`` maps paths to fds."""
        st = self.get(save_id)
        f = st.files.get(shard)
        if f is None:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of save {save_id}")
        if offset + len(data) > f.size:
            raise InvalidArgumentError(f"offset: {offset}+{len(data)} exceeds shard {shard!r} size {f.size}")
        fd = fd_cache.get(f.path)
        if fd is None:
            try:
                fd = fd_cache[f.path] = self._layout.open_staged(st, f, os.O_WRONLY)
            except (FileNotFoundError, FailedPreconditionError) as e:
                raise _vanished(save_id, e, self.is_open(save_id)) from None
        pwrite_all(fd, memoryview(data), offset)
        f.written += len(data)

    def check_staged(self, st: Staging, digests: dict[str, str], *, verify: bool,
                     fsync: bool) -> dict[str, os.stat_result]:
        """Stream transfers must be whole; every file regular and of its size; with ``verify``,
        hashed. A save that fails is aborted. Returns each file's identity (see
        :meth:`.layout.StoreLayout.check_staged`)."""
        if st.stream:
            short = [f.name for f in st.files.values() if f.written < f.size and not f.shared]
            if short:
                self.abort(st.save_id)
                raise InvalidArgumentError(f"shard: {short} received fewer bytes than their declared size")
        try:
            return self._layout.check_staged(st, digests if verify else None, fsync=fsync)
        except (FileNotFoundError, FailedPreconditionError) as e:
            gone = _vanished(st.save_id, e, self.is_open(st.save_id))
            self.abort(st.save_id)
            raise gone from None
        except BaseException:
            self.abort(st.save_id)
            raise

    def charge_manifest(self, st: Staging, nbytes: int) -> None:
        """Charge the manifest the commit of ``st`` is about to write (``nbytes``, metadata
        included) instead of the minimum charged at begin, making room for the difference.

        Raises:
            AbortedError: ``st`` is no longer open.
            CapacityError: the manifest does not fit even after eviction (the save stays open).
        """
        with self._lock:
            if self._open.get(st.save_id) is not st:
                raise AbortedError(f"save_id: {st.save_id!r} was aborted or superseded")
            extra = charge_file(nbytes) - charge_file(st.manifest_bytes)
            if extra > 0:
                try:
                    self._make_room(extra, st.evictable, st.job)
                except CapacityError as e:
                    raise CapacityError(f"metadata: the manifest ({nbytes} bytes with its metadata) does not fit "
                                        f"in the local tier: {e}") from None
            st.manifest_bytes = nbytes

    def take_for_commit(self, st: Staging) -> None:
        """Move the save from the open ones to the committing ones (its bytes stay counted)."""
        with self._lock:
            if self._open.get(st.save_id) is not st:
                raise AbortedError(f"save_id: {st.save_id!r} was aborted or superseded")
            del self._open[st.save_id]
            if self._by_key.get((st.job, st.step, st.rank)) == st.save_id:
                del self._by_key[(st.job, st.step, st.rank)]
            self.committing_bytes += charge(st)
            self.committing_data += st.new_bytes

    def committed_locked(self, st: Staging) -> None:
        """A committing save left (published or failed): stop counting its bytes here (and its
        links to shared files: a published save holds them as committed files)."""
        self.committing_bytes -= charge(st)
        self.committing_data -= st.new_bytes
        self._unshare_locked(st)
        self.watch.changed_locked()

    def abort(self, save_id: str) -> None:
        """Drop an open save and its staging files. Idempotent."""
        with self._lock:
            self.abort_locked(save_id)

    def abort_locked(self, save_id: str) -> None:
        st = self._open.pop(save_id, None)
        if st is None:
            return
        if self._by_key.get((st.job, st.step, st.rank)) == save_id:
            del self._by_key[(st.job, st.step, st.rank)]
        self._layout.remove_staging(save_id)
        self._unshare_locked(st)
        self.watch.changed_locked()

    def reclaim_expired(self, timeout: float) -> int:
        """Abort saves open longer than ``timeout`` seconds (a client that died mid-save); release
        the recycle pool's pages when no save began for that long."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, st in self._open.items() if now - st.created > timeout]
            for sid in expired:
                st = self._open[sid]
                log.warning("reclaiming staging of save %s (%s step %d rank %d): open for %.0fs without commit",
                            sid, st.job, st.step, st.rank, now - st.created)
                self.abort_locked(sid)
            self.counters["staging_reclaimed"] += len(expired)
            if self._recycle.bytes and now - self.last_begin > timeout:
                # No save for that long (the job ended or moved): give the pool's pages back.
                log.info("no save for %.0fs: releasing %d recycled bytes", now - self.last_begin, self._recycle.bytes)
                self._recycle.drop(self._recycle.bytes)
            return len(expired)

    def busy(self) -> bool:
        """Whether a save is open or committing here: a trainer's, an inbound copy's or a
        restore's (safe without the lock: a snapshot)."""
        return bool(self._open) or self.committing_bytes > 0

    def open_jobs_locked(self) -> set[str]:
        """The jobs with a save open here (a trainer's or an inbound copy's)."""
        return {st.job for st in self._open.values()}

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def data_bytes_locked(self) -> int:
        return sum(st.new_bytes for st in self._open.values()) + self.committing_data

    def charged_locked(self) -> int:
        return sum(charge(st) for st in self._open.values()) + self.committing_bytes
