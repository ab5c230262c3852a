"""File operations of the local tier that never follow a symbolic link below the local dir.

Trainers in the socket group can write into the local dir (they fill staging files), so anything
below it may be swapped for a symlink or a hard link at any moment. :class:`LocalDir` therefore:

- holds the root directory open and reaches every directory by walking one component at a time
  with ``openat(O_DIRECTORY | O_NOFOLLOW)`` relative to its parent's descriptor, so no check can
  race with a rename of a parent;
- opens files with ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC`` relative to their
  directory's descriptor, then checks with ``fstat`` on the open descriptor that it is a regular
  file (and its size, one link, where it matters) before anything reads or writes it: a FIFO,
  socket or device planted where a file should be never blocks the daemon (an open of a FIFO
  without a writer would wait forever) and is refused as :class:`UnsafeFileError`; every open of a
  file below the local dir, by name or by path, goes through :func:`open_checked`;
- renames, unlinks and removes trees relative to directory descriptors (``rename``/``unlink``
  never follow the last component; tree removal uses ``shutil.rmtree(dir_fd=...)``, which is
  symlink-attack resistant where ``shutil.rmtree.avoids_symlink_attacks`` is true, and is never
  pointed at a symlink itself);
- creates files 0640 and directories 0750 whatever the process umask (explicit mode + fchmod;
  a directory made in a setgid directory keeps the setgid bit, so the group of the root, the
  trainers' on Kubernetes, reaches everything below it).

A directory is named by a tuple of components below the root, e.g. ``("jobs", job, step)``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["LocalDir", "Rel", "FILE_MODE", "DIR_MODE", "STAGING_MODE", "fs_is_tmpfs", "UnsafeFileError",
           "check_regular", "digest_fd", "open_checked", "read_small_path"]

FILE_MODE = 0o640
DIR_MODE = 0o750
STAGING_MODE = 0o660
"""Staging files only: the trainers of the socket group write into them (zero-copy saves); the
commit takes group write away (FILE_MODE) before the file is published."""
Rel = Sequence[str]
"""A directory below the root, as path components (``()`` is the root itself)."""

_NEVER_BLOCK = os.O_NONBLOCK | os.O_NOCTTY
"""On every open below the local dir: opening a FIFO (no writer) or a device may otherwise wait
forever; the file type is checked on the descriptor right after, and O_NONBLOCK cleared again."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NEVER_BLOCK
_SAFE = os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_FILE = (errno.ENXIO, errno.ENODEV, errno.EWOULDBLOCK, errno.EOPNOTSUPP)
"""What an open of a socket (ENXIO), a FIFO opened for writing without a reader (ENXIO) or a
device without its driver fails with: the entry is not a file the store made."""


class UnsafeFileError(OSError):
    """A file below the local dir is not what the store made: a symlink, not a regular file,
    linked elsewhere, or of the wrong size."""


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


