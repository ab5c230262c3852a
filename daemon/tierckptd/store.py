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

Recycling: first-touch page faults make writing a fresh tmpfs file 3-5x slower than overwriting
one whose pages exist. Data files of evicted steps go to ``recycle/`` and a later save with a
shard of exactly the same size reuses one. Files ever handed to a reader (restore maps them) are
never recycled, since a reader's mapping would see the new bytes; after a restart every file
counts as lent.

Thread safety: every public method may be called from any thread (the server calls them through
``asyncio.to_thread``). One lock guards the in-memory state; long file I/O happens outside it.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tierckpt.common.fileio import atomic_write, digest_file, fsync_path, pwrite_all, write_temp
from tierckpt.common.names import (
    MAX_METADATA_BYTES,
    MAX_SHARDS_PER_RANK,
    check_job,
    check_rank,
    check_shard,
    check_size,
    check_step,
)
from tierckpt.errors import (
    CapacityError,
    DataLossError,
    InvalidArgumentError,
)

from .manifest import MANIFEST_NAME, Manifest, ShardEntry

__all__ = ["LocalStore", "Staging", "StagedFile", "Usage", "fs_is_tmpfs"]

log = logging.getLogger(__name__)

_STEP_W = 20
_RANK_PREFIX = "rank-"


@dataclass
class StagedFile:
    name: str
    size: int
    path: Path
    dtype: str = ""
    shape: tuple[int, ...] = ()
    recycled: bool = False
    written: int = 0  # bytes received through write_chunk (stream transfers)


@dataclass
class Staging:
    """One open save: reserved capacity and staging files for one rank of one step."""

    save_id: str
    job: str
    step: int
    rank: int
    world_size: int
    files: dict[str, StagedFile]
    dir: Path
    stream: bool
    created: float = field(default_factory=time.monotonic)
    begun_wall: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())


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


@dataclass(frozen=True)
class Eviction:
    job: str
    step: int
    ranks: tuple[int, ...]
    reason: str  # "retention" | "capacity" | "capacity_undrained" | "replaced"


CompletenessFn = Callable[[str, int, int, set[int]], bool]


def _local_complete(job: str, step: int, world_size: int, ranks: set[int]) -> bool:
    return len(ranks) == world_size


