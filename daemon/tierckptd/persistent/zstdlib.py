"""zstd's one-shot decoder from libblosc2, writing into a buffer the caller owns (issue 28 item 2).

python-zstandard can only decode into a new ``bytes``: for a ``bp*`` chunk (:mod:`.compress`) that
is a fresh 2-3 MiB object per coded plane, whose pages the kernel faults in and zeroes on many
decodes (glibc hands large blocks back and forth with the kernel), read again by the merge. The
libblosc2 shared library that :mod:`.byteshuffle` already loads exports zstd's own API
(``ZSTD_decompressDCtx`` and friends, the same zstd the ``zstandard`` wheel bundles): through it a
plane is decoded straight into a per-thread buffer that stays mapped and warm between chunks.
ctypes releases the GIL during each call, so chunks decode on as many cores as threads decode.

Stored bytes are hostile (issue 27): the frame must announce exactly the size it is read as, must
end exactly where the plane ends (no second frame, no trailing bytes: python-zstandard's
``allow_extra_data=False``), and zstd's one-shot decoder never writes past the capacity it is given
(it needs no window buffer either, so a frame's window size allocates nothing). Any error is a
:class:`ValueError` the codec reports as data loss.

Where the library is missing, too old or fails its self-check, :func:`available` is False and
:mod:`.compress` decodes with python-zstandard as before; :func:`use_native` switches it off for tests.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from . import byteshuffle

__all__ = ["available", "decompress_into", "use_native", "address"]

_UNKNOWN = (1 << 64) - 1  # ZSTD_CONTENTSIZE_UNKNOWN; ZSTD_CONTENTSIZE_ERROR is one less
_lock = threading.Lock()
_state: dict[str, Any] = {}
_local = threading.local()


class _DCtx:
    """One thread's zstd decompression context, freed with the thread's locals."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.ptr = lib.ZSTD_createDCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createDCtx failed")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeDCtx(self.ptr)
            self.ptr = None


def _load() -> Any:
    """libblosc2's zstd functions with their C signatures, or None (missing, or fails a probe)."""
    path = byteshuffle._find()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        for name, restype, argtypes in (
                ("ZSTD_createDCtx", ptr, []), ("ZSTD_freeDCtx", size_t, [ptr]),
                ("ZSTD_decompressDCtx", size_t, [ptr, ptr, size_t, ptr, size_t]),
                ("ZSTD_getFrameContentSize", ctypes.c_ulonglong, [ptr, size_t]),
                ("ZSTD_findFrameCompressedSize", size_t, [ptr, size_t]),
                ("ZSTD_isError", ctypes.c_uint, [size_t]), ("ZSTD_getErrorName", ctypes.c_char_p, [size_t]),
                ("ZSTD_versionNumber", ctypes.c_uint, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        if lib.ZSTD_versionNumber() < 10400:  # 1.4: the one-shot API and its bounds as used here
            return None
        import zstandard

        probe = bytes(range(256)) * 40
        frame = zstandard.ZstdCompressor(level=1).compress(probe)
        out = ctypes.create_string_buffer(len(probe))
        if _decode(lib, frame, ctypes.addressof(out), len(probe)) != len(probe) or out.raw != probe:
            return None
    except (OSError, AttributeError, ImportError, ValueError):
        return None
    return lib


def _native() -> Any:
    if _state.get("off"):
        return None
    if "ready" not in _state:
        with _lock:
            if "ready" not in _state:
                lib = _load()
                _state["lib"], _state["ready"] = lib, True
    return _state["lib"]


def available() -> bool:
    """Whether :func:`decompress_into` can run (libblosc2 loaded, not switched off)."""
    return _native() is not None


def use_native(enabled: bool) -> None:
    """Decode zstd planes through libblosc2 (the default) or through python-zstandard (``False``)."""
    _state["off"] = not enabled


def address(buffer: Any) -> tuple[int, int]:
    """The address and length of any contiguous buffer (read-only ones too: ``bytes``, a slice of it)."""
    import numpy as np

    arr = np.frombuffer(buffer, np.uint8)
    return arr.ctypes.data, len(arr)


def _decode(lib: Any, frame: Any, dst: int, size: int) -> int:
    src, length = address(frame)
    if length == 0:
        raise ValueError("empty zstd frame")
    announced = lib.ZSTD_getFrameContentSize(src, length)
    if announced >= _UNKNOWN - 1 or announced != size:
        raise ValueError(f"zstd frame announces {announced if announced < _UNKNOWN - 1 else 'no'} size, "
                         f"expected {size}")
    end = lib.ZSTD_findFrameCompressedSize(src, length)
    if lib.ZSTD_isError(end) or end != length:
        raise ValueError("zstd frame is cut short or followed by other bytes")
    dctx = getattr(_local, "dctx", None)
    if dctx is None or dctx.lib is not lib:
        dctx = _local.dctx = _DCtx(lib)
    got = lib.ZSTD_decompressDCtx(dctx.ptr, dst, size, src, length)
    if lib.ZSTD_isError(got):
        raise ValueError(f"zstd: {lib.ZSTD_getErrorName(got).decode(errors='replace')}")
    if got != size:
        raise ValueError(f"zstd frame decodes to {got} bytes, expected {size}")
    return int(got)


def decompress_into(frame: Any, dst: int, size: int) -> None:
    """Decode one zstd frame of exactly ``size`` plain bytes into the ``size`` writable bytes at
    address ``dst`` (the caller keeps that buffer alive and at least ``size`` long).

    Raises:
        ValueError: the library is not available, or ``frame`` is not one whole frame of ``size`` bytes.
    """
    lib = _native()
    if lib is None:
        raise ValueError("libblosc2's zstd is not available")
    _decode(lib, frame, dst, size)
