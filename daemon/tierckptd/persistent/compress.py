"""Lossless chunk codecs of the content-addressed layout (:mod:`.content`), chosen per shard.

A shard is stored as chunks; every chunk of a shard goes through the codec its manifest names
(``shards[].codec``):

- ``raw``: the bytes as they are;
- ``zstd``: zstandard, level ``LEVEL``;
- ``zipnn-bf16`` / ``zipnn-f16`` / ``zipnn-f32`` (what ``auto`` picks for floats): ZipNN
  (https://github.com/zipnn/zipnn; byte grouping with the exponent in a byte of its own, each
  byte group Huffman-coded per 256 KiB, in C). The stored body is an xxh3-64 (8 bytes, little
  endian) of what follows it: the ZipNN stream, then the tail shorter than an element as it is.
  The stream is the one zipnn 0.5.4's wrapper (``ZipNN(input_format="byte", bytearray_dtype=...,
  threads=1)``) writes, byte for byte, but made here without the wrapper (which imports torch):
  the 32-byte header is written and parsed in Python and only ZipNN's C coder, the module
  ``zipnn_core``, is called. Before any byte reaches ``zipnn_core.combine_dtype`` (which trusts
  its input) the digest is checked, the header must be the one this codec writes (any 0.5.x
  version) announcing the expected plain size and the stream's own length, and its chunk index
  (a type and an end per byte group per 256 KiB) must describe the stream exactly; the output is
  bounded by the chunk's size. ZipNN rewrites the buffer it compresses, so it is given a private
  copy (or the caller's buffer, when the caller says it is done with it). Chosen against the
  alternatives measured in bench/README.md ("Incremental and compressed persistent
  checkpoints"): blosc2 shuffle/bitshuffle/bytedelta + zstd/lz4, pcodec, byte planes + zstd or
  deflate lose ratio (zstd's match finder codes the exponent plane 10-13% above its entropy) or
  decode at a fraction of ZipNN's speed;
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
decoding), so float chunks are coded one at a time per daemon. ``zipnn_core`` keeps no state
between calls (threads share nothing); zstd coders are per thread. Nothing here imports torch:
``zipnn_core`` needs only libc and Python (tests/persistent/test_torchfree.py).
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

# The ZipNN stream (zipnn 0.5.4's ``ZipNN(input_format="byte", bytearray_dtype=..., threads=1)``,
# written here without its wrapper, which imports torch): a 32-byte header, then what
# ``zipnn_core.zipnn_core`` appends to it (and reads back in ``zipnn_core.combine_dtype``).
_ZN_HEADER = 32
_ZN_VERSION = (0, 5, 4)  # written; a reader takes any 0.5.x (the layout below is checked, not trusted)
_ZN_CHUNK_LOG2 = 18  # ZipNN codes each 256 KiB of plain bytes apart
_ZN_CHUNK = 1 << _ZN_CHUNK_LOG2
_ZN_THRESHOLD, _ZN_CHECK_AFTER_PERCENT = 0.95, 10  # a byte group coding above 95% is stored as it is
# codec: (ZipNN dtype code, byte groups (= element width), bit reorder, byte reorder); the wrapper's
# choices for these dtypes: bit reorder moves the sign bit next to the mantissa (bfloat16,
# float32), byte reorder 10 (0b01_010) is 2 groups, 220 (0b1_10_11_100) 4 groups.
_ZN_PARAMS = {
    "zipnn-bf16": (6, 2, 1, 10),
    "zipnn-f16": (4, 2, 0, 10),
    "zipnn-f32": (1, 4, 1, 220),
}


def _zn_fields(codec: str) -> bytes:
    """Bytes [5:16] of the stream header of a codec: byte reorder, bit reorder, method (0: auto),
    input format (1: bytes), delta (0), lossy type, factor, is-int (0), streaming (0), log2 of
    the chunk, dtype code."""
    code, _, bits, byte_order = _ZN_PARAMS[codec]
    return bytes((byte_order, bits, 0, 1, 0, 0, 0, 0, 0, _ZN_CHUNK_LOG2, code))


def _zn_header(codec: str, plain: int) -> bytearray:
    """The header ZipNN's wrapper writes; ``zipnn_core`` fills the stream's length in [24:32]."""
    return bytearray(b"ZN" + bytes(_ZN_VERSION) + _zn_fields(codec) + plain.to_bytes(8, "little") + bytes(8))


def _zipnn_core() -> Any:
    import zipnn_core  # ZipNN's C coder alone (the zipnn distribution); no torch, imported on first use

    return zipnn_core


def _digest(stream: bytes | memoryview, tail: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_64(stream)
    h.update(tail)
    return h.intdigest().to_bytes(_DIGEST, "little")


def _pack_zipnn(data: bytes | bytearray | memoryview, codec: str, consume: bool) -> list[bytes] | None:
    """The ZipNN body of a chunk (module docstring), or None when it has no whole element."""
    _, groups, bits, byte_order = _ZN_PARAMS[codec]
    n = len(data) - len(data) % groups
    if n == 0:
        return None
    tail = bytes(data[n:])
    mine = data if consume and isinstance(data, bytearray) and n == len(data) else bytearray(data[:n])
    stream = _zipnn_core().zipnn_core(  # rewrites the buffer it is given (the bit reorder)
        _zn_header(codec, n), mine, groups, bits, byte_order, 0, _ZN_CHUNK, _ZN_THRESHOLD,
        _ZN_CHECK_AFTER_PERCENT, 1)
    return [_digest(stream, tail), stream, tail]


def _check_zn_stream(stream: memoryview, codec: str, plain: int) -> None:
    """Raise DataLossError unless ``stream`` is a ZipNN stream of ``plain`` bytes of this codec
    whose chunk index stays inside it: the header as written, every byte group of every 256 KiB
    chunk stored as it is (type 0, exactly its plain length) or Huffman-coded (type 1, 1 byte up
    to its plain length), the groups ending where the stream ends. ``combine_dtype`` trusts all
    of it (it reads the index without knowing the stream's length)."""
    import numpy as np

    groups = _ZN_PARAMS[codec][1]
    announced = (int.from_bytes(stream[16:24], "little"), int.from_bytes(stream[24:32], "little"))
    if (bytes(stream[:4]) != b"ZN" + bytes(_ZN_VERSION[:2]) or bytes(stream[5:16]) != _zn_fields(codec)
            or announced != (plain, len(stream))):
        raise DataLossError(f"ZipNN stream header does not announce {codec}, {plain} bytes in {len(stream)}")
    chunks = -(-plain // _ZN_CHUNK)
    index = _ZN_HEADER + 9 * groups * chunks
    if len(stream) < index:
        raise DataLossError("ZipNN stream shorter than its chunk index")
    types = np.frombuffer(stream, np.uint8, groups * chunks, _ZN_HEADER).reshape(groups, chunks)
    ends = np.frombuffer(stream, "<u8", groups * chunks, _ZN_HEADER + groups * chunks).reshape(groups, chunks)
    if int(ends.max()) > len(stream):
        raise DataLossError("ZipNN chunk index points past the stream")
    lengths = np.diff(ends.astype(np.int64), axis=1, prepend=0)
    want = np.full(chunks, _ZN_CHUNK // groups, np.int64)
    want[-1] = (plain - _ZN_CHUNK * (chunks - 1)) // groups
    ok = np.where(types == 0, lengths == want, (types == 1) & (lengths > 0) & (lengths <= want))
    if not ok.all() or index + int(ends[:, -1].sum()) != len(stream):
        raise DataLossError("ZipNN chunk index does not describe the stream")


def _unpack_zipnn(body: memoryview, size: int, codec: str) -> bytes | bytearray:
    _, groups, bits, byte_order = _ZN_PARAMS[codec]
    tail = size % groups
    end = len(body) - tail
    stream = memoryview(body)[_DIGEST:end]
    if end < _DIGEST + _ZN_HEADER or _digest(stream, body[end:]) != bytes(body[:_DIGEST]):
        raise DataLossError("ZipNN stream does not match its digest")
    _check_zn_stream(stream, codec, size - tail)
    out = _zipnn_core().combine_dtype(stream[_ZN_HEADER:], groups, bits, byte_order, _ZN_CHUNK, size - tail, 1)
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
