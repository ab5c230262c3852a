"""The transform seam (a codec other than the identity is recorded per shard and read back) and the
chunk codecs of the content layout (round trips, stored raw when not smaller, corrupt input,
names written by older daemons)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import contextlib
import json
import random
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from tierckpt.errors import DataLossError
from tierckptd.knobs import KNOBS
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import ShardCodec, compress, manifest_key, register_codec, zipnn
from tierckptd.persistent.layout import content_key

from .rig import Rig


class _Zlib(ShardCodec):
    name = "test-zlib"

    @contextlib.contextmanager
    def encoded(self, path: Path) -> Iterator[Path]:
        out = path.with_name(path.name + ".z")
        out.write_bytes(zlib.compress(path.read_bytes()))
        try:
            yield out
        finally:
            out.unlink()

    def download_into(self, get: Callable[[Path], None], path: Path) -> None:
        tmp = path.with_name(path.name + ".z")
        get(tmp)
        path.write_bytes(zlib.decompress(tmp.read_bytes()))
        tmp.unlink()


def test_a_codec_transforms_the_stored_bytes_and_checksums_cover_the_plain_ones(tmp_path: Path) -> None:
    register_codec(_Zlib())
    plain = b"checkpoint " * 1000

    async def body() -> None:
        writer = Rig(tmp_path, node_id="a", codec=_Zlib())
        await writer.tier.start()
        saved = writer.save("job", 1, 0, {"model": plain})
        await asyncio.wait_for(writer.tier.wait("job", 1, 0, None), 10)
        stored = Manifest.from_json(writer.memory.get_bytes(manifest_key("job", 1, 0, 1)))
        assert [(s.codec, s.checksum, s.size) for s in stored.shards] == \
            [("test-zlib", saved.shards[0].checksum, len(plain))]
        data_keys = writer.memory.list("job/data/")
        assert len(data_keys) == 1 and zlib.decompress(writer.memory.get_bytes(data_keys[0])) == plain
        await writer.tier.stop(1.0)

        reader = Rig(tmp_path, node_id="b", memory=writer.memory)
        await reader.tier.start()
        local = await reader.tier.fetch("job", 1, 0)
        assert reader.store.shard_path(local, "model").read_bytes() == plain
        await reader.tier.stop(1.0)

    asyncio.run(body())


def test_the_identity_leaves_manifests_as_they_were() -> None:
    man = Manifest("job", 1, 0, 1, "n0", "g", ())
    assert b"codec" not in Manifest.from_json(man.to_json()).to_json()


# ------------------------------------------------------------------ chunk codecs (compress.py)

_GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_chunks.json").read_text())
_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "": 1}


def _weights(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)


def _tensor(dtype: str, count: int, seed: int = 1) -> bytes:
    x = _weights(count, seed)
    return {"float32": x.tobytes(), "float16": x.astype(np.float16).tobytes(),
            "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
            "int64": np.arange(count, dtype=np.int64).tobytes(), "int32": (x * 1e4).astype(np.int32).tobytes(),
            "uint8": (x * 1e3).astype(np.uint8).tobytes(), "": b"abc" * count}[dtype]


def _golden_plain(kind: str) -> bytes:
    """The plain bytes of data/golden_chunks.json (integer arithmetic: the same on every machine)."""
    x = (((np.arange(1024, dtype=np.int64) * 2654435761) % 2001 - 1000).astype(np.float32) * np.float32(1e-5))
    return (x.tobytes() if kind == "f32" else (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()) + b"\x05"


@pytest.mark.parametrize("dtype", list(_WIDTH))
def test_every_setting_round_trips_every_width_with_odd_tails_and_empty(dtype: str) -> None:
    whole = _tensor(dtype, 70_001)
    width = _WIDTH[dtype]
    sizes = [0, 1, width - 1, width, 3 * width + 1, 70_001 * width - 1, len(whole)]
    for setting in compress.SETTINGS:
        codec = compress.choose(setting, dtype)
        assert codec in compress.CODECS
        for size in sizes:
            data = whole[:size]
            stored = compress.encode(codec, data)
            assert len(stored) <= size + 1 and stored[:1] in (b"\x00", b"\x01")
            assert compress.decode(codec, stored, size) == data, (setting, codec, size)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_auto_stores_floats_in_byte_planes_and_shrinks_them(dtype: str) -> None:
    codec = compress.choose("auto", dtype)
    assert codec == compress.PLANES[dtype] and compress.choose("bg-zstd", dtype).startswith("bg")
    data = _tensor(dtype, 100_000) + b"\x01"
    stored = compress.encode(codec, data)
    assert stored[:1] == b"\x01" and len(stored) < 0.9 * len(data)
    assert compress.choose("auto", "int64") == "zstd" and compress.choose("none", dtype) == "raw"


def test_zipnn_is_given_a_copy_and_noise_is_stored_raw() -> None:
    data = _tensor("float32", 10_000)
    view = memoryview(bytearray(data))
    compress.encode("zipnn-f32", view)
    assert view == data  # ZipNN rewrites the buffer it compresses: never the caller's
    mine = bytearray(data)
    stored = compress.encode("zipnn-f32", mine, consume=True)  # the caller is done with it: no copy
    assert compress.decode("zipnn-f32", stored, len(data)) == data
    noise = np.random.default_rng(2).bytes(40_000)
    for codec in ("zipnn-f32", "zipnn-bf16", "zstd", "bg4-zstd", "bp4-zstd", "bp2-zstd"):
        assert compress.encode(codec, noise) == b"\x00" + noise


def test_chunks_stored_under_every_name_still_decode() -> None:
    assert set(_GOLDEN) == {"zstd", "bp4-zstd", "bp2-zstd", "bg4-zstd", "bg2-zstd", "zipnn-f32", "zipnn-bf16"}
    for codec, g in _GOLDEN.items():
        plain = _golden_plain(g["plain"])
        assert compress.decode(codec, bytes.fromhex(g["stored"]), len(plain)) == plain, codec
    assert compress.decode("raw", b"\x00abc", 3) == b"abc"


def _corruptions(stored: bytes) -> list[bytes]:
    return [stored[:-1], stored[: len(stored) // 2], stored + b"\x00", b"\x01", b"", b"\x02" + stored[1:],
            b"\x01" + bytes(len(stored) - 1), b"\x00" + stored[1:]]


@pytest.mark.parametrize("codec", ["zstd", "bp2-zstd", "bp4-zstd", "bg2-zstd", "bg4-zstd", "zipnn-f32", "zipnn-bf16",
                                   "zipnn-f16"])
def test_corrupt_chunks_raise_data_loss(codec: str) -> None:
    dtype = {"zipnn-f32": "float32", "bg4-zstd": "float32", "bp4-zstd": "float32", "zstd": "float32"}.get(
        codec, "bfloat16")
    data = _tensor(dtype if codec != "zipnn-f16" else "float16", 50_000) + b"\x03"
    stored = compress.encode(codec, data)
    assert stored[:1] == b"\x01"
    for bad in _corruptions(stored):
        with pytest.raises(DataLossError):
            compress.decode(codec, bad, len(data))
    with pytest.raises(DataLossError):
        compress.decode(codec, stored, len(data) + 1)  # bounded: never more than the size it is read as
    with pytest.raises(DataLossError):
        compress.decode("lzma", stored, len(data))


@pytest.mark.parametrize("codec", ["zipnn-f32", "zipnn-bf16"])
def test_zipnn_chunks_with_any_byte_flipped_raise_data_loss(codec: str) -> None:
    data = _tensor("float32" if codec == "zipnn-f32" else "bfloat16", 30_000) + b"\x03"
    stored = compress.encode(codec, data)
    rng = random.Random(5)
    for pos in [1, 8, 9, 10, 30, len(stored) - 2, len(stored) - 1, *rng.sample(range(1, len(stored)), 50)]:
        bad = bytearray(stored)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(DataLossError):
            compress.decode(codec, bytes(bad), len(data))


def test_a_zipnn_stream_announcing_another_size_is_refused_before_decoding() -> None:
    data = _tensor("float32", 30_000)
    stored = compress.encode("zipnn-f32", data)
    stream = bytearray(stored[9:])
    stream[16:24] = (1 << 40).to_bytes(8, "little")  # a huge size, with a digest that matches
    forged = b"\x01" + xxhash.xxh3_64_intdigest(bytes(stream)).to_bytes(8, "little") + bytes(stream)
    with pytest.raises(DataLossError, match="announce"):
        compress.decode("zipnn-f32", forged, len(data))


def _wrapper_encode(codec: str, data: bytes) -> bytes:
    """A chunk as the codec stored it through the zipnn wrapper (compress.py up to 8d8af13)."""
    wrapper = pytest.importorskip("zipnn")  # imports torch: fine here, the test process is no daemon
    dtype = {"zipnn-bf16": "bfloat16", "zipnn-f16": "float16", "zipnn-f32": "float32"}[codec]
    n = len(data) - len(data) % (4 if dtype == "float32" else 2)
    if n == 0:
        return b"\x00" + data
    stream = bytes(wrapper.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte").compress(bytearray(data[:n])))
    parts = [xxhash.xxh3_64_intdigest(stream + data[n:]).to_bytes(8, "little"), stream, data[n:]]
    return b"\x00" + data if sum(map(len, parts)) >= len(data) else b"".join([b"\x01", *parts])


@pytest.mark.parametrize("codec", ["zipnn-bf16", "zipnn-f16", "zipnn-f32"])
def test_zipnn_chunks_are_byte_for_byte_those_of_the_zipnn_wrapper(codec: str) -> None:
    """The torch-free coder (zipnn_core called directly) writes what the wrapper wrote: older
    daemons read new chunks, and the object names (content hash + codec) stay the same."""
    dtype = {"zipnn-bf16": "bfloat16", "zipnn-f16": "float16", "zipnn-f32": "float32"}[codec]
    rng = np.random.default_rng(28)
    for count in (0, 1, 2, 3, 1000, 65_536, 65_537, 200_000):
        weights = _tensor(dtype, count, seed=count)
        for data in (weights, weights + b"\x07", weights + b"\x07\x08\x09", rng.bytes(len(weights) + 1),
                     weights[: len(weights) // 2] + rng.bytes(len(weights) // 2)):
            assert compress.encode(codec, data) == _wrapper_encode(codec, data), (count, len(data))
            assert compress.decode(codec, _wrapper_encode(codec, data), len(data)) == data


_WRAPPER = json.loads((Path(__file__).parent / "data" / "zipnn_wrapper_chunks.json").read_text())["chunks"]


def _wrapper_plain(kind: str, count: int, modulus: int, tail: bytes) -> bytes:
    """The plain bytes of data/zipnn_wrapper_chunks.json (integer arithmetic: the same everywhere)."""
    x = (((np.arange(count, dtype=np.int64) * 2654435761) % modulus - modulus // 2).astype(np.float32)
         * np.float32(1e-5))
    return {"f32": x.tobytes(), "f16": x.astype(np.float16).tobytes(),
            "bf16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[kind] + tail


@pytest.mark.parametrize("chunk", _WRAPPER, ids=lambda c: f"{c['codec']}-{c['size']}")
def test_chunks_stored_through_the_zipnn_wrapper_decode_without_it(chunk: dict) -> None:
    """Chunks the wrapper-based codec stored (bf16, f16, f32; tails; two 256 KiB ZipNN chunks)."""
    plain = _wrapper_plain(chunk["kind"], chunk["count"], chunk["modulus"], bytes.fromhex(chunk["tail"]))
    assert (len(plain), xxhash.xxh3_64_hexdigest(plain)) == (chunk["size"], chunk["plain_xxh3"])
    stored = base64.b64decode(chunk["stored"])
    assert bytes(compress.decode(chunk["codec"], stored, len(plain))) == plain
    assert compress.encode(chunk["codec"], plain) == stored  # and the same bytes are written today


def _forged(stored: bytes, edit: Callable[[bytearray], None], tail: int = 0) -> bytes:
    """``stored`` with its ZipNN stream edited and the digest recomputed (it passes the digest)."""
    end = len(stored) - tail
    stream = bytearray(stored[9:end])
    edit(stream)
    return b"\x01" + xxhash.xxh3_64_intdigest(bytes(stream) + stored[end:]).to_bytes(8, "little") + bytes(stream) \
        + stored[end:]


@pytest.mark.parametrize("codec", ["zipnn-bf16", "zipnn-f16", "zipnn-f32"])
def test_a_zipnn_stream_whose_header_or_index_lies_is_refused_before_decoding(codec: str) -> None:
    """With a matching digest (a forged or buggy writer), nothing the C decoder would trust
    unchecked reaches it: header fields, chunk types, chunk ends, the stream's own length."""
    dtype = {"zipnn-bf16": "bfloat16", "zipnn-f16": "float16", "zipnn-f32": "float32"}[codec]
    data = _tensor(dtype, 150_000)  # two or three ZipNN chunks of 256 KiB
    stored = compress.encode(codec, data)
    groups, chunks = (4 if dtype == "float32" else 2), -(-len(data) // (1 << 18))
    ends = 32 + groups * chunks

    def put(pos: int, value: int, width: int = 1) -> Callable[[bytearray], None]:
        return lambda s: s.__setitem__(slice(pos, pos + width), value.to_bytes(width, "little"))

    def cut(s: bytearray) -> None:
        del s[-5:]
        s[24:32] = len(s).to_bytes(8, "little")

    edits = [put(2, 1), put(3, 4), put(5, 9), put(6, 1 - zipnn._ZN_PARAMS[codec][2]), put(7, 2), put(8, 2),
             put(9, 1), put(10, 1), put(13, 130), put(14, 17), put(15, 1 if codec != "zipnn-f32" else 6),
             put(16, len(data) // 2, 8), put(24, 1 << 40, 8), put(32, 2), put(33, 7),
             put(ends, 1 << 62, 8), put(ends, 0, 8), put(ends + 8 * (groups * chunks - 1), 3, 8), cut]
    for edit in edits:
        with pytest.raises(DataLossError, match="ZipNN"):
            compress.decode(codec, _forged(stored, edit), len(data))
    assert compress.decode(codec, _forged(stored, lambda s: None), len(data)) == data
    assert compress.decode(codec, _forged(stored, put(4, 9)), len(data)) == data  # any 0.5.x writer


def test_codecs_are_safe_from_concurrent_threads() -> None:
    jobs = [(compress.choose("auto", dt), _tensor(dt, 2_000 + 997 * i, seed=i) + b"\x01" * (i % 3))
            for i, dt in enumerate(["float32", "bfloat16", "float16", "int64"] * 8)]

    def round_trip(job: tuple[str, bytes]) -> bool:
        codec, data = job
        return all(compress.decode(codec, compress.encode(codec, data), len(data)) == data for _ in range(5))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a shared coder's state would be torn
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            assert all(pool.map(round_trip, jobs))
    finally:
        sys.setswitchinterval(interval)


def test_a_drain_records_codec_and_stored_sizes_and_restores_byte_exact(tmp_path: Path) -> None:
    shards = {"w": _tensor("float32", 5_000), "b": _tensor("bfloat16", 3_000), "n": _tensor("int64", 999)}
    dtypes = {"w": "<f4", "b": "torch:bfloat16", "n": "<i8"}  # as clients record them (numpy, torch)

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=4096):
            writer = Rig(tmp_path, node_id="a")
            await writer.tier.start()
            writer.save("job", 1, 0, shards, dtypes=dtypes)
            await asyncio.wait_for(writer.tier.wait("job", 1, 0, None), 10)
            man = Manifest.from_json(writer.memory.get_bytes(manifest_key("job", 1, 0, 1)))
            assert {s.name: s.codec for s in man.shards} == {"w": "bp4-zstd", "b": "bp2-zstd", "n": "zstd"}
            for s in man.shards:
                assert [(n, len(writer.memory.get_bytes(content_key("job", d, n, s.codec))))
                        for d, n, _ in s.chunks] == [(n, stored) for _, n, stored in s.chunks]
                assert sum(n for _, n, _ in s.chunks) == s.size
            await writer.tier.stop(1.0)
            reader = Rig(tmp_path, node_id="b", memory=writer.memory)
            await reader.tier.start()
            local = await reader.tier.fetch("job", 1, 0)
            for name, data in shards.items():
                assert reader.store.shard_path(local, name).read_bytes() == data
            await reader.tier.stop(1.0)

    asyncio.run(body())


def test_manifest_dtype_strings_pick_the_codec_of_their_dtype() -> None:
    assert [compress.choose("auto", d) for d in ("<f4", "torch:float32", "torch:bfloat16", "<f2", "torch:float16")] \
        == ["bp4-zstd", "bp4-zstd", "bp2-zstd", "bp2-zstd", "bp2-zstd"]
    assert [compress.choose("auto", d) for d in (">f4", "<i8", "torch:int64", "|u1", "")] == ["zstd"] * 5
    assert compress.choose("bg-zstd", "<i4") == "bg4-zstd"
    assert compress.choose("bg-zstd", "torch:bfloat16") == "bg2-zstd"


@pytest.mark.parametrize("size", [4, 512, 4096 + 4])
def test_a_consumed_chunk_that_does_not_shrink_is_stored_as_its_plain_bytes(size: int) -> None:
    # Random bytes as float32 do not shrink under ZipNN, which overwrites the buffer it is given:
    # the raw fallback must still hold the plain bytes.
    plain = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    stored = compress.encode("zipnn-f32", bytearray(plain), consume=True)
    assert stored[:1] == b"\x00"
    assert bytes(compress.decode("zipnn-f32", stored, size)) == plain


def test_one_registry_serves_chunk_codecs_production_and_tests_alike() -> None:
    """A chunk codec registered the way the built-ins are is found by encode/decode and marks a
    shard as content-layout; a name taken by the other kind is refused."""
    from tierckptd.local.manifest import ShardEntry
    from tierckptd.persistent.codec import ChunkCodec, chunk_codec, is_chunk_codec
    from tierckptd.persistent.layout import is_content

    class _Reversed(ChunkCodec):
        name = "test-reversed"

        def pack(self, data, consume):
            return [bytes(data)[::-1][:-1]]  # one byte shorter, so it "shrinks"

        def unpack(self, body, size):
            raise DataLossError("cannot undo a dropped byte")

    assert not is_chunk_codec("test-reversed")
    register_codec(_Reversed())
    assert chunk_codec("test-reversed").name == "test-reversed"
    assert compress.encode("test-reversed", b"abcd") == b"\x01dcb"
    with pytest.raises(DataLossError):
        compress.decode("test-reversed", b"\x01dcb", 4)
    assert is_content(ShardEntry(name="m", size=4, checksum="0" * 16, codec="test-reversed"))
    assert all(is_chunk_codec(c) for c in compress.CODECS)  # the built-ins, registered on first use
    with pytest.raises(ValueError, match="taken"):
        register_codec(type("_Clash", (_Zlib,), {"name": "zstd"})())  # a per-shard codec named like a chunk codec
