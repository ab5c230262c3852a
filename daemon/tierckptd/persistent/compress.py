"""Lossless chunk codecs of the content layout (:mod:`.content`), chosen per shard.

A shard is stored as chunks; every chunk of a shard goes through the codec its manifest names
(``shards[].codec``):

- ``raw``: the bytes as they are;
- ``zstd``: zstandard, level ``LEVEL``;
- ``bp2-zstd`` / ``bp4-zstd`` (what ``auto`` picks for float16/bfloat16 resp. float32): byte
  planes, each coded as one zstd frame. The chunk is split into byte planes (byte 0 of every 2- or
  4-byte element, then byte 1, ...: the top plane holds the sign and the exponent's high bits, the
  others mantissa bits). Since issue 28 item 2's decode work, a plane's frame holds its literals
  alone, Huffman-coded per 128 KiB block with no matches (:func:`.zstdlib.literal_frame`: ZipNN's
  code, a table per 256 KiB there), written with libblosc2's zstd Huffman coder; where that is not
  available (and in chunks written before), zstd with ``PLANE_PARAMS`` (minimum match 7, a 64-entry
  hash table, 128 KiB blocks: mostly literals, a few matches). Both are plain zstd frames: every
  decoder reads either; a frame of literals alone is decoded block by block straight into the
  merge (:func:`.byteshuffle.merge_blocks`), others by zstd's frame decoder into a per-thread
  buffer (:mod:`.zstdlib`) or by python-zstandard. A plane is stored raw when it does not shrink
  (decided on a 64 KiB sample first for planes over 256 KiB: the mantissa planes are noise).
  Body: per plane a mode byte (0 raw, 1 zstd), its length (4 bytes, little endian) and its bytes;
  then the tail shorter than an element as it is. Planes are split and merged by libblosc2's byte
  shuffle in one compiled pass (:mod:`.byteshuffle`; numpy makes the same bytes where the library
  is missing). Measured against ZipNN in bench/README.md ("Issue 28, item 2"): at most 1.015x
  ZipNN's bytes on bench/incremental.py's tensors;
- ``zipnn-bf16`` / ``zipnn-f16`` / ``zipnn-f32``: ZipNN, what ``auto`` wrote before issue 28;
  still read (:mod:`.zipnn`: its decoder runs in a child process, and needs ZipNN's C module);
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

Bounds (stored bytes are hostile, issue 27): a decoder never makes more than the size the
manifest gives the chunk (a zstd frame must announce exactly the size it is read as, before it is
decoded: zstandard sizes its output by the frame's own header), and anything malformed is a
:class:`DataLossError` (tests/persistent/test_codec_fuzz.py). Everything here is blocking; the tier
calls it from worker threads, and zstd, libblosc2 (ctypes) and numpy release the GIL: chunks are coded on as many
cores as there are threads coding (``KNOBS.codec_threads`` / ``read_threads``). zstd coders are
per thread. Nothing here imports torch (tests/persistent/test_torchfree.py).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from tierckpt.errors import DataLossError, FailedPreconditionError

from . import byteshuffle, zstdlib
from .codec import ChunkCodec, chunk_codec, register_codec
from .zipnn import ZIPNN, ZipNNCodec

__all__ = ["CODECS", "SETTINGS", "PLANES", "ZIPNN", "choose", "encode", "encode_into", "decode", "warm", "LEVEL"]

LEVEL = 3
"""zstd level of the ``zstd`` codec (zstd's default)."""

PLANE_LEVEL = 1
"""zstd level of each byte plane of the ``bg*`` codecs."""

PLANE_PARAMS = {"window_log": 17, "hash_log": 6, "chain_log": 6, "search_log": 1, "min_match": 7,
                "target_length": 0}
"""zstd parameters (strategy "fast") of each byte plane of the ``bp*`` codecs: the smallest hash
table, the longest minimum match, 128 KiB blocks (a block is at most the window): few matches,
literals Huffman-coded per block (bench/README.md, "Issue 28": the smallest and fastest setting
measured on the exponent plane). Used where libblosc2's Huffman coder is not available
(:func:`_plane_coder`); chunks written with it before still decode."""

PLANES = {"bfloat16": "bp2-zstd", "float16": "bp2-zstd", "float32": "bp4-zstd"}
"""The byte-plane codec of each float dtype (``auto``'s choice)."""

CODECS = ("raw", "zstd", "bp2-zstd", "bp4-zstd", "bg2-zstd", "bg4-zstd", *ZIPNN.values())
"""Every chunk codec a manifest may name."""

SETTINGS = ("auto", "none", "zstd", "bg-zstd")
"""Values of the ``codec`` setting: ``auto`` (by dtype: byte planes + zstd for float16/bfloat16/
float32, zstd for the rest), ``none`` (raw), ``zstd`` (plain zstd for every shard), ``bg-zstd``
(the older rotated byte planes + zstd by element size where the dtype has one, else zstd)."""

_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4}
_RAW, _PACKED = b"\x00", b"\x01"
_UINT = {2: "<u2", 4: "<u4"}
_SAMPLE = 1 << 16  # bytes of a large plane compressed first: a plane that does not shrink there is stored raw
_local = threading.local()
_KEEP = 64 << 20  # bytes of decoded planes a thread keeps between chunks (an 8 MiB chunk needs at most 8 MiB)
_NUMPY = {"<f4": "float32", "<f2": "float16", "<i2": "int16", "<u2": "uint16", "<i4": "int32", "<u4": "uint32"}


