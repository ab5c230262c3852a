"""Where the local tier keeps what, and the file steps of saving, reading and removing a rank.

Every operation goes through :class:`.localfs.LocalDir` (no symlink below the root is followed).
No method here takes the store's lock or touches its in-memory state except the recycle pool's
file moves, which the store serialises.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from tierckpt.errors import DataLossError, FailedPreconditionError, NotFoundError

from ..knobs import KNOBS
from .links import Ino
from .localfs import FILE_MODE, STAGING_MODE, LocalDir, UnsafeFileError, digest_fd
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .recycle import RecyclePool
from .reserve import Reserve
from .staging import StagedFile, Staging

__all__ = ["StoreLayout", "STAGING_DIR", "JOBS_DIR"]

log = logging.getLogger(__name__)

STAGING_DIR = ("staging",)
JOBS_DIR = ("jobs",)
_STEP_W = 20
_RANK_PREFIX = "rank-"


class StoreLayout:
    """The local dir's layout (see :mod:`tierckptd.local.store`) over a :class:`LocalDir`."""

    def __init__(self, fs: LocalDir, recycle: RecyclePool, reserve: Reserve | None = None) -> None:
        self.fs = fs
        self.recycle = recycle
        self.reserve = reserve

    # -- names

    @staticmethod
    def rank_rel(job: str, step: int, rank: int) -> tuple[str, ...]:
        return ("jobs", job, f"{step:0{_STEP_W}d}", f"{_RANK_PREFIX}{rank:07d}")

    @staticmethod
    def staging_rel(save_id: str) -> tuple[str, ...]:
        return ("staging", save_id)

    def rank_path(self, job: str, step: int, rank: int) -> Path:
        return self.fs.path(self.rank_rel(job, step, rank))

    def shard_path(self, man: Manifest, shard: str) -> Path:
        return self.fs.path(self.rank_rel(man.job, man.step, man.rank), man.shard(shard).file)

    # -- staging

    def create_staging(self, st: Staging, reused: dict[str, str],
                       prefault: Callable[[int, int], None] | None = None) -> None:
        """Make the save's directory and its sized files; recycled files (``reused``: shard -> pool
        name) are moved in if they still pass the pool's checks. Moved names leave ``reused``.
        ``prefault(fd, size)`` takes a descriptor of each new file of at least ``KNOBS.warm_min_bytes``
        (see :mod:`.warm`). Files taken from the reserve (``st.grant``) are handed over or freed
        first (see :mod:`.reserve`)."""
        grant, reserve = st.grant, self.reserve
        if grant is not None and reserve is not None:
            reserve.free(grant)  # just before the writer faults pages in
        with self.fs.dir(STAGING_DIR) as sfd, self.fs.child(sfd, st.save_id, create=True) as dfd:
            for f in st.files.values():
                if f.shared:
                    continue
                if grant is not None and reserve is not None and f.name in grant.whole:
                    if reserve.hand_over(grant, f.name, dfd, f.size):
                        continue
                    f.reserved = False
                big = prefault is not None and f.size >= max(1, KNOBS.warm_min_bytes)
                if f.recycled:
                    ok = self.recycle.move_out(reused[f.name], f.size, dfd, f.name)
                    del reused[f.name]
                    if ok:
                        # a warm file may be taken half allocated: finish it ahead of the writer
                        if big and prefault is not None:
                            self._prefault_moved(dfd, f, prefault)
                        continue
                    f.recycled = False
                fd = self.fs.create(dfd, f.name, f.size, STAGING_MODE)
                if big and prefault is not None:
                    prefault(fd, f.size)
                else:
                    os.close(fd)

    def _prefault_moved(self, dfd: int, f: StagedFile, prefault: Callable[[int, int], None]) -> None:
        """Hand a pooled file just moved in to ``prefault`` (it starts past the pages the file has:
        a fully allocated file costs one fstat)."""
        try:
            fd = self.fs.open_regular(dfd, f.name, os.O_RDWR, f"staging file of shard {f.name!r}", size=f.size,
                                      single_link=True)
        except (FileNotFoundError, UnsafeFileError):
            return  # the writer's open fails on it the same way
        prefault(fd, f.size)

    def link_shared(self, st: Staging, sources: dict[str, tuple[Manifest, ShardEntry]]) -> dict[str, Ino]:
        """Hard-link committed files into the save's staging area, for shards whose bytes they
        hold (``sources``: shard -> the committed rank and its entry). A source that is gone or
        not a regular file of its size is skipped (that shard is staged anew). Returns the inode
        of each linked file. The caller holds the store's lock (no eviction runs meanwhile)."""
        linked: dict[str, Ino] = {}
        by_base: dict[tuple[str, int, int], list[tuple[str, ShardEntry]]] = {}
        for name, (man, entry) in sources.items():
            by_base.setdefault(man.key, []).append((name, entry))
        with self.fs.dir(STAGING_DIR) as sfd, self.fs.child(sfd, st.save_id, create=True) as dfd:
            for key, entries in by_base.items():
                try:
                    with self.fs.dir(self.rank_rel(*key)) as rfd:
                        for name, entry in entries:
                            try:
                                linked[name] = self._link_one(rfd, entry, dfd, name)
                            except OSError as e:  # staged anew: the hint never changes the bytes
                                log.warning("%s: not sharing %s (%s)", "/".join(map(str, key)), entry.file,
                                            e.strerror or e)
                except OSError as e:
                    log.warning("%s: not sharing its files (%s)", "/".join(map(str, key)), e.strerror or e)
        return linked

    def _link_one(self, rfd: int, entry: ShardEntry, dfd: int, name: str) -> Ino:
        fd = self.fs.open_regular(rfd, entry.file, os.O_RDONLY, f"committed file {entry.file}", size=entry.size)
        try:
            ident = os.fstat(fd)
        finally:
            os.close(fd)
        os.link(entry.file, name, src_dir_fd=rfd, dst_dir_fd=dfd, follow_symlinks=False)
        if not self.fs.same_file(dfd, name, ident):  # replaced between the check and the link
            self.fs.unlink(dfd, name)
            raise UnsafeFileError(0, f"{entry.file} was replaced while being linked")
        return (ident.st_dev, ident.st_ino)

    def open_staged(self, st: Staging, f: StagedFile, flags: int) -> int:
        """Open a staging file without following a link; it must be a regular file of its size.

        Raises:
            FailedPreconditionError: it was replaced (a symlink, another kind of file, resized).
        """
        try:
            with self.fs.dir(self.staging_rel(st.save_id)) as dfd:
                return self.fs.open_regular(dfd, f.name, flags, f"staging file of shard {f.name!r}", size=f.size,
                                            single_link=True)
        except (FileNotFoundError, UnsafeFileError) as e:
            raise FailedPreconditionError(f"shards[{f.name}]: the staging file was replaced or removed "
                                          f"({e.strerror or e}); the save is refused") from None

    def check_staged(self, st: Staging, digests: dict[str, str] | None, *, fsync: bool) -> dict[str, os.stat_result]:
        """fstat (and with ``digests``, hash) every staged file through a no-follow open.

        Returns:
            The identity of each file, to check after it is renamed into place.

        Raises:
            FailedPreconditionError: a file is not a regular file of its declared size.
            DataLossError: with ``digests``, a file does not hash to its digest.
        """
        stats: dict[str, os.stat_result] = {}
        try:
            with self.fs.dir(self.staging_rel(st.save_id)) as dfd:  # opened once: a rank may have thousands
                for f in st.files.values():
                    stats[f.name] = self._check_one(st, dfd, f, digests, fsync=fsync)
        except (FileNotFoundError, UnsafeFileError) as e:
            raise FailedPreconditionError(f"save {st.save_id}: the staging directory was replaced or removed "
                                          f"({e.strerror or e}); the save is refused") from None
        return stats

    def _check_one(self, st: Staging, dfd: int, f: StagedFile, digests: dict[str, str] | None, *,
                   fsync: bool) -> os.stat_result:
        try:
            fd = self.fs.open_regular(dfd, f.name, os.O_RDONLY, f"staging file of shard {f.name!r}", size=f.size,
                                      single_link=not f.shared)
        except (FileNotFoundError, UnsafeFileError) as e:
            raise FailedPreconditionError(f"shards[{f.name}]: the staging file was replaced or removed "
                                          f"({e.strerror or e}); the save is refused") from None
        if f.shared:  # a link to a committed file: still that inode, not hashed again nor made writable
            try:
                ident = os.fstat(fd)
            finally:
                os.close(fd)
            if (ident.st_dev, ident.st_ino) != f.ino:
                raise FailedPreconditionError(f"shards[{f.name}]: the shared staging file was replaced; "
                                              "the save is refused")
            return ident
        try:
            os.fchmod(fd, FILE_MODE)  # the socket group wrote it; committed bytes are read-only to it
            ident = os.fstat(fd)
            if digests is not None:
                actual = digest_fd(fd, f.size)
                if actual != digests[f.name]:
                    raise DataLossError(f"checksum mismatch for {st.job}/{st.step}/rank {st.rank}/{f.name}: "
                                        f"expected {digests[f.name]}, got {actual}")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return ident

    def place(self, st: Staging, man: Manifest, stats: dict[str, os.stat_result], *, fsync: bool) -> str:
        """Rename the staged files into the rank directory (checking each is the file that was
        checked) and write the manifest under a temporary name; returns that name."""
        with self.fs.dir(STAGING_DIR) as sfd, self.fs.child(sfd, st.save_id) as src, \
                self.fs.dir(self.rank_rel(st.job, st.step, st.rank), create=True) as dst:
            for f in st.files.values():
                target = f"{f.name}.{st.save_id}"
                os.rename(f.name, target, src_dir_fd=src, dst_dir_fd=dst)
                if not self.fs.same_file(dst, target, stats[f.name]):
                    raise UnsafeFileError(0, f"the staging file of shard {f.name!r} was replaced during the commit")
            if fsync:
                os.fsync(dst)
            return self.fs.write_temp(dst, MANIFEST_NAME, man.to_json(), fsync=fsync)

    def unplace(self, st: Staging, tmp: str | None = None) -> None:
        """Undo :meth:`place` after a failure (the data files and the temporary manifest)."""
        try:
            with self.fs.dir(self.rank_rel(st.job, st.step, st.rank)) as dst:
                for f in st.files.values():
                    self.fs.unlink(dst, f"{f.name}.{st.save_id}")
                if tmp:
                    self.fs.unlink(dst, tmp)
        except (FileNotFoundError, UnsafeFileError):
            pass

    def publish(self, st: Staging, tmp: str) -> None:
        """Rename the temporary manifest over ``manifest.json``: the commit point."""
        with self.fs.dir(self.rank_rel(st.job, st.step, st.rank)) as dst:
            os.rename(tmp, MANIFEST_NAME, src_dir_fd=dst, dst_dir_fd=dst)

    def fsync_rank(self, job: str, step: int, rank: int) -> None:
        with self.fs.dir(self.rank_rel(job, step, rank)) as d:
            os.fsync(d)

    def remove_staging(self, save_id: str, *, only_if_empty: bool = False) -> None:
        with self.fs.dir(STAGING_DIR) as sfd:
            if only_if_empty:
                self.fs.rmdir(sfd, save_id)
            else:
                self.fs.remove_tree(sfd, save_id)

    # -- committed ranks

    def open_shard(self, man: Manifest, shard: str) -> int:
        """A read-only descriptor of a committed shard (no link followed; regular file of its size).

        Raises:
            KeyError: ``shard`` is not part of ``man``.
            NotFoundError: the file is gone (evicted or re-saved since ``man`` was read).
            DataLossError: the file is not a regular file of the recorded size.
        """
        entry = man.shard(shard)
        what = f"{man.job} step {man.step} rank {man.rank} shard {shard!r}"
        try:
            with self.fs.dir(self.rank_rel(man.job, man.step, man.rank)) as d:
                return self.fs.open_regular(d, entry.file, os.O_RDONLY, what, size=entry.size)
        except FileNotFoundError:
            raise NotFoundError(f"{what} was evicted") from None
        except UnsafeFileError as e:
            log.error("local copy refused: %s", e.strerror)
            raise DataLossError(f"local copy of {what} is damaged: {e.strerror}") from None

    def remove_rank_files(self, man: Manifest, *, keep_manifest: bool = False) -> None:
        """Uncommit (manifest first), release the data files to the pool, and remove the empty
        rank directory. ``keep_manifest``: only the files of ``man`` (a re-save replaced it)."""
        rel = self.rank_rel(man.job, man.step, man.rank)
        rank_name = rel[-1]
        try:
            with self.fs.dir(rel[:-1]) as step_fd:
                try:
                    with self.fs.child(step_fd, rank_name) as rfd:
                        if not keep_manifest:
                            self.fs.unlink(rfd, MANIFEST_NAME)
                        for s in man.shards:
                            self.recycle.release(rfd, s.file, self.fs.path(rel, s.file), s.size)
                except UnsafeFileError:
                    log.error("%s: the rank directory was replaced by a link; removing the link", "/".join(rel))
                    self.fs.unlink(step_fd, rank_name)
                except FileNotFoundError:
                    pass
                self.fs.rmdir(step_fd, rank_name)
        except (FileNotFoundError, UnsafeFileError):
            pass

    def prune(self, job: str, step: int, *, job_too: bool) -> None:
        """Remove a step directory (and the job's) if empty."""
        try:
            with self.fs.dir(JOBS_DIR) as jfd:
                with self.fs.child(jfd, job) as jd:
                    self.fs.rmdir(jd, f"{step:0{_STEP_W}d}")
                if job_too:
                    self.fs.rmdir(jfd, job)
        except (FileNotFoundError, UnsafeFileError):
            pass