def fs_is_tmpfs(path: str | os.PathLike) -> bool:
    """True if ``path`` lives on tmpfs/ramfs (where fsync buys nothing)."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                parts = line.split()
                mount = parts[4]
                fs = parts[parts.index("-") + 1]
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, fs
    except (OSError, ValueError, IndexError):
        return False
    return fstype in ("tmpfs", "ramfs")


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
        # (job) -> step -> rank -> Manifest
        self._catalog: dict[str, dict[int, dict[int, Manifest]]] = {}
        self._open: dict[str, Staging] = {}
        self._open_by_key: dict[tuple[str, int, int], str] = {}
        self._recycle: dict[int, list[Path]] = {}
        self._last_begin = time.monotonic()
        self._lock_fd: int | None = None
        self._recycle_bytes = 0
        self._recyclable: set[Path] = set()
        self._committed_bytes = 0
        self._committing_bytes = 0  # saves between leaving _open and entering the catalog
        self._pins: dict[tuple[str, int], set[str]] = {}
        self._is_complete: CompletenessFn = is_complete or _local_complete
        self._on_evict = on_evict
        self.counters: dict[str, int] = {"staging_reclaimed": 0, "evictions_capacity_undrained": 0}

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
        for entry in (self.root / "recycle").iterdir():
            entry.unlink(missing_ok=True)
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
                    self._catalog.setdefault(man.job, {}).setdefault(man.step, {})[man.rank] = man
                    self._committed_bytes += man.nbytes
                    loaded += 1
                _rmdir_if_empty(step_dir)
            _rmdir_if_empty(job_dir)
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

    def begin(
        self,
        job: str,
        step: int,
        rank: int,
        world_size: int,
        specs: Sequence[tuple[str, int, str, Sequence[int]]],
        *,
        stream: bool = False,
    ) -> Staging:
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
        if not specs:
            raise InvalidArgumentError("shards: at least one shard is required")
        if len(specs) > MAX_SHARDS_PER_RANK:
            raise InvalidArgumentError(f"shards: at most {MAX_SHARDS_PER_RANK} shards per rank")
        names: set[str] = set()
        for name, size, _dtype, _shape in specs:
            check_shard(name, "shards.name")
            check_size(size, f"shards[{name}].size", self.max_shard_bytes)
            if name in names:
                raise InvalidArgumentError(f"shards.name: {name!r} appears twice")
            names.add(name)
        total = sum(s[1] for s in specs)
        save_id = secrets.token_hex(8)
        sdir = self.root / "staging" / save_id
        with self._lock:
            self._last_begin = time.monotonic()
            older = self._open_by_key.get((job, step, rank))
            if older is not None:
                log.info("save %s of %s/%d/%d superseded by a new save; aborting it", older, job, step, rank)
                self._abort_locked(older)
            self._make_room_locked(total)
            reused: dict[str, Path] = {}
            for name, size, _d, _s in specs:
                pool = self._recycle.get(size)
                if pool and size > 0:
                    reused[name] = pool.pop()
                    self._recycle_bytes -= size
            staging = Staging(
                save_id=save_id, job=job, step=step, rank=rank, world_size=world_size,
                files={}, dir=sdir, stream=stream,
            )
            for name, size, dtype, shape in specs:
                staging.files[name] = StagedFile(
                    name, size, sdir / name, dtype, tuple(int(d) for d in shape), recycled=name in reused
                )
            self._open[save_id] = staging
            self._open_by_key[(job, step, rank)] = save_id
        try:
            sdir.mkdir()
            for f in staging.files.values():
                if f.recycled:
                    os.rename(reused[f.name], f.path)
                else:
                    with open(f.path, "xb") as fh:
                        os.ftruncate(fh.fileno(), f.size)
        except OSError as e:
            self.abort(save_id)
            for path in reused.values():  # taken from the pool (and its bytes) but not moved yet
                path.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise CapacityError(f"local_dir {self.root} is full: {e.strerror}") from e
            raise
        return staging

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

    def commit(
        self,
        save_id: str,
        digests: dict[str, str],
        metadata_json: str = "{}",
        *,
        persist: bool = False,
        verify: bool = False,
        node: str | None = None,
        generation: str | None = None,
        created: float | None = None,
        pin: str | None = None,
    ) -> tuple[Manifest, list[Eviction]]:
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
        if len(metadata_json.encode()) > MAX_METADATA_BYTES:
            raise InvalidArgumentError(f"metadata: larger than {MAX_METADATA_BYTES} bytes")
        missing = set(st.files) - set(digests)
        extra = set(digests) - set(st.files)
        if missing or extra:
            raise InvalidArgumentError(
                f"digests: missing {sorted(missing)} / unknown {sorted(extra)} for save {save_id}"
            )
        for name, d in digests.items():
            if not isinstance(d, str) or len(d) != 16 or any(c not in "0123456789abcdef" for c in d):
                raise InvalidArgumentError(f"digests[{name}].checksum: {d!r} is not 16 lowercase hex digits")
        if st.stream:
            short = [f.name for f in st.files.values() if f.written < f.size]
            if short:
                self.abort(save_id)
                raise InvalidArgumentError(f"shard: {short} received fewer bytes than their declared size")
        if verify or st.stream:
            for f in st.files.values():
                actual = digest_file(f.path, f.size)
                if actual != digests[f.name]:
                    self.abort(save_id)
                    raise DataLossError(
                        f"checksum mismatch for {st.job}/{st.step}/rank {st.rank}/{f.name}: "
                        f"expected {digests[f.name]}, got {actual}"
                    )
        with self._lock:
            if self._open.get(save_id) is not st:
                raise InvalidArgumentError(f"save_id: {save_id!r} was aborted or superseded")
            del self._open[save_id]
            if self._open_by_key.get((st.job, st.step, st.rank)) == save_id:
                del self._open_by_key[(st.job, st.step, st.rank)]
            self._committing_bytes += st.nbytes
        gen = generation or save_id
        man = Manifest(
            job=st.job, step=st.step, rank=st.rank, world_size=st.world_size,
            node=node or self.node_id, generation=gen,
            shards=tuple(
                ShardEntry(f.name, f.size, digests[f.name], f.dtype, f.shape, f"{f.name}.{save_id}")
                for f in st.files.values()
            ),
            metadata_json=metadata_json, created=created if created is not None else time.time(),
            persist=persist,
        )
        rdir = self._rank_dir(st.job, st.step, st.rank)
        try:
            rdir.mkdir(parents=True, exist_ok=True)
            for f in st.files.values():
                target = rdir / f"{f.name}.{save_id}"
                if self.fsync:
                    fsync_path(f.path)
                os.rename(f.path, target)
            if self.fsync:
                fsync_path(rdir)
            tmp = write_temp(rdir / MANIFEST_NAME, man.to_json(), fsync=self.fsync)
        except BaseException as e:
            with self._lock:
                self._committing_bytes -= st.nbytes
            if isinstance(e, OSError):
                shutil.rmtree(st.dir, ignore_errors=True)
                for f in st.files.values():
                    (rdir / f"{f.name}.{save_id}").unlink(missing_ok=True)
            raise
        finally:
            _rmdir_quiet(st.dir)
        evictions: list[Eviction] = []
        with self._lock:
            self._committing_bytes -= st.nbytes
            # The manifest goes into place in the critical section that updates the catalog, so
            # overlapping commits of one rank (and evictions) change disk and catalog in one order.
            try:
                os.rename(tmp, rdir / MANIFEST_NAME)
            except OSError:
                tmp.unlink(missing_ok=True)
                for f in st.files.values():
                    (rdir / f"{f.name}.{save_id}").unlink(missing_ok=True)
                raise
            by_rank = self._catalog.setdefault(st.job, {}).setdefault(st.step, {})
            old = by_rank.get(st.rank)
            by_rank[st.rank] = man
            self._committed_bytes += man.nbytes
            for f in st.files.values():
                self._recyclable.add(rdir / f"{f.name}.{save_id}")
            if old is not None:
                self._committed_bytes -= old.nbytes
                self._release_files_locked(rdir, old)
            if pin:
                self._pins.setdefault((st.job, st.step), set()).add(pin)
            evictions = self._retain_locked(st.job)
        if self.fsync:
            fsync_path(rdir)
        self._notify(evictions)
        return man, evictions

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
            if self._recycle_bytes and now - self._last_begin > timeout:
                # No save for that long (the job ended or moved): give the pool's pages back.
                log.info("no save for %.0fs: releasing %d recycled bytes", now - self._last_begin, self._recycle_bytes)
                self._drop_recycle_locked(self._recycle_bytes)
            return len(expired)

    def open_saves(self) -> int:
        with self._lock:
            return len(self._open)

    # ----------------------------------------------------------------------------- reading

    def get(self, job: str, step: int, rank: int) -> Manifest | None:
        with self._lock:
            return self._catalog.get(job, {}).get(step, {}).get(rank)

    def lend(self, man: Manifest) -> list[Path]:
        """Paths of a rank's data files for a reader to map; they are never recycled afterwards."""
        rdir = self._rank_dir(man.job, man.step, man.rank)
        paths = [rdir / s.file for s in man.shards]
        with self._lock:
            self._recyclable.difference_update(paths)
        return paths

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._catalog)

    def steps(self, job: str) -> dict[int, dict[int, Manifest]]:
        """Snapshot: step -> rank -> manifest."""
        with self._lock:
            return {s: dict(r) for s, r in self._catalog.get(job, {}).items()}

    def complete_steps(self, job: str) -> list[int]:
        with self._lock:
            return self._complete_locked(job)

    def _complete_locked(self, job: str) -> list[int]:
        out = []
        for step, ranks in self._catalog.get(job, {}).items():
            world = next(iter(ranks.values())).world_size
            if self._is_complete(job, step, world, set(ranks)):
                out.append(step)
        return sorted(out)

    def usage(self) -> Usage:
        with self._lock:
            staging = sum(st.nbytes for st in self._open.values()) + self._committing_bytes
            return Usage(self.capacity, self._committed_bytes, staging, self._recycle_bytes)

    # ----------------------------------------------------------------------------- retention

    def pin(self, job: str, step: int, reason: str) -> None:
        """Protect a step from retention (e.g. "drain" while waiting for the persistent tier)."""
        with self._lock:
            self._pins.setdefault((job, step), set()).add(reason)

    def unpin(self, job: str, step: int, reason: str) -> None:
        with self._lock:
            reasons = self._pins.get((job, step))
            if reasons is not None:
                reasons.discard(reason)
                if not reasons:
                    del self._pins[(job, step)]
            evictions = self._retain_locked(job)
        self._notify(evictions)

    def apply_retention(self, job: str) -> list[Eviction]:
        with self._lock:
            evictions = self._retain_locked(job)
        self._notify(evictions)
        return evictions

    def _retain_locked(self, job: str) -> list[Eviction]:
        complete = self._complete_locked(job)
        # Steps older than the keep_local-th newest complete one go, complete or not: with
        # cluster-wide completeness, other nodes' retention may already have made them partial.
        if len(complete) < self.keep_local:
            return []
        oldest_kept = complete[-self.keep_local]
        out = []
        for step in sorted(self._catalog.get(job, {})):
            if step >= oldest_kept:
                break
            if (job, step) in self._pins:
                continue
            out.append(self._evict_locked(job, step, "retention"))
        return out

    def _make_room_locked(self, need: int) -> None:
        usage = Usage(self.capacity, self._committed_bytes,
                      sum(st.nbytes for st in self._open.values()) + self._committing_bytes, self._recycle_bytes)
        if need > self.capacity:
            raise CapacityError(f"shards: {need} bytes exceed local_capacity {self.capacity}")
        if usage.used + need <= self.capacity:
            return
        # 1) recycled files, 2) old steps already safe, 3) old steps still waiting to be drained.
        self._drop_recycle_locked(usage.used + need - self.capacity)
        evictions: list[Eviction] = []
        for allow_pinned in (False, True):
            for job, step in self._evictable_locked(allow_pinned):
                if self._used_locked() + need <= self.capacity:
                    break
                pinned = (job, step) in self._pins
                if pinned:
                    log.error("local tier full: evicting %s step %d before it was drained (%s)",
                              job, step, ",".join(sorted(self._pins[(job, step)])))
                    self.counters["evictions_capacity_undrained"] += 1
                    self._pins.pop((job, step), None)
                evictions.append(self._evict_locked(job, step, "capacity_undrained" if pinned else "capacity"))
                self._drop_recycle_locked(self._used_locked() + need - self.capacity)
        if evictions:
            threading.Thread(target=self._notify, args=(evictions,), daemon=True).start()
        if self._used_locked() + need > self.capacity:
            raise CapacityError(
                f"shards: {need} bytes do not fit in local_capacity {self.capacity} "
                f"({self._used_locked()} used by the newest complete and in-progress steps)"
            )

    def _used_locked(self) -> int:
        return (self._committed_bytes + sum(st.nbytes for st in self._open.values()) + self._committing_bytes
                + self._recycle_bytes)

    def _evictable_locked(self, allow_pinned: bool) -> list[tuple[str, int]]:
        """Steps that capacity may evict, oldest first: never a job's newest complete step nor
        a step newer than it (possibly still being saved)."""
        cands: list[tuple[float, str, int]] = []
        for job, steps in self._catalog.items():
            complete = self._complete_locked(job)
            if not complete:
                continue
            newest = complete[-1]
            for step, ranks in steps.items():
                if step >= newest:
                    continue
                if not allow_pinned and (job, step) in self._pins:
                    continue
                created = min(m.created for m in ranks.values())
                cands.append((created, job, step))
        return [(j, s) for _, j, s in sorted(cands)]

    def _evict_locked(self, job: str, step: int, reason: str) -> Eviction:
        ranks = self._catalog.get(job, {}).pop(step, {})
        for rank, man in ranks.items():
            self._committed_bytes -= man.nbytes
            rdir = self._rank_dir(job, step, rank)
            (rdir / MANIFEST_NAME).unlink(missing_ok=True)  # uncommit first
            self._release_files_locked(rdir, man)
            _rmdir_quiet(rdir)
        step_dir = self.root / "jobs" / job / f"{step:0{_STEP_W}d}"
        _rmdir_quiet(step_dir)
        if not self._catalog.get(job):
            self._catalog.pop(job, None)
            _rmdir_quiet(self.root / "jobs" / job)
        log.info("evicted %s step %d (%d ranks, %s)", job, step, len(ranks), reason)
        return Eviction(job, step, tuple(sorted(ranks)), reason)

    def remove_rank(self, job: str, step: int, rank: int, reason: str, *, generation: str | None = None) -> bool:
        """Remove one committed rank (e.g. a replica whose owner evicted the step); with
        ``generation``, only if the committed copy is still that save."""
        with self._lock:
            ranks = self._catalog.get(job, {}).get(step)
            if not ranks or rank not in ranks:
                return False
            if generation is not None and ranks[rank].generation != generation:
                return False
            man = ranks.pop(rank)
            self._committed_bytes -= man.nbytes
            rdir = self._rank_dir(job, step, rank)
            (rdir / MANIFEST_NAME).unlink(missing_ok=True)
            self._release_files_locked(rdir, man)
            _rmdir_quiet(rdir)
            if not ranks:
                del self._catalog[job][step]
                _rmdir_quiet(rdir.parent)
            log.info("removed %s step %d rank %d (%s)", job, step, rank, reason)
            return True

    def _release_files_locked(self, rdir: Path, man: Manifest) -> None:
        for s in man.shards:
            p = rdir / s.file
            if p in self._recyclable and s.size > 0:
                self._recyclable.discard(p)
                target = self.root / "recycle" / f"{s.size}.{secrets.token_hex(6)}"
                try:
                    os.rename(p, target)
                except OSError:
                    p.unlink(missing_ok=True)
                    continue
                self._recycle.setdefault(s.size, []).append(target)
                self._recycle_bytes += s.size
            else:
                p.unlink(missing_ok=True)

    def _drop_recycle_locked(self, need: int) -> None:
        for size in sorted(self._recycle, reverse=True):
            pool = self._recycle[size]
            while pool and need > 0:
                pool.pop().unlink(missing_ok=True)
                self._recycle_bytes -= size
                need -= size
        self._recycle = {k: v for k, v in self._recycle.items() if v}

    def _notify(self, evictions: Iterable[Eviction]) -> None:
        if self._on_evict is not None:
            for ev in evictions:
                self._on_evict(ev)


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _rmdir_if_empty(path: Path) -> None:
    if path.is_dir():
        _rmdir_quiet(path)