def check_regular(fd: int, what: str, *, size: int | None = None, single_link: bool = False) -> os.stat_result:
    """fstat an open descriptor: a regular file (of ``size`` bytes; with one link).

    Raises:
        UnsafeFileError: it is not.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EINVAL, f"{what} is not a regular file")
    if single_link and st.st_nlink != 1:
        raise UnsafeFileError(errno.EMLINK, f"{what} has {st.st_nlink} links (linked from elsewhere)")
    if size is not None and st.st_size != size:
        raise UnsafeFileError(errno.EINVAL, f"{what} has {st.st_size} bytes, expected {size}")
    return st


def open_checked(name: str | os.PathLike, flags: int, what: str, *, dir_fd: int | None = None,
                 mode: int = FILE_MODE, size: int | None = None, single_link: bool = False) -> int:
    """Open a regular file without following a final link and without ever blocking, then check it.

    The one place every file below the local dir is opened (by :class:`LocalDir` relative to a
    directory descriptor, by the persistent tier by path): ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY``,
    then :func:`check_regular` on the descriptor (a FIFO, socket or device is refused before a
    byte is read or written), then O_NONBLOCK is cleared (a no-op for regular files).

    Raises:
        FileNotFoundError: it does not exist (and ``flags`` has no O_CREAT).
        UnsafeFileError: a symlink, a FIFO, socket or device, of the wrong size or linked elsewhere.
    """
    try:
        fd = os.open(name, flags | _SAFE | _NEVER_BLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(e.errno, f"{what} is a symlink") from None
        if e.errno in _NOT_A_FILE:
            raise UnsafeFileError(e.errno, f"{what} is not a regular file (a FIFO, socket or device)") from None
        raise
    try:
        check_regular(fd, what, size=size, single_link=single_link)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_path(path: str | os.PathLike, limit: int) -> bytes:
    """The whole of a small regular file at ``path`` (at most ``limit`` bytes), opened with
    :func:`open_checked`.

    Raises:
        FileNotFoundError, UnsafeFileError: see :func:`open_checked`; UnsafeFileError also when
            it is larger than ``limit``.
    """
    fd = open_checked(path, os.O_RDONLY, os.fspath(path))
    try:
        return _read_all(fd, limit, os.fspath(path))
    finally:
        os.close(fd)


def _read_all(fd: int, limit: int, what: str) -> bytes:
    st = os.fstat(fd)
    if st.st_size > limit:
        raise UnsafeFileError(errno.EFBIG, f"{what} is larger than {limit} bytes")
    chunks, total = [], 0
    while total <= st.st_size:
        b = os.read(fd, st.st_size + 1 - total)
        if not b:
            break
        chunks.append(b)
        total += len(b)
    return b"".join(chunks)


def digest_fd(fd: int, size: int) -> str:
    """Checksum of the first ``size`` bytes of an open file, hashed through a populated read-only map."""
    import mmap

    from tierckpt.common import checksum as _checksum

    if size == 0:
        return _checksum.digest(b"")
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ) as mm:
        return _checksum.digest(mm)


def _is_symlink_error(e: OSError) -> bool:
    return e.errno in (errno.ELOOP, errno.ENOTDIR)


class LocalDir:
    """The local dir's root, held open; every operation stays below it without following a link.

    Args:
        root: absolute path of the local dir. Its parents are the administrator's and are
            followed; the root itself must not be a symlink.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None

    def open(self) -> None:
        """Create the root (0750) if needed and hold it open.

        Raises:
            UnsafeFileError: the root is a symlink or not a directory.
        """
        try:
            os.mkdir(self.root, DIR_MODE)
            created = True
        except FileExistsError:
            created = False
        except FileNotFoundError:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(self.root, DIR_MODE)
            created = True
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            if _is_symlink_error(e):
                raise UnsafeFileError(e.errno, f"{self.root} is a symlink or not a directory") from None
            raise
        if created:
            os.fchmod(fd, DIR_MODE)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("LocalDir is not open")
        return self._fd

    def path(self, rel: Rel, name: str | None = None) -> Path:
        """The path a client (or a log) sees; never used by the store to open anything."""
        p = self.root.joinpath(*rel)
        return p / name if name is not None else p

    # -- directories

    @contextlib.contextmanager
    def dir(self, rel: Rel, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory ``rel``, reached without following a link (closed on exit).

        Args:
            create: make missing components (0750).

        Raises:
            FileNotFoundError: a component is missing (and ``create`` is false).
            UnsafeFileError: a component is a symlink or not a directory.
        """
        fd = os.dup(self.fd)
        try:
            for name in rel:
                nxt = self._open_child_dir(fd, name, create)
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def child(self, parent: int, name: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory ``name`` in ``parent`` (closed on exit); see :meth:`dir`."""
        fd = self._open_child_dir(parent, name, create)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open_child_dir(parent: int, name: str, create: bool) -> int:
        made = False
        if create:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=parent)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if _is_symlink_error(e):
                raise UnsafeFileError(e.errno, f"{name} is a symlink or not a directory") from None
            raise
        if made:  # keep the setgid bit a setgid parent passed on (the group stays the socket group's)
            os.fchmod(fd, DIR_MODE | (os.fstat(fd).st_mode & stat.S_ISGID))
        return fd

    def entries(self, dir_fd: int) -> list[tuple[str, str]]:
        """(name, kind) of every entry; kind is "dir", "file" or "other" (symlinks are "other")."""
        out = []
        with os.scandir(dir_fd) as it:
            for e in it:
                if e.is_symlink():
                    kind = "other"
                elif e.is_dir(follow_symlinks=False):
                    kind = "dir"
                elif e.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                out.append((e.name, kind))
        return out

    # -- files

    @staticmethod
    def create(dir_fd: int, name: str, size: int = 0, mode: int = FILE_MODE) -> int:
        """Create ``name`` exclusively (``mode``, default 0640), sized to ``size``; returns a read-write descriptor."""
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _SAFE, mode, dir_fd=dir_fd)  # new: never a FIFO
        try:
            os.fchmod(fd, mode)
            if size:
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def open_regular(dir_fd: int, name: str, flags: int, what: str, *, size: int | None = None,
                     single_link: bool = False) -> int:
        """Open an existing regular file without following a link, and check it (see :func:`check_regular`).

        Raises:
            FileNotFoundError: it does not exist.
            UnsafeFileError: a symlink, not a regular file, of the wrong size or linked elsewhere.
        """
        return open_checked(name, flags, what, dir_fd=dir_fd, size=size, single_link=single_link)

    @staticmethod
    def same_file(dir_fd: int, name: str, st: os.stat_result) -> bool:
        """Whether entry ``name`` (not followed) is the file ``st`` describes."""
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) and stat.S_ISREG(now.st_mode)

    def read_small(self, dir_fd: int, name: str, limit: int) -> bytes:
        """The whole of a small regular file (a manifest), at most ``limit`` bytes."""
        fd = self.open_regular(dir_fd, name, os.O_RDONLY, name)
        try:
            return _read_all(fd, limit, name)
        finally:
            os.close(fd)

    def write_temp(self, dir_fd: int, name: str, data: bytes, *, fsync: bool) -> str:
        """Write ``data`` under a fresh temporary name next to ``name``; returns that name."""
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = self.create(dir_fd, tmp)
        try:
            with os.fdopen(fd, "wb", closefd=False) as fh:
                fh.write(data)
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.unlink(dir_fd, tmp)
            raise
        os.close(fd)
        return tmp

    def atomic_write(self, dir_fd: int, name: str, data: bytes, *, fsync: bool) -> None:
        """Publish ``data`` as ``name`` by rename (replaces whatever entry had the name, links included)."""
        tmp = self.write_temp(dir_fd, name, data, fsync=fsync)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if fsync:
            os.fsync(dir_fd)

    # -- removal

    @staticmethod
    def unlink(dir_fd: int, name: str) -> None:
        """Remove an entry that is not a directory (a symlink itself, never its target); quiet if missing."""
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass

    @staticmethod
    def rmdir(dir_fd: int, name: str) -> bool:
        """Remove an empty directory; False if it is not empty, missing, or not a directory."""
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return True
        except OSError:
            return False

    @staticmethod
    def remove_tree(dir_fd: int, name: str) -> None:
        """Remove ``name`` and, if it is a real directory, everything below it; a symlink is removed
        as a link (its target is never touched). Quiet if missing."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            LocalDir.unlink(dir_fd, name)
            return
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every Linux Python has it
            raise OSError(errno.ENOTSUP, "this platform's shutil.rmtree is not symlink-attack resistant")
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
