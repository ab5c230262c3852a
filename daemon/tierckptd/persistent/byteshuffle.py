"""Byte planes of fixed-width elements, split and merged in compiled code with the GIL released.

The float codecs of :mod:`.compress` store a chunk as byte planes: byte 0 of every ``width``-byte
element, then byte 1, ..., then the tail shorter than an element as it is. That is exactly what
Blosc's byte shuffle does with ``typesize = width``, leftover bytes included (a tail is copied as it
is after the planes). Splitting and merging planes is most of a float32 chunk's decode time: numpy
needs a strided pass per plane (2.6-3.3 ms for an 8 MiB chunk, more than ZipNN's whole decode,
bench/README.md "Issue 28"), while libblosc2's SIMD shuffle does it in one pass.

So :func:`split` and :func:`merge` call ``blosc2_shuffle`` / ``blosc2_unshuffle`` of the
libblosc2 shared library that the ``blosc2`` wheel bundles (``blosc2/lib/libblosc2.so*``), loaded
with ctypes, whose calls release the GIL: chunks are shuffled on as many cores as there are threads
coding. blosc2's Python package is never imported (it pulls in numexpr, ndindex, msgpack and
more): its directory is found with :func:`importlib.util.find_spec`, which runs none of its code.
Where the wheel or the library is missing, or a buffer exceeds libblosc2's 32-bit sizes, the same
bytes come from numpy (slower, holding the GIL less). :func:`use_native` switches the library off
(tests compare both paths; tests/persistent/test_byteshuffle.py).

Both functions only move bytes: the stored format is the same whichever path made it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["split", "merge", "native", "use_native"]

MAX = _MAX = (1 << 31) - 1  # libblosc2 sizes are int32_t
_BLOCK = 1 << 20  # bytes of planes merged at a time (512 KiB - 2 MiB measured alike on 8 MiB chunks, 128 KiB slower)
_LIBS = ("libblosc2.so", "libblosc2.dylib", "libblosc2.dll", "blosc2.dll")
_lock = threading.Lock()
_local = threading.local()
_state: dict[str, Any] = {}  # "lib": the (shuffle, unshuffle) pair or None once looked for; "off": use_native(False)


try:
    _NEW: Any = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _NEW.restype, _NEW.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
except AttributeError:  # not CPython
    _NEW = None


def _find() -> Path | None:
    """The libblosc2 shared library of the installed ``blosc2`` wheel, without importing blosc2."""
    try:
        spec = importlib.util.find_spec("blosc2")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    home = Path(spec.origin).parent
    for folder in (home / "lib", home):
        for name in _LIBS:
            if (folder / name).is_file():
                return folder / name
        versioned = sorted(folder.glob("libblosc2.so.*")) if folder.is_dir() else []
        if versioned:
            return versioned[0]
    return None


def _load() -> tuple[Any, Any] | None:
    """``(blosc2_shuffle, blosc2_unshuffle)`` through ctypes (GIL released during each call), or
    None where libblosc2 cannot be loaded or does not pass a self-check."""
    path = _find()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        pair = lib.blosc2_shuffle, lib.blosc2_unshuffle
    except (OSError, AttributeError):
        return None
    for fn in pair:
        fn.restype = ctypes.c_int32
        fn.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    probe = bytes(range(11))  # also makes libblosc2 pick its SIMD variant once, here, under the lock
    out = ctypes.create_string_buffer(len(probe))
    back = ctypes.create_string_buffer(len(probe))
    if (pair[0](4, len(probe), probe, out) != len(probe) or out.raw != probe[0:8:4] + probe[1:8:4]
            + probe[2:8:4] + probe[3:8:4] + probe[8:] or pair[1](4, len(probe), out, back) != len(probe)
            or back.raw != probe):
        return None
    return pair


def native() -> tuple[Any, Any] | None:
    """The library's ``(shuffle, unshuffle)``, or None when numpy does the work."""
    if _state.get("off"):
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def use_native(enabled: bool) -> None:
    """Use libblosc2 where it is installed (the default), or numpy always (``False``: tests)."""
    _state["off"] = not enabled


def split(data: Any, width: int, out: Any = None) -> Any:
    """The byte planes of ``data``'s ``width``-byte elements, one after another, then its tail.

    Args:
        data: the plain bytes, any buffer of any length (a tail shorter than an element is kept as it is).
        width: bytes per element (2 or 4 here).
        out: a writable buffer of ``len(data)`` bytes to fill; a new numpy array when None.

    Returns:
        ``out`` (or the new array): plane ``k`` is bytes ``[k * n, (k + 1) * n)`` with
        ``n = len(data) // width``, the tail the last ``len(data) % width`` bytes.
    """
    import numpy as np

    src = np.frombuffer(data, np.uint8)
    size = len(src)
    flat = np.empty(size, np.uint8) if out is None else np.frombuffer(out, np.uint8)
    if len(flat) != size or flat.flags.writeable is False:
        raise ValueError(f"split of {size} bytes into a buffer of {len(flat)} (writeable: {flat.flags.writeable})")
    lib = native()
    if lib is not None and 0 < size <= _MAX:
        if lib[0](width, size, src.ctypes.data, flat.ctypes.data) != size:
            raise ValueError(f"blosc2_shuffle failed on {size} bytes of width {width}")
        return flat if out is None else out
    count = size // width
    planes = flat[:count * width].reshape(width, count)
    grouped = src[:count * width].reshape(count, width)
    for k in range(width):
        np.copyto(planes[k], grouped[:, k])
    flat[count * width:] = src[count * width:]
    return flat if out is None else out


