"""Start-up of the local tier: the local_dir lock, reclaiming leftovers, rebuilding the catalog.

Rules:

- ``.lock`` is opened without following a link and must be a regular file with one link
  before it is truncated; otherwise the daemon refuses to start (ConfigError).
- Staging and recycle leftovers of a previous run are removed; a symlink is removed as a link.
- A rank directory without a manifest holds no committed data and is removed.
- A rank directory whose manifest fails a rule (malformed, names another location, a data file
  missing, of the wrong size, not a regular file, or linked elsewhere) is never deleted: it is
  moved to ``quarantine/<job>/<step>/<rank>.<id>``, logged as an error and counted.
- Anything in ``jobs/`` that is not a real directory where one is expected (a symlink, a file,
  a FIFO) is removed as an entry; a link's target is never touched.
- Nothing is opened in a way that can block: a FIFO, socket or device where a manifest or a data
  file should be fails the rank's rules (quarantined, like any other failure), one in
  ``staging/`` or ``recycle/`` is removed, one under a top-level directory's name is moved aside
  (see :func:`prepare_local_dir`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.errors import DataLossError

from .eviction import charge
from .localfs import LocalDir, UnsafeFileError, open_checked
from .manifest import MANIFEST_NAME, Manifest
from .policies import POLICY_DIR

if TYPE_CHECKING:
    from .index import Catalog
    from .policies import JobPolicies
    from .recycle import RecyclePool

__all__ = ["default_capacity", "write_fs_token", "take_dir_lock", "reclaim_staging", "scan_jobs", "rebuild",
           "ScanResult", "QUARANTINE_DIR", "MAX_MANIFEST_BYTES"]

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
        fd = open_checked(".lock", os.O_CREAT | os.O_RDWR, f"{fs.root}/.lock", dir_fd=fs.fd, mode=0o640,
                          single_link=True)
    except UnsafeFileError as e:
        raise ConfigError(f"local_dir: {e.strerror}; refusing to use it as the lock") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"local_dir: {fs.root} is in use by another tierckptd (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


TOP_DIRS = ("staging", "recycle", "reserve", "jobs", QUARANTINE_DIR, POLICY_DIR, "drain-queue", "parity")
"""The directories directly below the local dir (``drain-queue`` is the persistent tier's queue,
``reserve`` the pre-touched memory of :mod:`.reserve`, ``parity`` the parity slots held for other
nodes: :mod:`tierckptd.parity.slots`)."""


def default_capacity(fs: LocalDir) -> int:
    """``capacity = 0``: 90% of the local dir's file system size."""
    st = os.statvfs(fs.fd)
    return int(st.f_blocks * st.f_frsize * 0.9)


def fit_reserve(target: int, capacity: int, explicit: bool, root: object) -> int:
    """The reserve a local tier of ``capacity`` bytes holds for a ``local_reserve`` of ``target``.
    The shipped configs size the reserve for a typical node: a smaller local dir whose capacity is
    the default keeps the daemon starting, with half its capacity held (a warning says so).

    Raises:
        ConfigError: ``target`` exceeds an ``explicit`` capacity (naming ``local_reserve``).
    """
    if target <= capacity:
        return target
    if explicit:
        from ..config import ConfigError

        raise ConfigError(f"local_reserve: {target} bytes exceed the local tier's capacity ({capacity} bytes), "
                          "which must hold it")
    log.warning("local_reserve: %d bytes exceed the local tier's capacity (%d bytes, 90%% of %s); holding %d bytes "
                "instead: set local_reserve to (keep_local + 1) x this node's checkpoint", target, capacity, root,
                capacity // 2)
    return capacity // 2


def write_fs_token(fs: LocalDir) -> str:
    """A new random ``.fs-token`` in the local dir: a client that reads the same token shares the
    daemon's files (the fast path). Returns the token."""
    token = secrets.token_hex(16)
    fs.atomic_write(fs.fd, ".fs-token", token.encode(), fsync=False)
    return token


def prepare_local_dir(fs: LocalDir, counters: dict[str, int] | None = None) -> int:
    """Open the local dir, take its lock and make sure its top-level directories are real
    directories; returns the lock fd. Anything else found under one of their names (a symlink,
    a FIFO, a socket, a file) is moved aside to ``.<name>.unsafe.<id>`` (kept for the operator,
    logged as a warning) and a fresh directory made: it cannot stall or redirect the start-up.

    Raises:
        ConfigError: another live daemon holds the dir, or the dir or its ``.lock`` is a symlink
            or not what the store made.
    """
    from ..config import ConfigError

    try:
        fs.open()
        lock_fd = take_dir_lock(fs)
    except UnsafeFileError as e:
        raise ConfigError(f"local_dir: {fs.root}: {e.strerror}; refusing to follow a symlink") from None
    mode = os.fstat(fs.fd).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        log.warning("local_dir %s is mode %o: its group or others may rename or replace the daemon's directories "
                    "(jobs/, staging/, ...); make it 2750 (trainers need no write permission on directories)",
                    fs.root, stat.S_IMODE(mode))
    for sub in TOP_DIRS:
        try:
            with fs.dir((sub,), create=True):
                continue
        except UnsafeFileError:
            aside = f".{sub}.unsafe.{secrets.token_hex(4)}"
            os.rename(sub, aside, src_dir_fd=fs.fd, dst_dir_fd=fs.fd)
            log.warning("local dir: %s/%s is not a directory (a link, FIFO, socket or file); moved aside to %s",
                        fs.root, sub, aside)
            if counters is not None:
                counters["quarantined"] = counters.get("quarantined", 0) + 1
        with fs.dir((sub,), create=True):
            pass
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
        except OSError as e:  # UnsafeFileError: a link, FIFO, socket or device; or unreadable
            return "quarantine", e.strerror or str(e)
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
