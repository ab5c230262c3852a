"""Lossless chunk codecs of the content-addressed layout (:mod:`.content`), chosen per shard.

A shard is stored as chunks; every chunk of a shard goes through the codec its manifest names
(``shards[].codec``):

- ``raw``: the bytes as they are;
- ``zstd``: zstandard, level ``LEVEL``;
- ``zipnn-bf16`` / ``zipnn-f16`` / ``zipnn-f32`` (what ``auto`` picks for floats): ZipNN
  (https://github.com/zipnn/zipnn; byte grouping with the exponent in a byte of its own, each
  byte group Huffman-coded per 256 KiB, in C). The stored body is an xxh3-64 (8 bytes, little
  endian) of what follows it: the ZipNN stream, then the tail shorter than an element as it is.
  The digest is checked, and the stream's header must announce the expected plain size and
  its own length, before the stream reaches ZipNN's decoder: corrupt bytes never reach C code
  that trusts its input, and the output is bounded by the chunk's size. ZipNN rewrites the
  buffer it compresses, so it is given a private copy (or the caller's buffer, when the caller
  says it is done with it). Chosen against the alternatives measured in bench/README.md
  ("Incremental and compressed persistent checkpoints"): blosc2 shuffle/bitshuffle/bytedelta +
  zstd/lz4, pcodec, byte planes + zstd or deflate lose ratio (zstd's match finder codes the
  exponent plane 10-13% above its entropy) or decode at a fraction of ZipNN's speed;
- ``bg2-zstd`` / ``bg4-zstd`` (written before the ZipNN codecs, still read; also the
  ``bg-zstd`` setting): byte grouping, then zstd per byte plane. Each element (2 bytes:
  float16, bfloat16; 4 bytes: float32) is rotated left by one bit, so that its top byte holds the
  exponent alone (float32, bfloat16) and the sign joins the low mantissa bits; the chunk is then
  split into byte planes (byte 0 of every element, then byte 1, ...). Every plane is compressed
  with zstd (level ``PLANE_LEVEL``) and stored raw when that does not shrink it. A tail shorter
  than an element is stored as it is.

Every stored chunk starts with one tag byte: ``0`` the rest is the plain bytes (the codec did not
shrink the chunk, or it is ``raw``), ``1`` the rest is the codec's output. So "stored raw when
it does not shrink" needs no second name and the object name (which includes the codec, so an
existence check needs no encoding) still tells how to read it. Checksums and content hashes
always cover the plain bytes. :func:`choose` picks the codec for a shard from the ``codec``
setting and the shard's dtype (a manifest's dtype string: ``"torch:bfloat16"``, ``"<f4"``).
Each codec is a :class:`~.codec.ChunkCodec` registered in the one registry of :mod:`.codec` at
import; :func:`encode` and :func:`decode` find them there (so does a codec a test registers).
Everything here is blocking; the tier calls it from worker threads. zstd and numpy release the
GIL; ZipNN holds it for the whole call (~2 ms per MiB compressing on one core here, less
decoding), so float chunks are coded one at a time per daemon. Each thread has its own coder
objects (a ZipNN object shared between threads crashes the process). ZipNN imports torch: the
first float chunk a daemon encodes or decodes pays that import once (~2 s).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import xxhash
from tierckpt.errors import DataLossError

from .codec import ChunkCodec, chunk_codec, register_codec

__all__ = ["CODECS", "SETTINGS", "ZIPNN", "choose", "encode", "decode", "LEVEL"]

LEVEL = 3
"""zstd level of the ``zstd`` codec (zstd's default)."""

PLANE_LEVEL = 1
"""zstd level of each byte plane of the ``bg*`` codecs."""

ZIPNN = {"bfloat16": "zipnn-bf16", "float16": "zipnn-f16", "float32": "zipnn-f32"}
"""The ZipNN codec of each float dtype."""

CODECS = ("raw", "zstd", "bg2-zstd", "bg4-zstd", *ZIPNN.values())
"""Every chunk codec a manifest may name."""

SETTINGS = ("auto", "none", "zstd", "bg-zstd")
"""Values of the ``codec`` setting: ``auto`` (by dtype: ZipNN for float16/bfloat16/float32, zstd for
the rest), ``none`` (raw), ``zstd`` (plain zstd for every shard), ``bg-zstd`` (the older byte
planes + zstd by element size where the dtype has one, else zstd)."""

_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4}
_RAW, _PACKED = b"\x00", b"\x01"
_local = threading.local()
_NUMPY = {"<f4": "float32", "<f2": "float16", "<i2": "int16", "<u2": "uint16", "<i4": "int32", "<u4": "uint32"}


