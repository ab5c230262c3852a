"""The local tier: staging files, committed ranks, retention, capacity and the catalog.

Layout under ``local_dir``::

    .fs-token                                   random token: proves a client shares this filesystem
    staging/<save_id>/<shard>                   bytes being written (never read by restore)
    recycle/<size>.<id>                         data files of evicted steps kept for reuse
    jobs/<job>/<step:020d>/rank-<rank:07d>/<shard>.<generation>    committed data
    jobs/<job>/<step:020d>/rank-<rank:07d>/manifest.json           the commit marker, written last

Commit protocol: staging files are renamed into the rank directory, flushed when the medium is
durable, then ``manifest.json`` is written under a temporary name and renamed over any older
manifest (a re-save of the same step replaces it atomically; the old data files are removed
after the rename). At start-up the catalog is rebuilt from the manifests; staging leftovers and
rank directories without a manifest are reclaimed.

Pieces: :mod:`.catalog` (in-memory state), :mod:`.retention` (which steps go),
:mod:`.recycle` (reuse of evicted files), :mod:`.staging` (open saves), :mod:`.localfs`.

Thread safety: every public method may be called from any thread (the daemon calls them through
:func:`tierckptd.offload.run_blocking`). One lock guards the in-memory state; long file I/O
happens outside it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tierckpt.common.fileio import atomic_write, digest_file, fsync_path, pwrite_all, write_temp
from tierckpt.common.names import MAX_METADATA_BYTES, check_job, check_rank, check_step
from tierckpt.errors import CapacityError, DataLossError, InvalidArgumentError

from .catalog import Catalog, CompletenessFn
from .localfs import fs_is_tmpfs, rmdir_if_empty, rmdir_quiet
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .recycle import RecyclePool
from .retention import Eviction
from .staging import ShardSpec, StagedFile, Staging, check_specs

__all__ = ["LocalStore", "Staging", "StagedFile", "Usage", "Eviction", "fs_is_tmpfs"]

log = logging.getLogger(__name__)

_STEP_W = 20
_RANK_PREFIX = "rank-"

# Kept importable under their old private names for modules and tests that used them.
_rmdir_quiet = rmdir_quiet
_rmdir_if_empty = rmdir_if_empty


@dataclass(frozen=True)
class Usage:
    capacity: int
    committed: int
    staging: int
    recycle: int

    @property
    def used(self) -> int:
        return self.committed + self.staging + self.recycle

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)


def _check_digests(save_id: str, files: Iterable[str], digests: dict[str, str], metadata_json: str) -> None:
    if len(metadata_json.encode()) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(f"metadata: larger than {MAX_METADATA_BYTES} bytes")
    missing = set(files) - set(digests)
    extra = set(digests) - set(files)
    if missing or extra:
        raise InvalidArgumentError(f"digests: missing {sorted(missing)} / unknown {sorted(extra)} for save {save_id}")
    for name, d in digests.items():
        if not isinstance(d, str) or len(d) != 16 or any(c not in "0123456789abcdef" for c in d):
            raise InvalidArgumentError(f"digests[{name}].checksum: {d!r} is not 16 lowercase hex digits")


class LocalStore:
    """The node's local tier. See the module docstring for layout and protocol.

    Args:
        root: the local directory.
        node_id: this node's id (owner recorded in manifests of ranks saved here).
        capacity: bytes the tier may hold; 0 means 90% of the filesystem size.
        keep_local: newest complete steps per job kept (>= 1).
        fsync: "auto", "always" or "never".
        max_shard_bytes: largest shard accepted.
        is_complete: completeness rule used by retention (default: every rank held here);
            the peer tier's membership supplies a cluster-aware one.
        on_evict: called (from the evicting thread) with every eviction.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        node_id: str,
        *,
        capacity: int = 0,
        keep_local: int = 2,
        fsync: str = "auto",
        max_shard_bytes: int = 1 << 40,
        is_complete: CompletenessFn | None = None,
        on_evict: Callable[[Eviction], None] | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.node_id = node_id
        self._capacity_arg = capacity
        self.capacity = capacity
        self.keep_local = keep_local
        self._fsync_mode = fsync
        self.fsync = fsync == "always"
        self.max_shard_bytes = max_shard_bytes
        self.fs_token = ""
        self._lock = threading.RLock()
        self._catalog = Catalog(is_complete)
        self._open: dict[str, Staging] = {}
        self._open_by_key: dict[tuple[str, int, int], str] = {}
        self._recycle = RecyclePool(self.root / "recycle")
        self._last_begin = time.monotonic()
        self._lock_fd: int | None = None
        self._committing_bytes = 0  # saves between leaving _open and entering the catalog
        self._on_evict = on_evict
        self.counters: dict[str, int] = {"staging_reclaimed": 0, "evictions_capacity_undrained": 0}

    @property
    def _is_complete(self) -> CompletenessFn:
        return self._catalog.is_complete

    @_is_complete.setter
    def _is_complete(self, fn: CompletenessFn) -> None:  # peer.py still assigns it (interim)
        self._catalog.is_complete = fn

    # ----------------------------------------------------------------------------- start-up

    def open(self) -> None:
        """Create the layout, reclaim leftovers and rebuild the catalog from the manifests.

        Raises:
            ConfigError: another live daemon holds this local_dir (its start-up would have
                reclaimed that daemon's staging files).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self._take_dir_lock()
        for sub in ("staging", "recycle", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self._fsync_mode == "auto":
            self.fsync = not fs_is_tmpfs(self.root)
        if not self._capacity_arg:
            st = os.statvfs(self.root)
            self.capacity = int(st.f_blocks * st.f_frsize * 0.9)
        self.fs_token = secrets.token_hex(16)
        atomic_write(self.root / ".fs-token", self.fs_token.encode(), fsync=False)
        reclaimed = 0
        for entry in (self.root / "staging").iterdir():
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            reclaimed += 1
        self._recycle.clear_directory()
        if reclaimed:
            log.info("reclaimed %d staging leftovers of a previous run", reclaimed)
            self.counters["staging_reclaimed"] += reclaimed
        self._scan()

    def _take_dir_lock(self) -> None:
        from .config import ConfigError

        fd = os.open(self.root / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"local_dir: {self.root} is in use by another tierckptd (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd  # held (and the lock with it) until the process exits

    def close(self) -> None:
        """Release the local_dir lock (a process exit releases it too)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _scan(self) -> None:
        jobs_dir = self.root / "jobs"
        loaded = dropped = 0
        for job_dir in jobs_dir.iterdir():
            for step_dir in job_dir.iterdir() if job_dir.is_dir() else ():
                for rank_dir in step_dir.iterdir() if step_dir.is_dir() else ():
                    man = self._load_rank_dir(rank_dir)
                    if man is None:
                        shutil.rmtree(rank_dir, ignore_errors=True)
                        dropped += 1
                        continue
                    self._catalog.add(man, man.nbytes)
                    loaded += 1
                rmdir_if_empty(step_dir)
            rmdir_if_empty(job_dir)
        log.info("catalog rebuilt: %d committed ranks, %d uncommitted leftovers removed", loaded, dropped)

    def _load_rank_dir(self, rank_dir: Path) -> Manifest | None:
        mpath = rank_dir / MANIFEST_NAME
        try:
            man = Manifest.from_json(mpath.read_bytes())
        except (OSError, DataLossError) as e:
            log.warning("ignoring %s: %s", rank_dir, e)
            return None
        if self._rank_dir(man.job, man.step, man.rank) != rank_dir:
            log.warning("ignoring %s: manifest names another location", rank_dir)
            return None
        keep = {s.file for s in man.shards} | {MANIFEST_NAME}
        for f in rank_dir.iterdir():
            if f.name not in keep:  # data of an interrupted re-save, or a temp manifest
                f.unlink(missing_ok=True)
        for s in man.shards:
            p = rank_dir / s.file
            try:
                if p.stat().st_size != s.size:
                    log.warning("ignoring %s: %s has the wrong size", rank_dir, s.file)
                    return None
            except FileNotFoundError:
                log.warning("ignoring %s: %s is missing", rank_dir, s.file)
                return None
        return man

    # ----------------------------------------------------------------------------- paths

    def _rank_dir(self, job: str, step: int, rank: int) -> Path:
        return self.root / "jobs" / job / f"{step:0{_STEP_W}d}" / f"{_RANK_PREFIX}{rank:07d}"

    def shard_path(self, man: Manifest, shard: str) -> Path:
        return self._rank_dir(man.job, man.step, man.rank) / man.shard(shard).file

    # ----------------------------------------------------------------------------- saving

    def begin(self, job: str, step: int, rank: int, world_size: int, specs: Sequence[ShardSpec], *,
              stream: bool = False) -> Staging:
        """Reserve capacity and create sized staging files for one rank's shards.

        Args:
            specs: (name, size, dtype, shape) per shard.
            stream: bytes will arrive through :meth:`write_chunk` rather than from the client directly.

        Raises:
            InvalidArgumentError: a field is invalid (the message names it).
            CapacityError: the shards do not fit even after eviction.
        """
        check_job(job)
        check_step(step)
        check_rank(rank, world_size)
        check_specs(specs, self.max_shard_bytes)
        save_id = secrets.token_hex(8)
        sdir = self.root / "staging" / save_id
        staging = Staging(save_id=save_id, job=job, step=step, rank=rank, world_size=world_size,
                          files={}, dir=sdir, stream=stream)
        for name, size, dtype, shape in specs:
            staging.files[name] = StagedFile(name, size, sdir / name, dtype, tuple(int(d) for d in shape))
        with self._lock:
            reused = self._reserve_locked(staging)
        try:
            self._create_staging_files(staging, reused)
        except OSError as e:
            self.abort(save_id)
            for path in reused.values():  # taken from the pool (and its bytes) but not moved yet
                path.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise CapacityError(f"local_dir {self.root} is full: {e.strerror}") from e
            raise
        return staging

    def _reserve_locked(self, staging: Staging) -> dict[str, Path]:
        """Supersede an older open save of the rank, make room, take recycled files, register."""
        self._last_begin = time.monotonic()
        key = (staging.job, staging.step, staging.rank)
        older = self._open_by_key.get(key)
        if older is not None:
            log.info("save %s of %s/%d/%d superseded by a new save; aborting it", older, *key)
            self._abort_locked(older)
        self._make_room_locked(staging.nbytes)
        reused: dict[str, Path] = {}
        for f in staging.files.values():
            path = self._recycle.take(f.size)
            if path is not None:
                reused[f.name] = path
                f.recycled = True
        self._open[staging.save_id] = staging
        self._open_by_key[key] = staging.save_id
        return reused

    @staticmethod
    def _create_staging_files(staging: Staging, reused: dict[str, Path]) -> None:
        staging.dir.mkdir()
        for f in staging.files.values():
            if f.recycled:
                os.rename(reused[f.name], f.path)
                del reused[f.name]  # moved: aborting the save removes it now
            else:
                with open(f.path, "xb") as fh:
                    os.ftruncate(fh.fileno(), f.size)

    def get_staging(self, save_id: str) -> Staging:
        with self._lock:
            st = self._open.get(save_id)
        if st is None:
            raise InvalidArgumentError(f"save_id: {save_id!r} is not an open save (never begun, committed or expired)")
        return st

    def write_chunk(self, save_id: str, shard: str, offset: int, data: bytes | memoryview, fd_cache: dict) -> None:
        """Write streamed bytes into a staging file (stream transfers). ``fd_cache`` maps paths to fds."""
        st = self.get_staging(save_id)
        f = st.files.get(shard)
        if f is None:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of save {save_id}")
        if offset + len(data) > f.size:
            raise InvalidArgumentError(f"offset: {offset}+{len(data)} exceeds shard {shard!r} size {f.size}")
        fd = fd_cache.get(f.path)
        if fd is None:
            fd = fd_cache[f.path] = os.open(f.path, os.O_WRONLY)
        pwrite_all(fd, memoryview(data), offset)
        f.written += len(data)

    def commit(self, save_id: str, digests: dict[str, str], metadata_json: str = "{}", *, persist: bool = False,
               verify: bool = False, node: str | None = None, generation: str | None = None,
               created: float | None = None, pin: str | None = None) -> tuple[Manifest, list[Eviction]]:
        """Publish an open save: move its files into place and write the manifest last.

        Args:
            digests: checksum per shard, as computed by the writer.
            verify: hash the staged bytes here and compare (stream transfers, peer receive,
                object-store download). A mismatch aborts the save and raises DataLossError.
            node, generation, created: kept from the source manifest when ingesting a copy.
            pin: pin the step with this reason in the same critical section as the commit, so
                retention cannot evict it before a background tier has taken it (see :meth:`pin`).

        Returns:
            The manifest and the evictions that retention made afterwards.
        """
        st = self.get_staging(save_id)
        _check_digests(save_id, st.files, digests, metadata_json)
        self._check_staged(st, digests, verify=verify or st.stream)
        self._take_for_commit(st)
        man = Manifest(
            job=st.job, step=st.step, rank=st.rank, world_size=st.world_size,
            node=node or self.node_id, generation=generation or save_id,
            shards=tuple(ShardEntry(f.name, f.size, digests[f.name], f.dtype, f.shape, f"{f.name}.{save_id}")
                         for f in st.files.values()),
            metadata_json=metadata_json, created=created if created is not None else time.time(), persist=persist,
        )
        rdir = self._rank_dir(st.job, st.step, st.rank)
        tmp = self._place_files(st, rdir, man)
        with self._lock:
            self._committing_bytes -= st.nbytes
            evictions = self._publish_locked(st, man, rdir, tmp, pin)
        if self.fsync:
            fsync_path(rdir)
        self._notify(evictions)
        return man, evictions

    def _check_staged(self, st: Staging, digests: dict[str, str], *, verify: bool) -> None:
        """Stream transfers must be whole; with ``verify``, the staged bytes must hash to the digests."""
        if st.stream:
            short = [f.name for f in st.files.values() if f.written < f.size]
            if short:
                self.abort(st.save_id)
                raise InvalidArgumentError(f"shard: {short} received fewer bytes than their declared size")
        if not verify:
            return
        for f in st.files.values():
            actual = digest_file(f.path, f.size)
            if actual != digests[f.name]:
                self.abort(st.save_id)
                raise DataLossError(f"checksum mismatch for {st.job}/{st.step}/rank {st.rank}/{f.name}: "
                                    f"expected {digests[f.name]}, got {actual}")

    def _take_for_commit(self, st: Staging) -> None:
        """Move the save from the open ones to the committing ones (its bytes stay counted)."""
        with self._lock:
            if self._open.get(st.save_id) is not st:
                raise InvalidArgumentError(f"save_id: {st.save_id!r} was aborted or superseded")
            del self._open[st.save_id]
            if self._open_by_key.get((st.job, st.step, st.rank)) == st.save_id:
                del self._open_by_key[(st.job, st.step, st.rank)]
            self._committing_bytes += st.nbytes

    def _place_files(self, st: Staging, rdir: Path, man: Manifest) -> Path:
        """Rename the staged files into the rank directory and write the manifest under a temporary name."""
        try:
            rdir.mkdir(parents=True, exist_ok=True)
            for f in st.files.values():
                if self.fsync:
                    fsync_path(f.path)
                os.rename(f.path, rdir / f"{f.name}.{st.save_id}")
            if self.fsync:
                fsync_path(rdir)
            return write_temp(rdir / MANIFEST_NAME, man.to_json(), fsync=self.fsync)
        except BaseException as e:
            with self._lock:
                self._committing_bytes -= st.nbytes
            if isinstance(e, OSError):
                shutil.rmtree(st.dir, ignore_errors=True)
                for f in st.files.values():
                    (rdir / f"{f.name}.{st.save_id}").unlink(missing_ok=True)
            raise
        finally:
            _rmdir_quiet(st.dir)

    def _publish_locked(self, st: Staging, man: Manifest, rdir: Path, tmp: Path, pin: str | None) -> list[Eviction]:
        # The manifest goes into place in the critical section that updates the catalog, so
        # overlapping commits of one rank (and evictions) change disk and catalog in one order.
        try:
            os.rename(tmp, rdir / MANIFEST_NAME)
        except OSError:
            tmp.unlink(missing_ok=True)
            for f in st.files.values():
                (rdir / f"{f.name}.{st.save_id}").unlink(missing_ok=True)
            raise
        old = self._catalog.add(man, man.nbytes)
        for f in st.files.values():
            self._recycle.mark_recyclable(rdir / f"{f.name}.{st.save_id}")
        if old is not None:
            self._catalog.uncharge(old.nbytes)
            self._release_files_locked(rdir, old)
        if pin:
            self._catalog.pin(st.job, st.step, pin)
        return self._retain_locked(st.job)

    def abort(self, save_id: str) -> None:
        """Drop an open save and its staging files. Idempotent."""
        with self._lock:
            self._abort_locked(save_id)

    def _abort_locked(self, save_id: str) -> None:
        st = self._open.pop(save_id, None)
        if st is None:
            return
        if self._open_by_key.get((st.job, st.step, st.rank)) == save_id:
            del self._open_by_key[(st.job, st.step, st.rank)]
        shutil.rmtree(st.dir, ignore_errors=True)

    def reclaim_expired(self, timeout: float) -> int:
        """Abort saves open longer than ``timeout`` seconds (a client that died mid-save)."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, st in self._open.items() if now - st.created > timeout]
            for sid in expired:
                st = self._open[sid]
                log.warning("reclaiming staging of save %s (%s step %d rank %d): open for %.0fs without commit",
                            sid, st.job, st.step, st.rank, now - st.created)
                self._abort_locked(sid)
            self.counters["staging_reclaimed"] += len(expired)
            if self._recycle.bytes and now - self._last_begin > timeout:
                # No save for that long (the job ended or moved): give the pool's pages back.
                log.info("no save for %.0fs: releasing %d recycled bytes", now - self._last_begin, self._recycle.bytes)
                self._recycle.drop(self._recycle.bytes)
            return len(expired)

    def open_saves(self) -> int:
        with self._lock:
            return len(self._open)

    # ----------------------------------------------------------------------------- reading

    def get(self, job: str, step: int, rank: int) -> Manifest | None:
        with self._lock:
            return self._catalog.get(job, step, rank)

    def lend(self, man: Manifest) -> list[Path]:
        """Paths of a rank's data files for a reader to map; they are never recycled afterwards."""
        rdir = self._rank_dir(man.job, man.step, man.rank)
        paths = [rdir / s.file for s in man.shards]
        with self._lock:
            self._recycle.lent(paths)
        return paths

    def jobs(self) -> list[str]:
        with self._lock:
            return self._catalog.jobs()

    def steps(self, job: str) -> dict[int, dict[int, Manifest]]:
        """Snapshot: step -> rank -> manifest."""
        with self._lock:
            return self._catalog.steps(job)

    def complete_steps(self, job: str) -> list[int]:
        with self._lock:
            return self._catalog.complete(job)

    def usage(self) -> Usage:
        with self._lock:
            return Usage(self.capacity, self._catalog.committed_bytes, self._staging_bytes_locked(),
                         self._recycle.bytes)

    def _staging_bytes_locked(self) -> int:
        return sum(st.nbytes for st in self._open.values()) + self._committing_bytes

    def _used_locked(self) -> int:
        return self._catalog.committed_bytes + self._staging_bytes_locked() + self._recycle.bytes

    # ----------------------------------------------------------------------------- retention

    def pin(self, job: str, step: int, reason: str) -> None:
        """Protect a step from retention (e.g. "drain" while waiting for the persistent tier)."""
        with self._lock:
            self._catalog.pin(job, step, reason)

    def unpin(self, job: str, step: int, reason: str) -> None:
        with self._lock:
            self._catalog.unpin(job, step, reason)
            evictions = self._retain_locked(job)
        self._notify(evictions)

    def apply_retention(self, job: str) -> list[Eviction]:
        with self._lock:
            evictions = self._retain_locked(job)
        self._notify(evictions)
        return evictions

    def _retain_locked(self, job: str) -> list[Eviction]:
        return [self._evict_locked(job, step, "retention")
                for step in self._catalog.retention_victims(job, self.keep_local)]

    def _make_room_locked(self, need: int) -> None:
        if need > self.capacity:
            raise CapacityError(f"shards: {need} bytes exceed local_capacity {self.capacity}")
        if self._used_locked() + need <= self.capacity:
            return
        # 1) recycled files, 2) old steps already safe, 3) old steps still waiting to be drained.
        self._recycle.drop(self._used_locked() + need - self.capacity)
        evictions: list[Eviction] = []
        for allow_pinned in (False, True):
            for job, step in self._catalog.capacity_order(allow_pinned=allow_pinned):
                if self._used_locked() + need <= self.capacity:
                    break
                evictions.append(self._evict_for_capacity_locked(job, step))
                self._recycle.drop(self._used_locked() + need - self.capacity)
        if evictions:
            threading.Thread(target=self._notify, args=(evictions,), daemon=True).start()
        if self._used_locked() + need > self.capacity:
            raise CapacityError(
                f"shards: {need} bytes do not fit in local_capacity {self.capacity} "
                f"({self._used_locked()} used by the newest complete and in-progress steps)"
            )

    def _evict_for_capacity_locked(self, job: str, step: int) -> Eviction:
        pins = self._catalog.pins(job, step)
        if pins:
            log.error("local tier full: evicting %s step %d before it was drained (%s)", job, step,
                      ",".join(sorted(pins)))
            self.counters["evictions_capacity_undrained"] += 1
            self._catalog.drop_pins(job, step)
        return self._evict_locked(job, step, "capacity_undrained" if pins else "capacity")

    def _evict_locked(self, job: str, step: int, reason: str) -> Eviction:
        ranks = self._catalog.pop_step(job, step)
        for rank, man in ranks.items():
            self._catalog.uncharge(man.nbytes)
            self._remove_rank_files_locked(man)
        _rmdir_quiet(self.root / "jobs" / job / f"{step:0{_STEP_W}d}")
        if not self._catalog.has_job(job):
            _rmdir_quiet(self.root / "jobs" / job)
        log.info("evicted %s step %d (%d ranks, %s)", job, step, len(ranks), reason)
        return Eviction(job, step, tuple(sorted(ranks)), reason)

    def remove_rank(self, job: str, step: int, rank: int, reason: str, *, generation: str | None = None) -> bool:
        """Remove one committed rank (e.g. a replica whose owner evicted the step); with
        ``generation``, only if the committed copy is still that save."""
        with self._lock:
            man = self._catalog.get(job, step, rank)
            if man is None or (generation is not None and man.generation != generation):
                return False
            self._catalog.pop_rank(job, step, rank)
            self._catalog.uncharge(man.nbytes)
            self._remove_rank_files_locked(man)
            if not self._catalog.steps(job).get(step):
                _rmdir_quiet(self._rank_dir(job, step, rank).parent)
            log.info("removed %s step %d rank %d (%s)", job, step, rank, reason)
            return True

    def _remove_rank_files_locked(self, man: Manifest) -> None:
        rdir = self._rank_dir(man.job, man.step, man.rank)
        (rdir / MANIFEST_NAME).unlink(missing_ok=True)  # uncommit first
        self._release_files_locked(rdir, man)
        _rmdir_quiet(rdir)

    def _release_files_locked(self, rdir: Path, man: Manifest) -> None:
        for s in man.shards:
            self._recycle.release(rdir / s.file, s.size)

    def _notify(self, evictions: Iterable[Eviction]) -> None:
        if self._on_evict is not None:
            for ev in evictions:
                self._on_evict(ev)