def warm() -> None:
    """Import what the codecs run on (numpy ~0.2 s, zstandard) and make this thread's coders, so
    that a persistent tier's first restore or drain does not pay it (issue 28: the first restore of
    a fresh daemon took 2.5x a warm one before; bench/first_restore.py). Called at the tier's start."""
    import numpy  # noqa: F401

    _zstd(None)
    _zstd()


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
    if setting == "auto" and dtype in PLANES:
        return PLANES[dtype]
    width = _WIDTH.get(dtype, 0)
    if setting != "bg-zstd" or width == 0:
        return "zstd"
    return f"bg{width}-zstd"


def _zstd(level: int | None = LEVEL) -> tuple[Any, Any]:
    """This thread's (compressor, decompressor) of a zstd level, or of :data:`PLANE_PARAMS` (None)."""
    import zstandard  # the [daemon] extra; imported on first use so a raw tier needs nothing

    pairs = getattr(_local, "zstd", None)
    if pairs is None:
        pairs = _local.zstd = {}
    if level not in pairs:
        comp = (zstandard.ZstdCompressor(level=level) if level is not None else zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(strategy=zstandard.STRATEGY_FAST, **PLANE_PARAMS)))
        pairs[level] = (comp, zstandard.ZstdDecompressor())
    return pairs[level]


def _unzstd(frame: bytes | memoryview, size: int, level: int | None = LEVEL) -> bytes:
    """The ``size`` bytes a zstd frame holds. The frame must announce exactly that size before a
    byte is decoded: zstandard sizes its output by the frame's header, not by ``max_output_size``
    (a 12-byte frame announcing 1 TiB would be allocated), and an unknown size is not written here."""
    import zstandard

    announced = zstandard.frame_content_size(frame)
    if announced != size:
        raise DataLossError(f"zstd frame announces {announced} bytes, expected {size}")
    return _zstd(level)[1].decompress(frame, max_output_size=size, allow_extra_data=False)


