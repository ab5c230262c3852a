"""Byte planes coded as zstd frames of Huffman-coded literals alone, through libblosc2's zstd
(:mod:`tierckptd.persistent.zstdlib`), read by every decoder, and hostile frames refused cleanly.

The frames :func:`zstdlib.literal_frame` writes are plain zstd: python-zstandard reads them (so a
daemon without the fast path, or an older one, reads new chunks); the fast path and zstd's frame
API give the same bytes; chunks written by the previous encoder (zstd frames with matches) and
by this one decode alike on every path (libblosc2 on or off); corrupt frames are a
:class:`DataLossError` or decode to something the checksum refuses, never a crash or a write
past the plane (the stored examples of data/golden_chunks.json are decoded in test_codec.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import zstandard
from tierckpt.errors import DataLossError
from tierckptd.persistent import byteshuffle, compress, zstdlib

huffman_only = pytest.mark.skipif(not zstdlib.huffman(), reason="libblosc2 with zstd 1.5.5+ not installed")


def _plane(size: int, seed: int) -> bytes:
    """An exponent-like plane: a few byte values, skewed (what Huffman coding is for)."""
    rng = np.random.default_rng(seed)
    return (120 + np.clip(rng.normal(0, 2, size), -8, 8)).astype(np.uint8).tobytes()


def _floats(dtype: str, size: int, seed: int) -> bytes:
    x = (np.random.default_rng(seed).standard_normal(size // 2 + 1) * 0.02).astype(np.float32)
    whole = {"float32": x.tobytes(), "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[dtype]
    return whole[:size]


@pytest.fixture(params=["native", "python-zstandard"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    zstdlib.use_native(request.param == "native")
    try:
        yield request.param
    finally:
        zstdlib.use_native(True)


def _decoded(frame: bytes, size: int) -> bytes:
    out = np.zeros(size + 64, np.uint8)
    out[size:] = 0xAB
    zstdlib.decompress_into(memoryview(frame), out.ctypes.data, size)
    assert (out[size:] == 0xAB).all()  # nothing written past the plane
    return out[:size].tobytes()


@huffman_only
@pytest.mark.parametrize("size", [1, 255, 256, 1000, 1 << 17, (1 << 17) + 1, 300_001])
def test_literal_frames_are_zstd_frames_read_alike_by_both_decoders(size: int) -> None:
    for plane in (_plane(size, 1), bytes(size), random.Random(size).randbytes(size)):  # skewed, RLE, noise
        frame = zstdlib.literal_frame(plane)
        assert frame is not None and zstandard.frame_content_size(frame) == size
        assert zstandard.ZstdDecompressor().decompress(frame) == plane
        assert _decoded(frame, size) == plane
    if size >= 256:  # it codes (shorter blocks are stored raw)
        assert len(zstdlib.literal_frame(_plane(size, 1)) or b"") < size * 0.6 + 64


@huffman_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size", [2, 3, 1001, 65_537, (1 << 20) + 3, (3 << 20) + 2])
def test_chunks_of_either_plane_coder_decode_alike_on_every_path(dtype: str, size: int, path: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks stored before (zstd frames with matches) and now (literal frames) decode with the
    fast path, with python-zstandard, and with numpy's merge."""
    codec = compress.PLANES[dtype]
    data = _floats(dtype, size, size)
    new = compress.encode(codec, data)
    with monkeypatch.context() as m:
        m.setattr(compress, "_plane_coder", lambda: compress._zstd(None)[0].compress)
        old = compress.encode(codec, data)
    for stored in (new, old):
        assert compress.decode(codec, stored, size) == data
        byteshuffle.use_native(False)
        try:
            assert compress.decode(codec, stored, size) == data
        finally:
            byteshuffle.use_native(True)


def test_without_the_huffman_coder_planes_are_zstd_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zstdlib, "huffman", lambda: False)
    data = _floats("float32", 1 << 20, 5)
    stored = compress.encode("bp4-zstd", data)
    assert compress.decode("bp4-zstd", stored, len(data)) == data
    body, planes = memoryview(stored)[1:], []
    pos = 0
    for _ in range(4):
        length = int.from_bytes(body[pos + 1:pos + 5], "little")
        planes.append((body[pos], body[pos + 5:pos + 5 + length]))
        pos += 5 + length
    coded = [p for mode, p in planes if mode == 1]
    assert coded and all(zstdlib.literal_blocks(p, (1 << 20) // 4) is None for p in coded)


@huffman_only
def test_corrupt_literal_frames_are_data_loss_never_a_crash() -> None:
    """Bits flipped, lengths forged, blocks cut: the decoder refuses or makes bytes of the right
    size (the checksum of the content layout catches those), and never writes past the plane."""
    size = 300_001
    plane = _plane(size, 7)
    frame = zstdlib.literal_frame(plane)
    assert frame is not None
    rng = random.Random(11)
    refused = 0
    for i in range(1500):
        b = bytearray(frame)
        choice = i % 4
        if choice == 0:
            for _ in range(rng.randrange(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif choice == 1:  # a header byte of the frame, of a block or of a literals section
            b[rng.randrange(min(len(b), 40))] = rng.randrange(256)
        elif choice == 2:
            b = b[:rng.randrange(len(b))]
        else:
            b += rng.randbytes(rng.randrange(1, 9))
        try:
            got = _decoded(bytes(b), size)
        except ValueError:
            refused += 1
            continue
        assert len(got) == size
    assert refused > 750


@huffman_only
def test_a_corrupt_literal_plane_in_a_chunk_is_data_loss() -> None:
    data = _floats("float32", 1 << 20, 8)
    stored = bytearray(compress.encode("bp4-zstd", data))
    body = memoryview(stored)[1:]
    pos = 0
    for _ in range(4):  # the coded plane: flip bytes inside its Huffman streams
        length = int.from_bytes(body[pos + 1:pos + 5], "little")
        if body[pos] == 1:
            for k in range(pos + 40, pos + 5 + length, 997):
                body[k] ^= 0x5A
        pos += 5 + length
    try:
        out = compress.decode("bp4-zstd", bytes(stored), len(data))
    except DataLossError:
        return
    assert out != data  # decoded garbage of the right size: the content layout's checksum refuses it


@huffman_only
def test_blocks_reusing_the_last_table_decode_and_never_come_first() -> None:
    """A stationary plane's later blocks reuse the first block's Huffman table (zstd's "treeless"
    literals), read alike by python-zstandard and the fast path; a frame whose first coded block
    claims a table before any is refused (zstd refuses it too)."""
    size = 1 << 20
    plane = _plane(size, 7)
    frame = zstdlib.literal_frame(plane)
    assert frame is not None
    kinds = [block[0] for block in zstdlib.literal_blocks(frame, size) or []]
    assert kinds[0] == 2 and 3 in kinds
    assert zstandard.ZstdDecompressor().decompress(frame) == plane == _decoded(frame, size)
    forged = bytearray(frame)
    forged[16] |= 1  # the first literals section: type 2 (with its table) -> 3 (the last table)
    with pytest.raises(ValueError, match="before any"):
        _decoded(bytes(forged), size)
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(bytes(forged))