def _uninitialized(size: int) -> bytearray:
    """A bytearray of ``size`` bytes not zeroed first (every byte is written by the caller): zeroing
    8 MiB cost ~0.3 ms of a ~3 ms decode. CPython's ``PyByteArray_FromStringAndSize(NULL, size)``;
    a zeroed one elsewhere."""
    if _NEW is None:
        return bytearray(size)
    return _NEW(None, size)  # type: ignore[no-any-return]


def _scratch(size: int) -> Any:
    """This thread's scratch buffer of planes for :func:`merge`, at least ``size`` bytes: kept
    between chunks, so its pages are not faulted in again on every decode (a fresh 1 MiB
    buffer often is: glibc returns large blocks to the kernel)."""
    import numpy as np

    held = getattr(_local, "scratch", None)
    if held is None or len(held) < size:
        held = _local.scratch = np.zeros(size, np.uint8)
    return held


def merge(planes: Sequence[Any], tail: Any, width: int) -> bytearray:
    """The inverse of :func:`split`: elements from their byte planes, then the tail.

    The planes may lie anywhere (a stored chunk's raw planes, a zstd frame's output): with
    libblosc2 they are gathered block by block (``_BLOCK`` bytes, which stay in cache) into one
    scratch buffer of planes and unshuffled from there into the output, so each byte is read from
    memory once and written once, as ZipNN's C merge does (gathering the whole chunk first cost a
    further pass over it, ~1 ms of an 8 MiB chunk).

    Args:
        planes: ``width`` buffers of the same length ``n`` (plane ``k``: byte ``k`` of each element).
        tail: the bytes after the last whole element.
        width: bytes per element.

    Returns:
        A new bytearray of ``n * width + len(tail)`` bytes.
    """
    import numpy as np

    arrays = [np.frombuffer(plane, np.uint8) for plane in planes]
    count = len(arrays[0])
    if len(arrays) != width or any(len(a) != count for a in arrays):
        raise ValueError(f"{len(arrays)} byte planes of lengths {[len(a) for a in arrays]}, expected {width} alike")
    tail = np.frombuffer(tail, np.uint8)
    out = _uninitialized(count * width + len(tail))
    flat = np.frombuffer(out, np.uint8)
    lib = native()
    if lib is not None and 0 < count * width <= _MAX:
        step = max(1, _BLOCK // width)
        scratch = _scratch(min(step, count) * width)
        at, into = scratch.ctypes.data, flat.ctypes.data
        starts = [a.ctypes.data for a in arrays]
        for start in range(0, count, step):
            n = min(step, count - start)
            for k, plane in enumerate(starts):
                ctypes.memmove(at + k * n, plane + start, n)
            if lib[1](width, n * width, at, into + start * width) != n * width:
                raise ValueError(f"blosc2_unshuffle failed on {n * width} bytes of width {width}")
    elif width == 2 and count:  # x = (top << 8) | low: three passes over 16-bit elements, the fastest measured
        x = flat[:2 * count].view(np.uint16)
        np.copyto(x, arrays[1])
        np.left_shift(x, 8, out=x)
        np.bitwise_or(x, arrays[0], out=x)
    else:  # one strided copy per plane (ten 32-bit shift/or passes took ~1.5x as long)
        grouped = flat[:count * width].reshape(count, width)
        for k in range(width):
            np.copyto(grouped[:, k], arrays[k])
    flat[count * width:] = tail
    return out


def merge_blocks(planes: Sequence[Any], coded: int, blocks: Sequence[Any], put: Callable[[Any, int], None],
                 tail: Any, width: int) -> bytearray:
    """:func:`merge` where plane ``coded`` is not given but decoded block by block straight into
    the scratch buffer (``put(block, address)`` writes ``block[3]`` bytes there: one block of a
    :func:`.zstdlib.literal_blocks` frame), each block's elements unshuffled into the output at
    once: the decoded plane never goes through memory (bench/README.md "Issue 28, item 2").
    Only with libblosc2 (:func:`native`).

    Raises:
        ValueError: the planes' lengths differ, or libblosc2 is not loaded.
    """
    import numpy as np

    lib = native()
    count = sum(block[3] for block in blocks)
    arrays = [np.frombuffer(plane, np.uint8) for k, plane in enumerate(planes) if k != coded]
    if lib is None or len(planes) != width or any(len(a) != count for a in arrays) or not 0 < count * width <= _MAX:
        raise ValueError(f"{len(planes)} byte planes of {count} bytes cannot be merged here (width {width})")
    starts = [a.ctypes.data for a in arrays]
    starts.insert(coded, 0)
    tail = np.frombuffer(tail, np.uint8)
    out = _uninitialized(count * width + len(tail))
    flat = np.frombuffer(out, np.uint8)
    scratch = _scratch(max(block[3] for block in blocks) * width)
    at, into, start = scratch.ctypes.data, flat.ctypes.data, 0
    for block in blocks:
        n = block[3]
        for k, plane in enumerate(starts):
            if k == coded:
                put(block, at + k * n)
            else:
                ctypes.memmove(at + k * n, plane + start, n)
        if lib[1](width, n * width, at, into + start * width) != n * width:
            raise ValueError(f"blosc2_unshuffle failed on {n * width} bytes of width {width}")
        start += n
    flat[count * width:] = tail
    return out