def dtype_name(dtype: str) -> str:
    """The torch-style name of a manifest's dtype string (``"torch:bfloat16"`` -> ``"bfloat16"``,
    numpy's little-endian ``"<f4"`` -> ``"float32"``); anything else as it is (big-endian
    ``">f4"`` is no float32 here: its bytes are in the other order)."""
    return dtype[6:] if dtype.startswith("torch:") else _NUMPY.get(dtype, dtype)


def choose(setting: str, dtype: str) -> str:
    """The codec of a shard of ``dtype`` (a manifest's dtype string, or a torch-style name)
    under the ``codec`` setting (see :data:`SETTINGS`)."""
    dtype = dtype_name(dtype)
    if setting == "none":
        return "raw"
    if setting == "auto" and dtype in ZIPNN:
        return ZIPNN[dtype]
    width = _WIDTH.get(dtype, 0)
    if setting != "bg-zstd" or width == 0:
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


_UINT = {2: "<u2", 4: "<u4"}
_ZIPNN_DTYPE = {codec: dtype for dtype, codec in ZIPNN.items()}
_DIGEST = 8  # xxh3-64 of the ZipNN stream and the tail, ahead of them
_ZN_HEADER = 32  # a ZipNN stream's header: b"ZN", ..., plain size at [16:24], own size at [24:32] (little endian)


def _zipnn(codec: str) -> Any:
    """This thread's ZipNN coder of a codec (the object keeps per-call state: not shared)."""
    coders = getattr(_local, "zipnn", None)
    if coders is None:
        coders = _local.zipnn = {}
    if codec not in coders:
        import zipnn  # the [daemon] extra; imports torch, so only on first use

        coders[codec] = zipnn.ZipNN(bytearray_dtype=_ZIPNN_DTYPE[codec], threads=1, input_format="byte")
    return coders[codec]


