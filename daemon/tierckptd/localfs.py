"""File-system helpers of the local tier."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fs_is_tmpfs", "rmdir_quiet", "rmdir_if_empty"]


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


def rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def rmdir_if_empty(path: Path) -> None:
    if path.is_dir():
        rmdir_quiet(path)
