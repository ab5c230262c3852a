"""Issue 28 item 3: the drain's chunk workers touch each byte as few times as they can. A child
hashes a chunk a cache-sized piece at a time and writes the stored form straight into the daemon's
shared buffer (:func:`.compress.encode_into`, no joined copy): the bytes that come back must be
exactly :func:`.compress.encode`'s, decode byte-exact, and every check still holds (the chunk's
hash, the shard's checksum, a short file, an answer that claims more bytes than fit)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from tierckpt.common import checksum
from tierckpt.errors import DataLossError
from tierckptd.persistent import byteshuffle, compress
from tierckptd.persistent.chunkproc import _PIECE, ChunkWorker
from tierckptd.persistent.planeout import WIDTHS, PlaneWriter, slack

_CODECS = ["raw", "zstd", "bp2-zstd", "bp4-zstd", "bg2-zstd", "bg4-zstd"]


def _data(kind: str, size: int) -> bytes:
    rng = np.random.default_rng(size)
    if kind == "weights":  # compressible float32: its exponent planes shrink
        return (rng.standard_normal(size // 4 + 1) * 0.02).astype("<f4").tobytes()[:size]
    if kind == "noise":  # nothing shrinks: stored raw
        return rng.integers(0, 256, size, np.uint8).tobytes()
    return bytes(size)


@pytest.mark.parametrize("codec", _CODECS)
@pytest.mark.parametrize("kind", ["weights", "noise", "zeros"])
@pytest.mark.parametrize("size", [1, 7, 4099, 3 * 65536 + 5])
def test_encode_into_writes_exactly_what_encode_returns(codec: str, kind: str, size: int) -> None:
    data = _data(kind, size)
    out = bytearray(b"\xee" * (size + 9))
    n = compress.encode_into(codec, memoryview(data), out)
    assert bytes(out[:n]) == compress.encode(codec, data)
    assert out[n:] == b"\xee" * (size + 9 - n)  # nothing written past the stored form
    assert bytes(compress.decode(codec, bytes(out[:n]), size)) == data


def test_encode_into_a_buffer_too_short_writes_nothing() -> None:
    data = _data("noise", 1000)
    out = bytearray(1000)  # one byte short of the raw form
    with pytest.raises(ValueError, match="output buffer"):
        compress.encode_into("zstd", data, out)
    assert out == bytearray(1000)


def test_a_packed_chunk_does_not_change_when_the_thread_packs_the_next() -> None:
    """The byte planes live in a buffer the thread keeps: what encode returned is its own."""
    a, b = _data("weights", 1 << 20), _data("weights", (1 << 20) - 4)
    first = compress.encode("bp4-zstd", a)
    kept = bytes(first)
    compress.encode("bp4-zstd", b)
    assert first == kept and bytes(compress.decode("bp4-zstd", first, len(a))) == a


@pytest.mark.parametrize("codec", sorted(WIDTHS))
@pytest.mark.parametrize("kind", ["weights", "noise", "zeros"])
@pytest.mark.parametrize("size,piece", [(1, 4), (7, 4), (4099, 1024), (3 * 65536 + 5, 65536), (1 << 20, 1 << 18)])
def test_planes_split_piece_by_piece_store_exactly_what_encode_returns(codec: str, kind: str, size: int,
                                                                        piece: int) -> None:
    if byteshuffle.native() is None:
        pytest.skip("libblosc2 is not installed")
    data = _data(kind, size)
    out = bytearray(b"\xee" * (size + 1 + slack(WIDTHS[codec]) + 3))
    writer = PlaneWriter(WIDTHS[codec], size, out)
    for at in range(0, size, piece):
        writer.put(memoryview(bytearray(data[at:at + piece])))  # a buffer reused by the reader
    n = writer.finish()
    assert bytes(out[:n]) == compress.encode(codec, data)
    assert out[-3:] == b"\xee" * 3  # nothing written past the buffer it was given
    assert bytes(compress.decode(codec, bytes(out[:n]), size)) == data


def test_planes_refuse_a_short_buffer_a_misaligned_piece_and_a_missing_one() -> None:
    if byteshuffle.native() is None:
        pytest.skip("libblosc2 is not installed")
    with pytest.raises(ValueError, match="output buffer"):
        PlaneWriter(4, 1000, bytearray(1000 + slack(4)))
    writer = PlaneWriter(4, 1000, bytearray(1001 + slack(4)))
    with pytest.raises(ValueError, match="piece"):
        writer.put(b"\x01" * 6)  # not whole elements, and not the chunk's end
    writer = PlaneWriter(4, 1000, bytearray(1001 + slack(4)))
    writer.put(b"\x01" * 996)
    with pytest.raises(ValueError, match="were put"):
        writer.finish()
    with pytest.raises(ValueError, match="piece"):
        writer.put(b"\x01" * 8)  # past the chunk's end


@pytest.fixture()
def shard(tmp_path: Path):
    size = 3 * _PIECE + 12345  # several pieces and a partial one
    data = _data("weights", size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    worker = ChunkWorker(size)
    try:
        yield worker, fd, data, path
    finally:
        os.close(fd)
        worker.close()


@pytest.mark.parametrize("codec", ["bp4-zstd", "bp2-zstd", "zstd", "raw"])
def test_a_chunk_worker_returns_the_encoded_chunk_byte_exact(shard, codec: str) -> None:
    worker, fd, data, _ = shard
    digest = worker.hash(fd, 0, len(data), True, checksum.digest(data), "shard")
    assert digest == xxhash.xxh3_128_hexdigest(data)  # hashed piece by piece: the same digest
    for _ in range(2):  # the output mapping is kept between requests
        view = worker.encode(fd, 0, len(data), digest, codec, "shard")
        assert bytes(view) == compress.encode(codec, data)
        assert bytes(compress.decode(codec, bytes(view), len(data))) == data
        view.release()
    assert not worker.broken


def test_a_chunk_worker_checks_the_shard_checksum_over_its_chunks(shard) -> None:
    worker, fd, data, _ = shard
    half = len(data) // 2
    first = worker.hash(fd, 0, half, True, None, "shard")
    assert first == xxhash.xxh3_128_hexdigest(data[:half])
    worker.hash(fd, half, len(data) - half, False, checksum.digest(data), "shard")
    worker.hash(fd, 0, half, True, None, "shard")
    with pytest.raises(DataLossError, match="does not match its checksum"):
        worker.hash(fd, half, len(data) - half, False, checksum.digest(data[:-1] + b"\x00"), "shard")
    assert not worker.broken  # data loss is the shard's, not the worker's


def test_a_chunk_worker_refuses_bytes_that_changed_since_they_were_hashed(shard) -> None:
    worker, fd, data, path = shard
    digest = worker.hash(fd, 0, len(data), True, None, "shard")
    changed = bytearray(data)
    changed[2 * _PIECE + 3] ^= 1  # in a later piece
    path.write_bytes(bytes(changed))
    for codec in ("bp4-zstd", "zstd"):
        with pytest.raises(DataLossError, match="changed while uploading"):
            worker.encode(fd, 0, len(data), digest, codec, "shard")


def test_a_chunk_worker_finds_a_local_file_cut_short(shard) -> None:
    worker, fd, data, path = shard
    os.truncate(path, len(data) - 100)
    with pytest.raises(DataLossError, match="ends at"):
        worker.hash(fd, 0, len(data), True, None, "shard")
    for codec in ("bp4-zstd", "zstd"):
        with pytest.raises(DataLossError, match="ends at"):
            worker.encode(fd, 0, len(data), xxhash.xxh3_128_hexdigest(data), codec, "shard")


@pytest.mark.parametrize("stored", [0, -1, "size + 2", "huge"])
def test_a_chunk_worker_answer_claiming_more_than_fits_is_refused(shard, stored, monkeypatch) -> None:
    worker, fd, data, _ = shard
    n = {"size + 2": len(data) + 2, "huge": 1 << 40}.get(stored, stored)
    monkeypatch.setattr(worker, "call", lambda request, fds: {"stored": n})
    with pytest.raises(OSError, match="stored bytes for a chunk"):
        worker.encode(fd, 0, len(data), "0" * 32, "zstd", "shard")
    assert worker.broken  # not lent again