def _digest(stream: bytes | memoryview, tail: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_64(stream)
    h.update(tail)
    return h.intdigest().to_bytes(_DIGEST, "little")


def _pack_zipnn(data: bytes | bytearray | memoryview, codec: str, consume: bool) -> list[bytes] | None:
    """The ZipNN body of a chunk (module docstring), or None when it has no whole element."""
    width = _WIDTH[_ZIPNN_DTYPE[codec]]
    n = len(data) - len(data) % width
    if n == 0:
        return None
    tail = bytes(data[n:])
    mine = data if consume and isinstance(data, bytearray) and n == len(data) else bytearray(data[:n])
    stream = _zipnn(codec).compress(mine)  # ZipNN rewrites the buffer it is given
    return [_digest(stream, tail), stream, tail]


def _unpack_zipnn(body: memoryview, size: int, codec: str) -> bytes | bytearray:
    tail = size % _WIDTH[_ZIPNN_DTYPE[codec]]
    end = len(body) - tail
    stream = memoryview(body)[_DIGEST:end]
    if end < _DIGEST + _ZN_HEADER or _digest(stream, body[end:]) != bytes(body[:_DIGEST]):
        raise DataLossError("ZipNN stream does not match its digest")
    announced = (int.from_bytes(stream[16:24], "little"), int.from_bytes(stream[24:32], "little"))
    if bytes(stream[:2]) != b"ZN" or announced != (size - tail, len(stream)):
        raise DataLossError(f"ZipNN stream header does not announce {size - tail} bytes in {len(stream)}")
    out = _zipnn(codec).decompress(stream)
    return out + body[end:] if tail else out


def _planes(data: bytes | bytearray | memoryview, width: int) -> list[bytes]:
    """Rotate each element left by one bit, then split into ``width`` byte planes (+ the tail)."""
    import numpy as np  # imported on first use: the layout reads codec names without numpy

    n = len(data) - len(data) % width
    x = np.frombuffer(data, _UINT[width], n // width)
    bits = 8 * width
    x = (x << 1) | (x >> (bits - 1))
    grouped = x.view(np.uint8).reshape(-1, width).T
    return [grouped[i].tobytes() for i in range(width)] + [bytes(data[n:])]


def _unplanes(planes: list[Any], width: int) -> bytes:
    import numpy as np

    count = len(planes[0])
    grouped = np.empty((count, width), np.uint8)
    for i in range(width):
        grouped[:, i] = np.frombuffer(planes[i], np.uint8, count)
    x = grouped.reshape(-1).view(_UINT[width])
    bits = 8 * width
    x = (x >> 1) | (x << (bits - 1))
    return x.tobytes() + planes[width]


def _pack_planes(data: bytes | bytearray | memoryview, width: int) -> bytes:
    comp = _zstd(PLANE_LEVEL)[0]
    out = []
    for plane in _planes(data, width):
        packed = comp.compress(plane) if plane else b""
        body, mode = (packed, _PACKED) if len(packed) < len(plane) else (plane, _RAW)
        out += [mode, struct.pack("<I", len(body)), body]
    return b"".join(out)


def _unpack_planes(body: memoryview, size: int, width: int) -> bytes:
    dec, pos, planes = _zstd(PLANE_LEVEL)[1], 0, []
    sizes = [size // width] * width + [size % width]
    for want in sizes:
        mode, (length,) = body[pos:pos + 1], struct.unpack_from("<I", body, pos + 1)
        part = body[pos + 5:pos + 5 + length]
        pos += 5 + length
        plane = part if mode == _RAW else dec.decompress(part, max_output_size=want, allow_extra_data=False)
        if len(plane) != want or mode not in (_RAW, _PACKED):
            raise DataLossError(f"byte plane of {len(plane)} bytes, expected {want}")
        planes.append(plane)
    if pos != len(body):
        raise DataLossError("trailing bytes after the byte planes")
    return _unplanes(planes, width)


class _Raw(ChunkCodec):
    name = "raw"

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return None

    def unpack(self, body: memoryview, size: int) -> bytes:
        raise DataLossError(f"chunk of codec {self.name!r} has an unknown tag {_PACKED!r}")


class _Zstd(ChunkCodec):
    name = "zstd"

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return [_zstd()[0].compress(data)]

    def unpack(self, body: memoryview, size: int) -> bytes:
        return _zstd()[1].decompress(body, max_output_size=size, allow_extra_data=False)


class _BytePlanes(ChunkCodec):
    def __init__(self, width: int) -> None:
        self.width = width
        self.name = f"bg{width}-zstd"

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return [_pack_planes(data, self.width)]

    def unpack(self, body: memoryview, size: int) -> bytes:
        return _unpack_planes(body, size, self.width)


class _ZipNN(ChunkCodec):
    overwrites_input = True

    def __init__(self, name: str) -> None:
        self.name = name

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return _pack_zipnn(data, self.name, consume)

    def unpack(self, body: memoryview, size: int) -> bytes | bytearray:
        return _unpack_zipnn(body, size, self.name)


for _codec in (_Raw(), _Zstd(), _BytePlanes(2), _BytePlanes(4), *(_ZipNN(n) for n in ZIPNN.values())):
    register_codec(_codec)


def encode(codec: str, data: bytes | bytearray | memoryview, *, consume: bool = False) -> bytes:
    """The stored form of one chunk (tag byte first; never longer than ``len(data) + 1``).

    Args:
        consume: ``data`` is a bytearray the caller is done with: a codec may overwrite it
            instead of copying it first.

    Raises:
        DataLossError: no chunk codec of that name is registered.
    """
    coder = chunk_codec(codec)
    parts = coder.pack(data, consume)
    if parts is None or sum(map(len, parts)) >= len(data):
        if consume and parts is not None and coder.overwrites_input:  # ``data`` was overwritten:
            return _RAW + bytes(coder.unpack(memoryview(b"".join(parts)), len(data)))  # the output has it
        return _RAW + bytes(data)
    return b"".join([_PACKED, *parts])


def decode(codec: str, stored: bytes, size: int) -> bytes | bytearray:
    """The plain bytes of one chunk of ``size`` bytes.

    Raises:
        DataLossError: the stored bytes are not a chunk of that codec and size.
    """
    coder = chunk_codec(codec)
    tag, body = stored[:1], memoryview(stored)[1:]
    try:
        if tag == _RAW:
            out: bytes | bytearray = bytes(body)
        elif tag == _PACKED:
            out = coder.unpack(body, size)
        else:
            raise DataLossError(f"chunk of codec {codec!r} has an unknown tag {tag!r}")
    except DataLossError:
        raise
    except Exception as err:  # zstandard.ZstdError, ZipNN's ValueError and friends: corrupt bytes
        raise DataLossError(f"chunk of codec {codec!r} cannot be decoded: {err}") from err
    if len(out) != size:
        raise DataLossError(f"chunk of codec {codec!r} decodes to {len(out)} bytes, not {size}")
    return out
