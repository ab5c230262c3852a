"""The legacy ZipNN chunk codecs (``zipnn-bf16``, ``zipnn-f16``, ``zipnn-f32``): read, never chosen.

``auto`` stored float chunks with ZipNN (https://github.com/zipnn/zipnn; byte grouping with the
exponent in a byte of its own, each byte group Huffman-coded per 256 KiB, in C) until issue 28;
it now stores them with the byte-plane codec of :mod:`.compress`. Chunks stored under these names
still decode, where ZipNN's C module ``zipnn_core`` is installed: it is no longer a dependency of
the ``[daemon]`` extra (the ``zipnn`` distribution declares torch); ``pip install --no-deps
'zipnn>=0.5.4,<0.6'`` installs it alone (the ``zipnn`` extra). Without it such a chunk is a
:class:`FailedPreconditionError` that says so (the restore fails; nothing is marked damaged).

The stored body is an xxh3-64 (8 bytes, little endian) of what follows it: the ZipNN stream, then
the tail shorter than an element as it is. The stream is the one zipnn 0.5.4's wrapper
(``ZipNN(input_format="byte", bytearray_dtype=..., threads=1)``) writes, byte for byte, written and
parsed here without the wrapper (which imports torch). Before any byte reaches
``zipnn_core.combine_dtype`` (which trusts its input) the digest is checked, the header must be
the one this codec writes (any 0.5.x version) announcing the expected plain size and the stream's
own length, and its chunk index (a type and an end per byte group per 256 KiB) must describe the
stream exactly. Even so ZipNN's C decoder is not safe on a crafted stream (one with a recomputed
digest crashed a daemon: "free(): invalid pointer"), so it runs in a one-shot child process
(:func:`_combine_isolated`): a crash, a hang (``DECODE_TIMEOUT``) or a wrong output length there is
a :class:`DataLossError`, and the daemon goes on. That costs a process start per chunk (~50 ms):
a legacy path. Encoding (tests and benchmarks only: no ``codec`` setting writes ZipNN) calls
``zipnn_core`` in process, on the daemon's own bytes. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from typing import Any

import xxhash
from tierckpt.errors import DataLossError, FailedPreconditionError

from .codec import ChunkCodec

__all__ = ["ZIPNN", "INSTALL", "ZipNNCodec"]

ZIPNN = {"bfloat16": "zipnn-bf16", "float16": "zipnn-f16", "float32": "zipnn-f32"}
"""The ZipNN codec of each float dtype (read; written only when named explicitly)."""

INSTALL = "pip install --no-deps 'zipnn>=0.5.4,<0.6'"
"""How to install ZipNN's decoder without torch (the ``zipnn`` extra of tierckpt)."""

DECODE_TIMEOUT = 60.0
"""Seconds the isolated ZipNN decoder may take for one chunk before it is killed."""

_DIGEST = 8  # xxh3-64 of the ZipNN stream and the tail, ahead of them
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

# The child: reads "<5Q" (groups, bit reorder, byte reorder, ZipNN chunk, plain size) and the checked
# stream (after its header) on stdin, writes the plain bytes on stdout; exit 3: no zipnn_core.
_CHILD = """
import struct, sys
try:
    import zipnn_core
except ImportError:
    sys.exit(3)
data = memoryview(sys.stdin.buffer.read())
groups, bits, order, chunk, size = struct.unpack_from("<5Q", data)
sys.stdout.buffer.write(zipnn_core.combine_dtype(data[40:], groups, bits, order, chunk, size, 1))
"""


def _zn_fields(codec: str) -> bytes:
    """Bytes [5:16] of the stream header of a codec: byte reorder, bit reorder, method (0: auto),
    input format (1: bytes), delta (0), lossy type, factor, is-int (0), streaming (0), log2 of
    the chunk, dtype code."""
    code, _, bits, byte_order = _ZN_PARAMS[codec]
    return bytes((byte_order, bits, 0, 1, 0, 0, 0, 0, 0, _ZN_CHUNK_LOG2, code))


def _zn_header(codec: str, plain: int) -> bytearray:
    """The header ZipNN's wrapper writes; ``zipnn_core`` fills the stream's length in [24:32]."""
    return bytearray(b"ZN" + bytes(_ZN_VERSION) + _zn_fields(codec) + plain.to_bytes(8, "little") + bytes(8))


def _missing(codec: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"chunk of codec {codec!r} needs ZipNN's decoder (zipnn_core), which is not "
                                   f"installed: {INSTALL}")


def _zipnn_core(codec: str) -> Any:
    try:
        import zipnn_core  # ZipNN's C coder alone (the zipnn distribution); no torch, imported on first use
    except ImportError:
        raise _missing(codec) from None
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
    stream = _zipnn_core(codec).zipnn_core(  # rewrites the buffer it is given (the bit reorder)
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


def _combine_isolated(codec: str, stream: memoryview, plain: int) -> bytes:
    """``zipnn_core.combine_dtype`` on a checked stream, in a one-shot child process."""
    if importlib.util.find_spec("zipnn_core") is None:
        raise _missing(codec)
    _, groups, bits, byte_order = _ZN_PARAMS[codec]
    request = struct.pack("<5Q", groups, bits, byte_order, _ZN_CHUNK, plain) + stream[_ZN_HEADER:]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=request, capture_output=True,
                              timeout=DECODE_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise DataLossError(f"chunk of codec {codec!r}: ZipNN's decoder took over {DECODE_TIMEOUT:.0f} s "
                            "(killed)") from None
    if done.returncode == 3:
        raise _missing(codec)
    if done.returncode != 0:
        why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        raise DataLossError(f"chunk of codec {codec!r}: ZipNN's decoder failed on it ({why}, in its own process)")
    if len(done.stdout) != plain:
        raise DataLossError(f"chunk of codec {codec!r}: ZipNN's decoder gave {len(done.stdout)} bytes, not {plain}")
    return done.stdout


def _unpack_zipnn(body: memoryview, size: int, codec: str) -> bytes:
    groups = _ZN_PARAMS[codec][1]
    tail = size % groups
    end = len(body) - tail
    stream = memoryview(body)[_DIGEST:end]
    if end < _DIGEST + _ZN_HEADER or _digest(stream, body[end:]) != bytes(body[:_DIGEST]):
        raise DataLossError("ZipNN stream does not match its digest")
    _check_zn_stream(stream, codec, size - tail)
    out = _combine_isolated(codec, stream, size - tail)
    return out + bytes(body[end:]) if tail else out


class ZipNNCodec(ChunkCodec):
    """One legacy ZipNN codec (module docstring)."""

    overwrites_input = True

    def __init__(self, name: str) -> None:
        self.name = name

    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        return _pack_zipnn(data, self.name, consume)

    def unpack(self, body: memoryview, size: int) -> bytes | bytearray:
        return _unpack_zipnn(body, size, self.name)
