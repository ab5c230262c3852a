"""``file:///dir``: a directory (local disk, NFS, Lustre, a mounted bucket) as the persistent tier."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from typing import BinaryIO, Callable, Iterator, Sequence

from tierckpt.common.fileio import fsync_path
from tierckpt.errors import NotFoundError, TierckptError

from .base import _TMP_MARK, Backend, BackendError, atomic_local_file, check_key, check_prefix, translate_errors

__all__ = ["FileBackend"]

_COPY_CHUNK = 16 << 20
_RETRYABLE_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.EIO, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.ENOSPC,
     errno.EDQUOT, errno.ENOLCK, errno.ECONNRESET, errno.ECONNREFUSED, errno.EHOSTUNREACH}
)
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _translate(e: BaseException, what: str) -> TierckptError:
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

    Args:
        root: Absolute path of the root directory; created on the first write.
        fsync: Flush files and directories (keep True unless the medium is not durable anyway).
        url: The URL to report (defaults to ``file://`` + root).
    """

    def __init__(self, root: str, *, fsync: bool = True, url: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = url or "file://" + self.root
        self._fsync = fsync

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _errors(self, op: str, key: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors((OSError,), _translate, f"{op} {self.url}/{key}")

    def _write(self, key: str, fill: Callable[[BinaryIO], object]) -> None:
        dst = self._path(key)
        parent, name = os.path.split(dst)
        tmp = os.path.join(parent, f"{name}{_TMP_MARK}{secrets.token_hex(4)}")
        with self._errors("put", key):
            for attempt in range(3):  # a concurrent delete may prune the directory we just made
                os.makedirs(parent, exist_ok=True)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
            try:
                with os.fdopen(fd, "wb") as out:
                    fill(out)
                    if self._fsync:
                        out.flush()
                        os.fsync(out.fileno())
                os.replace(tmp, dst)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            if self._fsync:
                fsync_path(parent)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.put_file`. A read error in the middle of the copy is a BackendError."""
        with open(path, "rb") as src:  # a missing or unreadable local file raises OSError here
            self._write(key, lambda out: shutil.copyfileobj(src, out, _COPY_CHUNK))

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`Backend.put_bytes`."""
        self._write(key, lambda out: out.write(data))

    @contextlib.contextmanager
    def _open_object(self, key: str) -> Iterator[BinaryIO]:
        src = self._path(key)
        with self._errors("get", key):
            fh = open(src, "rb")
        with fh:
            yield fh

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.get_file`."""
        with self._open_object(key) as src, atomic_local_file(path) as tmp, open(tmp, "wb") as out:
            with self._errors("read", key):
                shutil.copyfileobj(src, out, _COPY_CHUNK)

    def get_bytes(self, key: str) -> bytes:
        """See :meth:`Backend.get_bytes`."""
        with self._open_object(key) as src, self._errors("read", key):
            return src.read()

    def list(self, prefix: str = "") -> list[str]:
        """See :meth:`Backend.list`."""
        check_prefix(prefix)
        head, _, partial = prefix.rpartition("/")
        base = os.path.join(self.root, *head.split("/")) if head else self.root
        keys: list[str] = []

        def onerror(e: OSError) -> None:
            if not isinstance(e, _MISSING):
                raise e

        with self._errors("list", prefix):
            for dirpath, dirnames, filenames in os.walk(base, onerror=onerror):
                if dirpath == base:
                    dirnames[:] = [d for d in dirnames if d.startswith(partial)]
                rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
                for name in filenames:
                    if _TMP_MARK in name:
                        continue
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        keys.append(key)
        keys.sort()
        return keys

    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`Backend.delete`."""
        paths = [self._path(k) for k in keys]  # validate every key before deleting any
        for key, path in zip(keys, paths):
            with self._errors("delete", key):
                try:
                    os.unlink(path)
                except (FileNotFoundError, NotADirectoryError):
                    continue
            self._prune(os.path.dirname(path))

    def _prune(self, directory: str) -> None:
        """Remove ``directory`` and its parents below the root while they are empty."""
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (or already gone): stop climbing
                return
            directory = os.path.dirname(directory)

    def exists(self, key: str) -> bool:
        """See :meth:`Backend.exists`."""
        return os.path.isfile(self._path(key))
