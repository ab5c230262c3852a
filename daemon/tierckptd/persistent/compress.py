"""Lossless chunk codecs of the content-addressed layout (:mod:`.content`), chosen per shard.

A shard is stored as chunks; every chunk of a shard goes through the codec its manifest names
(``shards[].codec``):

- ``raw``: the bytes as they are;
- ``zstd``: zstandard, level ``LEVEL``;
- ``bg2-zstd`` / ``bg4-zstd``: byte grouping, then zstd per byte plane. Each element (2 bytes:
  float16, bfloat16; 4 bytes: float32) is rotated left by one bit, so that its top byte holds the
  exponent alone (float32, bfloat16) and the sign joins the low mantissa bits; the chunk is then
  split into byte planes (byte 0 of every element, then byte 1, ...). The exponent plane has a few
  bits of entropy per byte and compresses well; every plane is compressed with zstd (level
  ``PLANE_LEVEL``: fast, and the ratio on these planes matches higher levels) and stored raw when
  that does not shrink it (mantissa planes are mostly noise). A tail shorter than an element is
  stored as it is.

Every stored chunk starts with one tag byte: ``0`` the rest is the plain bytes (the codec did not
shrink the chunk, or it is ``raw``), ``1`` the rest is the codec's output. So "stored raw when
it does not shrink" needs no second name and the object name (which includes the codec, so an
existence check needs no encoding) still tells how to read it. Checksums and content hashes
always cover the plain bytes. :func:`choose` picks the codec for a shard from the ``codec``
setting and the shard's dtype. Everything here is blocking and releases the GIL in zstd and
numpy; the tier calls it from worker threads.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
from tierckpt.errors import DataLossError

__all__ = ["CODECS", "SETTINGS", "choose", "encode", "decode", "LEVEL"]

LEVEL = 3
"""zstd level of the ``zstd`` codec (zstd's default)."""

PLANE_LEVEL = 1
"""zstd level of each byte plane of the ``bg*`` codecs."""

CODECS = ("raw", "zstd", "bg2-zstd", "bg4-zstd")
"""Every chunk codec a manifest may name."""

SETTINGS = ("auto", "none", "zstd", "bg-zstd")
"""Values of the ``codec`` setting: ``auto`` (by dtype), ``none`` (raw), ``zstd`` (plain zstd for
every shard), ``bg-zstd`` (byte grouping by element size where the dtype has one, else zstd)."""

_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4}
_FLOATS = {"float16", "bfloat16", "float32"}
_RAW, _PACKED = b"\x00", b"\x01"
_local = threading.local()


def choose(setting: str, dtype: str) -> str:
    """The codec of a shard of ``dtype`` under the ``codec`` setting (see :data:`SETTINGS`)."""
    if setting == "none":
        return "raw"
    width = _WIDTH.get(dtype, 0)
    if setting == "zstd" or width == 0 or (setting == "auto" and dtype not in _FLOATS):
        return "zstd"
    return f"bg{width}-zstd"


def _zstd(level: int = LEVEL) -> tuple[Any, Any]:
    import zstandard  # the [daemon] extra; imported on first use so a raw tier needs nothing

    pairs = getattr(_local, "zstd", None)
    if pairs is None:
        pairs = _local.zstd = {}
    if level not in pairs:
        pairs[level] = (zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor())
    return pairs[level]


_UINT = {2: np.uint16, 4: np.uint32}


def _planes(data: bytes | memoryview, width: int) -> list[bytes]:
    """Rotate each element left by one bit, then split into ``width`` byte planes (+ the tail)."""
    n = len(data) - len(data) % width
    x = np.frombuffer(data, _UINT[width], n // width)
    bits = 8 * width
    x = (x << 1) | (x >> (bits - 1))
    grouped = x.view(np.uint8).reshape(-1, width).T
    return [grouped[i].tobytes() for i in range(width)] + [bytes(data[n:])]


def _unplanes(planes: list[bytes], width: int) -> bytes:
    count = len(planes[0])
    grouped = np.empty((count, width), np.uint8)
    for i in range(width):
        grouped[:, i] = np.frombuffer(planes[i], np.uint8, count)
    x = grouped.reshape(-1).view(_UINT[width])
    bits = 8 * width
    x = (x >> 1) | (x << (bits - 1))
    return x.tobytes() + planes[width]


def _pack_planes(data: bytes | memoryview, width: int) -> bytes:
    comp = _zstd(PLANE_LEVEL)[0]
    out = []
    for plane in _planes(data, width):
        packed = comp.compress(plane) if plane else b""
        body, mode = (packed, _PACKED) if len(packed) < len(plane) else (plane, _RAW)
        out += [mode, struct.pack("<I", len(body)), body]
    return b"".join(out)


def _unpack_planes(body: bytes, size: int, width: int) -> bytes:
    dec, pos, planes = _zstd(PLANE_LEVEL)[1], 0, []
    sizes = [size // width] * width + [size % width]
    for want in sizes:
        mode, (length,) = body[pos:pos + 1], struct.unpack_from("<I", body, pos + 1)
        part = body[pos + 5:pos + 5 + length]
        pos += 5 + length
        plane = part if mode == _RAW else dec.decompress(part, max_output_size=want)
        if len(plane) != want or mode not in (_RAW, _PACKED):
            raise DataLossError(f"byte plane of {len(plane)} bytes, expected {want}")
        planes.append(plane)
    if pos != len(body):
        raise DataLossError("trailing bytes after the byte planes")
    return _unplanes(planes, width)


def encode(codec: str, data: bytes | memoryview) -> bytes:
    """The stored form of one chunk (tag byte first; never longer than ``len(data) + 1``)."""
    if codec == "raw":
        return _RAW + bytes(data)
    if codec.startswith("bg"):
        packed = _pack_planes(data, int(codec[2]))
    else:
        packed = _zstd()[0].compress(data)
    if len(packed) >= len(data):
        return _RAW + bytes(data)
    return _PACKED + packed


def decode(codec: str, stored: bytes, size: int) -> bytes:
    """The plain bytes of one chunk of ``size`` bytes.

    Raises:
        DataLossError: the stored bytes are not a chunk of that codec and size.
    """
    if codec not in CODECS:
        raise DataLossError(f"chunk stored with unknown codec {codec!r}")
    tag, body = stored[:1], stored[1:]
    try:
        if tag == _RAW:
            out = body
        elif tag == _PACKED and codec != "raw":
            if codec.startswith("bg"):
                out = _unpack_planes(body, size, int(codec[2]))
            else:
                out = _zstd()[1].decompress(body, max_output_size=size)
        else:
            raise DataLossError(f"chunk of codec {codec!r} has an unknown tag {tag!r}")
    except DataLossError:
        raise
    except Exception as err:  # zstandard.ZstdError and friends: the stored bytes are corrupt
        raise DataLossError(f"chunk of codec {codec!r} cannot be decoded: {err}") from err
    if len(out) != size:
        raise DataLossError(f"chunk of codec {codec!r} decodes to {len(out)} bytes, not {size}")
    return out
