"""Start-up of the local tier: the local_dir lock, reclaiming leftovers, rebuilding the catalog.

Rules:

- ``.lock`` is opened without following a link and must be a regular file with one link
  before it is truncated; otherwise the daemon refuses to start (ConfigError).
- Staging and recycle leftovers of a previous run are removed; a symlink is removed as a link.
- A rank directory without a manifest holds no committed data and is removed.
- A rank directory whose manifest fails a rule (malformed, names another location, a data file
  missing, of the wrong size, not a regular file, or linked elsewhere) is never deleted: it is
  moved to ``quarantine/<job>/<step>/<rank>.<id>``, logged as an error and counted.
- Anything in ``jobs/`` that is not a real directory where one is expected (a symlink, a file)
  is removed as an entry; a link's target is never touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.errors import DataLossError

from .eviction import charge
from .localfs import LocalDir, UnsafeFileError, check_regular
from .manifest import MANIFEST_NAME, Manifest

if TYPE_CHECKING:
    from .index import Catalog
    from .policies import JobPolicies
    from .recycle import RecyclePool

__all__ = ["take_dir_lock", "reclaim_staging", "scan_jobs", "rebuild", "ScanResult", "QUARANTINE_DIR",
           "MAX_MANIFEST_BYTES"]

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
MAX_MANIFEST_BYTES = 64 << 20
RankRel = Callable[[str, int, int], tuple[str, ...]]


def take_dir_lock(fs: LocalDir) -> int:
    """Lock ``.lock`` for this process and record its pid; returns the descriptor to keep open.

    Raises:
        ConfigError: another live daemon holds the lock, or ``.lock`` is a symlink, not a
            regular file, or linked elsewhere (truncating it would damage another file).
    """
    from ..config import ConfigError

    try:
        fd = os.open(".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=fs.fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"local_dir: {fs.root}/.lock is a symlink; refusing to follow it") from None
        raise
    try:
        check_regular(fd, f"{fs.root}/.lock", single_link=True)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except UnsafeFileError as e:
        os.close(fd)
        raise ConfigError(f"local_dir: {e.strerror}; refusing to use it as the lock") from None
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"local_dir: {fs.root} is in use by another tierckptd (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def prepare_local_dir(fs: LocalDir) -> int:
    """Open the local dir, take its lock and create its top-level directories; returns the lock fd.

    Raises:
        ConfigError: another live daemon holds the dir, or the dir, its ``.lock`` or a top-level
            directory is a symlink.
    """
    from ..config import ConfigError

    try:
        fs.open()
        lock_fd = take_dir_lock(fs)
        for sub in ("staging", "recycle", "jobs", QUARANTINE_DIR):
            with fs.dir((sub,), create=True):
                pass
    except UnsafeFileError as e:
        raise ConfigError(f"local_dir: {fs.root}: {e.strerror}; refusing to follow a symlink") from None
    return lock_fd


def reclaim_staging(fs: LocalDir) -> int:
    """Remove every staging leftover of a previous run; returns how many."""
    n = 0
    with fs.dir(("staging",), create=True) as sfd:
        for name, _kind in fs.entries(sfd):
            fs.remove_tree(sfd, name)
            n += 1
    if n:
        log.info("reclaimed %d staging leftovers of a previous run", n)
    return n


@dataclass
class ScanResult:
    manifests: list[Manifest] = field(default_factory=list)
    dropped: int = 0  # uncommitted rank directories removed
    quarantined: int = 0
    stray: int = 0  # entries that were not directories (links, files) removed
    links: dict[tuple[str, int, int], dict[str, tuple[int, int]]] = field(default_factory=dict)
    # rank -> file -> inode of its data files with more than one link (shared across steps, see links.py)


def scan_jobs(fs: LocalDir, rank_rel: RankRel) -> ScanResult:
    """Walk ``jobs/<job>/<step>/<rank>`` without following links; load, drop or quarantine each rank."""
    res = ScanResult()
    with fs.dir(("jobs",), create=True) as jfd:
        for job, step, sfd in _step_dirs(fs, jfd, res):
            for rank, kind in fs.entries(sfd):
                if kind != "dir":
                    _stray(fs, sfd, f"jobs/{job}/{step}/{rank}", res)
                    continue
                _scan_rank(fs, sfd, ("jobs", job, step, rank), rank_rel, res)
    return res


def rebuild(fs: LocalDir, catalog: Catalog, recycle: RecyclePool, policies: JobPolicies,
            rank_rel: RankRel, counters: dict[str, int]) -> ScanResult:
    """Reclaim staging and recycle leftovers, load the job policies and add every committed rank
    to ``catalog`` (``counters``: ``staging_reclaimed``, ``quarantined``)."""
    counters["staging_reclaimed"] += reclaim_staging(fs)
    recycle.clear_directory()
    policies.load(fs)
    res = scan_jobs(fs, rank_rel)
    for man in res.manifests:
        catalog.add(man, charge(man), res.links.get(man.key))
    counters["quarantined"] += res.quarantined
    return res


def _step_dirs(fs: LocalDir, jfd: int, res: ScanResult):
    """Yield (job, step, step dir fd) for every real step directory; prune empty ones afterwards."""
    for job, kind in fs.entries(jfd):
        if kind != "dir":
            _stray(fs, jfd, f"jobs/{job}", res)
            continue
        with _child_or_none(fs, jfd, job) as jd:
            if jd is None:
                continue
            for step, skind in fs.entries(jd):
                if skind != "dir":
                    _stray(fs, jd, f"jobs/{job}/{step}", res)
                    continue
                with _child_or_none(fs, jd, step) as sd:
                    if sd is not None:
                        yield job, step, sd
                fs.rmdir(jd, step)  # only if empty
        fs.rmdir(jfd, job)


class _child_or_none:
    """``with _child_or_none(fs, parent, name) as fd``: fd is None if the entry is gone or unsafe."""

    def __init__(self, fs: LocalDir, parent: int, name: str) -> None:
        self.fs, self.parent, self.name = fs, parent, name
        self.fd: int | None = None

    def __enter__(self) -> int | None:
        try:
            self.fd = self.fs._open_child_dir(self.parent, self.name, False)
        except (FileNotFoundError, UnsafeFileError):
            self.fd = None
        return self.fd

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _stray(fs: LocalDir, parent: int, where: str, res: ScanResult) -> None:
    log.warning("removing %s: not a directory (a link or a file where the store keeps directories)", where)
    fs.unlink(parent, where.rsplit("/", 1)[-1])
    res.stray += 1


def _scan_rank(fs: LocalDir, sfd: int, rel: tuple[str, ...], rank_rel: RankRel, res: ScanResult) -> None:
    where = "/".join(rel)
    with _child_or_none(fs, sfd, rel[-1]) as rfd:
        if rfd is None:
            return
        verdict, detail = _check_rank_dir(fs, rfd, rel, rank_rel)
    if verdict == "ok":
        man, linked = detail
        res.manifests.append(man)
        if linked:
            res.links[man.key] = linked
    elif verdict == "uncommitted":
        fs.remove_tree(sfd, rel[-1])
        res.dropped += 1
    else:
        _quarantine(fs, sfd, rel, detail)
        res.quarantined += 1
        log.error("quarantined %s: %s (moved to %s/, not deleted)", where, detail, QUARANTINE_DIR)


def _check_rank_dir(fs: LocalDir, rfd: int, rel: tuple[str, ...], rank_rel: RankRel):
    """("ok", manifest) | ("uncommitted", reason) | ("quarantine", reason)."""
    try:
        man = Manifest.from_json(fs.read_small(rfd, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return "uncommitted", "no manifest"
    except (OSError, DataLossError) as e:
        return "quarantine", f"manifest unreadable: {e}"
    if rank_rel(man.job, man.step, man.rank) != rel:
        return "quarantine", "the manifest names another location"
    linked: dict[str, tuple[int, int]] = {}  # a file of an unchanged shard may be shared with other steps
    for s in man.shards:
        try:
            fd = fs.open_regular(rfd, s.file, os.O_RDONLY, s.file, size=s.size)
        except FileNotFoundError:
            return "quarantine", f"{s.file} is missing"
        except UnsafeFileError as e:
            return "quarantine", e.strerror
        st = os.fstat(fd)
        os.close(fd)
        if st.st_nlink > 1:
            linked[s.file] = (st.st_dev, st.st_ino)
    keep = {s.file for s in man.shards} | {MANIFEST_NAME}
    for name, _kind in fs.entries(rfd):
        if name not in keep:  # data of an interrupted re-save, or a temp manifest
            fs.remove_tree(rfd, name)
    return "ok", (man, linked)


def _quarantine(fs: LocalDir, sfd: int, rel: tuple[str, ...], reason: str) -> None:
    _, job, step, rank = rel
    tag = secrets.token_hex(4)
    target = f"{rank}.{tag}" if len(rank) + len(tag) < 255 else tag
    with fs.dir((QUARANTINE_DIR, job, step), create=True) as qfd:
        os.rename(rank, target, src_dir_fd=sfd, dst_dir_fd=qfd)
