"""XOR of byte buffers at memory bandwidth (numpy releases the GIL on large arrays)."""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["xor_into", "xor_file_into_file"]

_STEP = 64 << 20


def xor_into(dst, src) -> None:
    """``dst[:len(src)] ^= src`` in place (``dst`` writable, at least as long as ``src``)."""
    n = len(memoryview(src).cast("B"))
    if n == 0:
        return
    a = np.frombuffer(dst, dtype=np.uint8, count=n)
    b = np.frombuffer(src, dtype=np.uint8, count=n)
    np.bitwise_xor(a, b, out=a)


def xor_file_into_file(dst_fd: int, src_fd: int, length: int) -> None:
    """The first ``length`` bytes of ``src_fd`` XORed into ``dst_fd`` (which is at least that long),
    through shared maps, in ``_STEP`` pieces."""
    if length == 0:
        return
    with mmap.mmap(dst_fd, length, flags=mmap.MAP_SHARED) as dm, \
            mmap.mmap(src_fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as sm:
        a = np.frombuffer(dm, dtype=np.uint8)
        b = np.frombuffer(sm, dtype=np.uint8)
        for off in range(0, length, _STEP):
            np.bitwise_xor(a[off:off + _STEP], b[off:off + _STEP], out=a[off:off + _STEP])
        del a, b  # the maps close only once no array views them
