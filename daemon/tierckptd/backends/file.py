"""``file:///dir``: a directory (local disk, NFS, Lustre, a mounted bucket) as the persistent tier."""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from tierckpt.errors import NotFoundError, TierckptError

from .. import libc
from ..local.localfs import open_checked
from .base import (
    _TMP_MARK,
    Backend,
    BackendError,
    atomic_local_file,
    check_key,
    check_limit,
    check_prefix,
    read_exactly,
    translate_errors,
)

__all__ = ["FileBackend"]

_COPY_CHUNK = 16 << 20
_PACE_PIECE = 1 << 20
_SYNC_FILE_RANGE = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: this range on the medium, no cache flush


def _write_out(fd: int, offset: int, length: int) -> None:
    """Write ``[offset, offset + length)`` of ``fd`` out to the medium now (``sync_file_range``;
    the final ``fsync`` still makes it durable and reports any error). Where it is missing, the
    ``fsync`` does it all."""
    with contextlib.suppress(OSError):
        libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE)


_RETRYABLE_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.EIO, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.ENOSPC,
     errno.EDQUOT, errno.ENOLCK, errno.ECONNRESET, errno.ECONNREFUSED, errno.EHOSTUNREACH}
)
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o640
_DIR_MODE = 0o750


class _LinkRefused(OSError):
    """A symlink (or a non-directory where a directory is expected) below the root."""


def _translate(e: BaseException, what: str) -> TierckptError:
    if isinstance(e, _LinkRefused):
        return BackendError(f"{what}: {e.strerror}", retryable=False)
    if isinstance(e, _MISSING) and what.startswith("get"):
        return NotFoundError(f"{what}: no such object")
    code = getattr(e, "errno", None)
    return BackendError(f"{what}: {e}", retryable=code in _RETRYABLE_ERRNOS)