def _planes(data: bytes | bytearray | memoryview, width: int) -> list[Any]:
    """Rotate each element left by one bit, then split into ``width`` byte planes (+ the tail)."""
    import numpy as np  # imported on first use: the layout reads codec names without numpy

    n = len(data) - len(data) % width
    x = np.frombuffer(data, _UINT[width], n // width)
    bits = 8 * width
    x = (x << 1) | (x >> (bits - 1))
    planes = memoryview(byteshuffle.split(x.view(np.uint8), width))
    count = n // width
    return [planes[k * count:(k + 1) * count] for k in range(width)] + [bytes(data[n:])]


def _unplanes(planes: list[Any], width: int) -> bytes:
    import numpy as np

    x = np.frombuffer(byteshuffle.merge(planes[:width], b"", width), _UINT[width])
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
    pos, planes = 0, []
    sizes = [size // width] * width + [size % width]
    for want in sizes:
        mode, (length,) = body[pos:pos + 1], struct.unpack_from("<I", body, pos + 1)
        part = body[pos + 5:pos + 5 + length]
        pos += 5 + length
        plane = part if mode == _RAW else _unzstd(part, want, PLANE_LEVEL)
        if len(plane) != want or mode not in (_RAW, _PACKED):
            raise DataLossError(f"byte plane of {len(plane)} bytes, expected {want}")
        planes.append(plane)
    if pos != len(body):
        raise DataLossError("trailing bytes after the byte planes")
    return _unplanes(planes, width)


def _plane_coder() -> Any:
    """What codes one byte plane into a zstd frame: literals alone, Huffman-coded per 128 KiB
    block (:func:`.zstdlib.literal_frame`: decoded 10-25% faster than zstd's frames with the rare
    matches of :data:`PLANE_PARAMS`, bench/README.md "Issue 28, item 2"), or, where libblosc2's
    Huffman coder is not available, zstd with :data:`PLANE_PARAMS`. Either is one zstd frame:
    every decoder of ``bp*`` reads both."""
    if zstdlib.available() and zstdlib.huffman():
        return zstdlib.literal_frame
    return _zstd(None)[0].compress


def _pack_plane(plane: Any) -> list[Any]:
    """Mode, length and bytes of one byte plane of a ``bp*`` body (raw unless zstd shrinks it)."""
    code = _plane_coder()
    if len(plane) > 4 * _SAMPLE and len(code(plane[:_SAMPLE])) >= _SAMPLE * 0.97:
        packed = None  # noise (a mantissa plane): not worth coding in full
    else:
        packed = code(plane)
    body, mode = (packed, _PACKED) if packed is not None and len(packed) < len(plane) else (plane, _RAW)
    return [mode, len(body).to_bytes(4, "little"), body]


def _pack_bp(data: bytes | bytearray | memoryview, width: int) -> list[Any]:
    """The ``bp*`` body of a chunk (module docstring) as parts to join: its byte planes in one
    compiled pass (:mod:`.byteshuffle`), each coded by :func:`_pack_plane`, then the tail."""
    count = len(data) // width
    # plane k: byte k of every element; then the tail. Into this thread's kept buffer: parts are
    # views of it, used (joined or written out) before this thread packs again
    planes = memoryview(byteshuffle.split(data, width, _split_buffer(len(data))))
    parts = [part for k in range(width) for part in _pack_plane(planes[k * count:(k + 1) * count])]
    return [*parts, bytes(planes[count * width:])]


def _split_buffer(size: int) -> Any:
    """This thread's buffer of byte planes for :func:`_pack_bp`, ``size`` bytes: kept between
    chunks (up to ``_KEEP``), so a drain's encode does not map, fault in and zero a fresh 8 MiB
    array per chunk (issue 28 item 3: the drain's memory traffic competes with saves)."""
    import numpy as np

    held = getattr(_local, "split", None)
    if held is None or len(held) < size:
        held = np.empty(max(size, 1), np.uint8)
        if size <= _KEEP:
            _local.split = held
    return held[:size]


def _unzstd_plane(frame: memoryview, count: int, slot: int) -> Any:
    """The ``count`` bytes of the zstd-coded byte plane ``slot`` of a ``bp*`` body: decoded by
    libblosc2's zstd into this thread's plane buffer (:mod:`.zstdlib`: no new object whose pages
    are faulted in, bench/README.md "Issue 28, item 2"), else by python-zstandard. The buffer is
    reused by this thread's next decode: the merge copies the planes out before returning."""
    if not zstdlib.available():
        return memoryview(_unzstd(frame, count, None))
    import numpy as np

    need = (slot + 1) * count
    held = getattr(_local, "planes", None)
    if held is None or len(held) < need:
        held = np.zeros(need, np.uint8)
        if need <= _KEEP:
            _local.planes = held
    plane = held[slot * count:need]
    try:
        zstdlib.decompress_into(frame, plane.ctypes.data, count)
    except ValueError as err:
        raise DataLossError(f"byte plane {slot}: {err}") from None
    return plane


def _unpack_bp(body: memoryview, size: int, width: int) -> bytearray:
    """The chunk of a ``bp*`` body: its planes (decoded when coded, else where they lie in the
    body) merged into elements in one compiled pass (:func:`.byteshuffle.merge`). A chunk whose
    one coded plane is a frame of literals alone (:func:`.zstdlib.literal_frame`, what this
    encoder writes) has that plane decoded block by block into the merge itself
    (:func:`.byteshuffle.merge_blocks`)."""
    count, pos, parts = size // width, 0, []
    for _ in range(width):
        if pos + 5 > len(body):
            raise DataLossError("byte planes cut short")
        mode, length = body[pos:pos + 1], int.from_bytes(body[pos + 1:pos + 5], "little")
        part = body[pos + 5:pos + 5 + length]
        pos += 5 + length
        if mode not in (_PACKED, _RAW):
            raise DataLossError(f"byte plane of unknown mode {bytes(mode)!r}")
        if mode == _RAW and len(part) != count:
            raise DataLossError(f"byte plane of {len(part)} bytes, expected {count}")
        parts.append((mode == _PACKED, part))
    if len(body) - pos != size - count * width:
        raise DataLossError(f"{len(body) - pos} bytes after the byte planes, expected {size - count * width}")
    tail = body[pos:]
    coded = [k for k, (packed, _) in enumerate(parts) if packed]
    if len(coded) == 1 and byteshuffle.native() is not None and 0 < size <= byteshuffle.MAX:
        try:
            blocks = zstdlib.literal_blocks(parts[coded[0]][1], count)
            if blocks is not None:
                return byteshuffle.merge_blocks([p for _, p in parts], coded[0], blocks, zstdlib.put_block, tail,
                                                width)
        except ValueError as err:
            raise DataLossError(f"byte plane {coded[0]}: {err}") from None
    planes = [_unzstd_plane(part, count, k) if packed else part for k, (packed, part) in enumerate(parts)]
    return byteshuffle.merge(planes, tail, width)


class _Planes(ChunkCodec):
    def __init__(self, width: int) -> None:
        self.width = width
        self.name = f"bp{width}-zstd"

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[Any] | None:
        return _pack_bp(data, self.width) if len(data) >= self.width else None

    def unpack(self, body: memoryview, size: int) -> bytearray:
        return _unpack_bp(body, size, self.width)


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
        return _unzstd(body, size)


class _BytePlanes(ChunkCodec):
    def __init__(self, width: int) -> None:
        self.width = width
        self.name = f"bg{width}-zstd"

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return [_pack_planes(data, self.width)]

    def unpack(self, body: memoryview, size: int) -> bytes:
        return _unpack_planes(body, size, self.width)


for _codec in (_Raw(), _Zstd(), _Planes(2), _Planes(4), _BytePlanes(2), _BytePlanes(4),
               *(ZipNNCodec(n) for n in ZIPNN.values())):
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


def encode_into(codec: str, data: bytes | bytearray | memoryview, out: Any) -> int:
    """:func:`encode` written straight into ``out`` (a writable buffer of at least ``len(data) +
    1`` bytes: a drain worker's shared output buffer); returns the stored length. The same stored
    bytes as :func:`encode`, without joining the codec's parts into a new object first (one pass
    over the stored bytes fewer, and no fresh allocation per chunk: issue 28 item 3).

    Raises:
        DataLossError: no chunk codec of that name is registered.
        ValueError: ``out`` is shorter than ``len(data) + 1`` (nothing is written).
    """
    dst = memoryview(out).cast("B")
    size = len(data)
    if len(dst) < size + 1:
        raise ValueError(f"an output buffer of {len(dst)} bytes for a chunk of {size}")
    parts = chunk_codec(codec).pack(data, False)
    if parts is None or sum(map(len, parts)) >= size:
        dst[0:1] = _RAW
        dst[1:size + 1] = memoryview(data).cast("B")
        return size + 1
    dst[0:1], pos = _PACKED, 1
    for part in parts:
        view = memoryview(part).cast("B")
        dst[pos:pos + len(view)] = view
        pos += len(view)
    return pos


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
    except (DataLossError, FailedPreconditionError):
        raise
    except Exception as err:  # zstandard.ZstdError, numpy's ValueError and friends: corrupt bytes
        raise DataLossError(f"chunk of codec {codec!r} cannot be decoded: {err}") from err
    if len(out) != size:
        raise DataLossError(f"chunk of codec {codec!r} decodes to {len(out)} bytes, not {size}")
    return out
