"""The few C library calls Python's ``os`` module lacks, through ``ctypes`` (which releases the GIL
for the length of each call, unlike ``mmap.madvise``: bench/README.md "Session of 2026-12-07,
15:51 UTC").

Loaded once, with every function's argument types declared here. Each wrapper raises
``OSError`` with the call's errno; where the C library cannot be loaded (not Linux), ``OSError``
with ``EOPNOTSUPP``, which callers already treat as "this filesystem or kernel cannot".
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

__all__ = ["PR_SET_PDEATHSIG", "available", "fallocate", "madvise", "prctl", "sync_file_range"]

PR_SET_PDEATHSIG = 1


@functools.cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return lib
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has them
        return None


def available() -> bool:
    """Whether the C library and every function here could be loaded."""
    return _lib() is not None


def _call(name: str, *args: int) -> None:
    lib = _lib()
    if lib is None:  # pragma: no cover
        raise OSError(errno.EOPNOTSUPP, f"{name} is not available")
    if getattr(lib, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)``.

    Raises:
        OSError: ENOSPC, EOPNOTSUPP (the filesystem cannot), ...
    """
    _call("fallocate", fd, mode, offset, length)


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise(2)`` on ``length`` bytes of a map from ``address`` (the GIL released meanwhile).

    Raises:
        OSError: EINVAL (an advice the kernel does not know), EFAULT, ENOMEM, ...
    """
    _call("madvise", address, length, advice)


def sync_file_range(fd: int, offset: int, length: int, flags: int) -> None:
    """``sync_file_range(2)``.

    Raises:
        OSError: EIO, EBADF, ...
    """
    _call("sync_file_range", fd, offset, length, flags)


def prctl(option: int, arg: int) -> None:
    """``prctl(2)`` with one argument.

    Raises:
        OSError: EINVAL, ...
    """
    _call("prctl", option, arg, 0, 0, 0)