class FileBackend(Backend):
    """Objects are files below ``root``; a key's ``/`` separates directories.

    Writes go to a uniquely named temporary file in the destination directory (exclusive create),
    are flushed with ``fsync`` and renamed onto the final name, then the directory is fsynced, so
    a crash leaves either the old object or the new one, never a partial one. Temporary names
    contain ``.tierckpt-tmp-``; listings skip them and keys may not contain it. Directories left
    empty by ``delete`` are removed.

    No symlink below the root is followed: directories are walked one component at a time with
    ``openat(O_DIRECTORY | O_NOFOLLOW)`` and files opened with ``O_NOFOLLOW``, so a key can never
    resolve outside the root (a link met on the way is a non-retryable BackendError). Files are
    created 0640 and directories 0750 whatever the umask. The root itself is the operator's path.

    Args:
        root: Absolute path of the root directory; created on the first write.
        fsync: Flush files and directories (keep True unless the medium is not durable anyway).
        url: The URL to report (defaults to ``file://`` + root).
    """

    def __init__(self, root: str, *, fsync: bool = True, url: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = url or "file://" + self.root
        self._fsync = fsync
        self.pace: Callable[[], None] | None = None
        """Called between the pieces of a :meth:`put_bytes` (the drain waits there while a save is
        open on the node, ``KNOBS.drain_yield``); each piece is written out to the medium before
        it, so no upload's I/O runs through a save that began after its piece."""

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _errors(self, op: str, key: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors((OSError,), _translate, f"{op} {self.url}/{key}")

    @contextlib.contextmanager
    def _dir(self, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of root/parts, reached without following a link below the root."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in parts:
                made = False
                if create:
                    try:
                        os.mkdir(name, _DIR_MODE, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _LinkRefused(e.errno,
                                           f"{name!r} below the root is a symlink or not a directory") from None
                    raise
                if made:
                    os.fchmod(nxt, _DIR_MODE)
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open_file(dir_fd: int, name: str, flags: int, mode: int = _FILE_MODE) -> int:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _LinkRefused(e.errno, f"{name!r} below the root is a symlink") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _LinkRefused(errno.EINVAL, f"{name!r} below the root is not a regular file")
        return fd

    def _write(self, key: str, fill: Callable[[BinaryIO], object], pace: Callable[[], None] | None = None) -> None:
        *parents, name = check_key(key).split("/")
        tmp = f"{name}{_TMP_MARK}{secrets.token_hex(4)}"
        with self._errors("put", key):
            for attempt in range(3):  # a concurrent delete may prune the directory we just made
                try:
                    with self._dir(parents, create=True) as dfd:
                        self._put_in(dfd, tmp, name, fill, pace)
                    return
                except FileNotFoundError:
                    if attempt == 2:
                        raise

    def _put_in(self, dfd: int, tmp: str, name: str, fill: Callable[[BinaryIO], object],
                pace: Callable[[], None] | None = None) -> None:
        fd = self._open_file(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.fchmod(fd, _FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                fill(out)
                if self._fsync:
                    out.flush()
                    if pace is not None:  # a journal commit is disk and CPU work too: not during a save
                        pace()
                    os.fsync(out.fileno())
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces an entry, never follows it
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if self._fsync:
            if pace is not None:
                pace()
            os.fsync(dfd)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.put_file`. A read error in the middle of the copy is a BackendError.

        ``path`` is opened without following a symlink in its last component and must be a
        regular file (the local tier's data files are; a swapped one is refused, not uploaded).
        """
        fd = open_checked(path, os.O_RDONLY, os.fspath(path))  # missing/unreadable/a FIFO: OSError here
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{os.fspath(path)} is not a regular file")
        with os.fdopen(fd, "rb") as src:
            self._write(key, lambda out: shutil.copyfileobj(src, out, _COPY_CHUNK))

    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        """See :meth:`Backend.put_stream`."""
        def fill(out: BinaryIO) -> None:
            for data in read_exactly(src, size, _COPY_CHUNK):
                out.write(data)

        self._write(key, fill)

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`Backend.put_bytes`."""
        pace = self.pace
        if pace is None or not self._fsync:
            self._write(key, lambda out: out.write(data))
            return

        def paced(out: BinaryIO) -> None:
            view = memoryview(data).cast("B")
            for off in range(0, len(view), _PACE_PIECE):
                pace()
                out.write(view[off:off + _PACE_PIECE])
                out.flush()
                _write_out(out.fileno(), off, len(view[off:off + _PACE_PIECE]))

        self._write(key, paced, pace)

    @contextlib.contextmanager
    def _open_object(self, key: str) -> Iterator[BinaryIO]:
        *parents, name = check_key(key).split("/")
        with self._errors("get", key):
            with self._dir(parents) as dfd:
                fh = os.fdopen(self._open_file(dfd, name, os.O_RDONLY), "rb")
        with fh:
            yield fh

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.get_file`."""
        with self._open_object(key) as src, atomic_local_file(path) as tmp, open(tmp, "xb") as out:
            os.fchmod(out.fileno(), _FILE_MODE)
            with self._errors("read", key):
                shutil.copyfileobj(src, out, _COPY_CHUNK)

    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        """See :meth:`Backend.get_bytes`."""
        with self._open_object(key) as src:
            check_limit(f"get {self.url}/{key}", os.fstat(src.fileno()).st_size, limit)
            with self._errors("read", key):
                data = src.read() if limit is None else src.read(limit + 1)
        check_limit(f"get {self.url}/{key}", len(data), limit)
        return data

    def list(self, prefix: str = "") -> list[str]:
        """See :meth:`Backend.list`. Symlinks below the root are neither listed nor descended."""
        check_prefix(prefix)
        head, _, partial = prefix.rpartition("/")
        parts = head.split("/") if head else []
        keys: list[str] = []
        with self._errors("list", prefix):
            try:
                with self._dir(parts) as base:
                    for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=base, follow_symlinks=False):
                        if dirpath == ".":
                            dirnames[:] = [d for d in dirnames if d.startswith(partial)]
                        rel = dirpath[2:] if dirpath.startswith("./") else ""
                        for name in filenames:
                            if _TMP_MARK in name or not _is_regular(dfd, name):
                                continue
                            key = "/".join(p for p in (head, rel, name) if p)
                            if key.startswith(prefix):
                                keys.append(key)
            except _MISSING:
                pass
        keys.sort()
        return keys

    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`Backend.delete`."""
        split = [check_key(k).split("/") for k in keys]  # validate every key before deleting any
        for key, (*parents, name) in zip(keys, split):
            with self._errors("delete", key):
                try:
                    with self._dir(parents) as dfd:
                        os.unlink(name, dir_fd=dfd)  # a link is removed as a link
                except (FileNotFoundError, NotADirectoryError, _LinkRefused):
                    continue
            self._prune(parents)

    def _prune(self, parents: builtins.list[str]) -> None:
        """Remove the key's directories below the root, deepest first, while they are empty."""
        while parents:
            *up, name = parents
            try:
                with self._dir(up) as dfd:
                    os.rmdir(name, dir_fd=dfd)
            except OSError:  # not empty (or already gone, or a link): stop climbing
                return
            parents = up

    def remove_stale_temporaries(self, older_than: float) -> int:
        """Unlink ``*.tierckpt-tmp-*`` files below the root not modified for ``older_than`` seconds
        (a daemon killed mid-upload leaves them; a live upload writes to its file continuously)."""
        removed = 0
        cutoff = time.time() - older_than
        with self._errors("clean", ""):
            try:
                with self._dir([]) as base:
                    for _, _, filenames, dfd in os.fwalk(".", dir_fd=base, follow_symlinks=False):
                        for name in filenames:
                            if _TMP_MARK in name and _older(dfd, name, cutoff):
                                with contextlib.suppress(FileNotFoundError):
                                    os.unlink(name, dir_fd=dfd)
                                    removed += 1
            except _MISSING:
                pass
        return removed

    def exists(self, key: str) -> bool:
        """See :meth:`Backend.exists`."""
        *parents, name = check_key(key).split("/")
        try:
            with self._dir(parents) as dfd:
                return _is_regular(dfd, name)
        except OSError:
            return False


def _older(dir_fd: int, name: str, cutoff: float) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff


def _is_regular(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
