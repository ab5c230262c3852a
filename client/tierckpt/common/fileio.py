"""Small file primitives shared by the client and the daemon: full pwrite, checksum of a file,
and the write-temp / fsync / rename steps of the commit protocol."""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

from . import checksum as _checksum

__all__ = ["pwrite_all", "digest_file", "fsync_path", "write_temp", "atomic_write"]


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (a pwrite may write less than asked)."""
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def digest_file(path: str | os.PathLike, size: int) -> str:
    """Checksum of the first ``size`` bytes of a file, hashed through a populated read-only map."""
    if size == 0:
        return _checksum.digest(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ) as mm:
            return _checksum.digest(mm)
    finally:
        os.close(fd)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(path: Path, data: bytes, *, fsync: bool) -> Path:
    """Write ``data`` next to ``path`` under a temporary name (exclusive create), for a later rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "xb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    return tmp


def atomic_write(path: Path, data: bytes, *, fsync: bool) -> None:
    """Publish ``data`` at ``path`` by rename: readers see the old content or the new, never a part."""
    tmp = write_temp(path, data, fsync=fsync)
    os.rename(tmp, path)
    if fsync:
        fsync_path(path.parent)
