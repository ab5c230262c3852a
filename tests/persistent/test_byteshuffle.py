"""Byte planes split and merged by libblosc2 (:mod:`tierckptd.persistent.byteshuffle`) are the bytes
numpy makes, so chunks stored by either path, or by the codec before it used libblosc2, read alike.

The library's path and the numpy fallback are compared on random float16/bfloat16/float32 data of
odd sizes (empty, 1 byte, not a multiple of the width), against a plain reference of the layout
(byte k of every element, then the tail); whole chunks encode to the same stored bytes either way
and decode across; corrupt chunks fail alike. The stored examples of every codec
(tests/persistent/test_codec.py, data/golden_chunks.json) are decoded under both paths too.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tierckpt.errors import DataLossError
from tierckptd.persistent import byteshuffle, compress

_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4}
_SIZES = [0, 1, 2, 3, 4, 5, 7, 9, 31, 1001, 65_537, (1 << 20) + 3, (3 << 20) + 2]
_GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_chunks.json").read_text())

native_only = pytest.mark.skipif(byteshuffle.native() is None, reason="libblosc2 (the blosc2 wheel) not installed")


@pytest.fixture(params=["native", "numpy"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with libblosc2, then with numpy alone."""
    if request.param == "native" and byteshuffle.native() is None:
        pytest.skip("libblosc2 (the blosc2 wheel) not installed")
    byteshuffle.use_native(request.param == "native")
    try:
        yield request.param
    finally:
        byteshuffle.use_native(True)


def _floats(dtype: str, size: int, seed: int) -> bytes:
    """``size`` bytes of a tensor of ``dtype`` (N(0, 0.02), the tail cut mid-element)."""
    x = (np.random.default_rng(seed).standard_normal(size // 2 + 1) * 0.02).astype(np.float32)
    whole = {"float32": x.tobytes(), "float16": x.astype(np.float16).tobytes(),
             "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[dtype]
    return whole[:size]


def _reference(data: bytes, width: int) -> bytes:
    """The layout, plainly: byte k of every element for k = 0 .. width - 1, then the tail."""
    count = len(data) // width
    return b"".join(data[k:count * width:width] for k in range(width)) + data[count * width:]


def _merge(planes: bytes, width: int) -> bytearray:
    count = len(planes) // width
    return byteshuffle.merge([planes[k * count:(k + 1) * count] for k in range(width)], planes[count * width:], width)


@pytest.mark.parametrize("dtype", list(_WIDTH))
def test_split_and_merge_are_the_plain_layout_on_both_paths(dtype: str, path: str) -> None:
    width = _WIDTH[dtype]
    for seed, size in enumerate(_SIZES):
        data = _floats(dtype, size, seed)
        assert len(data) == size
        planes = bytes(byteshuffle.split(data, width))
        assert planes == _reference(data, width), (path, size)
        merged = _merge(planes, width)
        assert isinstance(merged, bytearray) and merged == data, (path, size)
        assert byteshuffle.split(memoryview(bytearray(data)), width, np.empty(size, np.uint8)).tobytes() == planes


@native_only
@pytest.mark.parametrize("dtype", list(_WIDTH))
def test_library_and_numpy_store_the_same_bytes_and_read_each_other(dtype: str) -> None:
    width = _WIDTH[dtype]
    codecs = (compress.PLANES[dtype], f"bg{width}-zstd")
    for seed, size in enumerate(_SIZES):
        data = _floats(dtype, size, seed)
        stored = {}
        for native in (True, False):
            byteshuffle.use_native(native)
            try:
                stored[native] = [compress.encode(codec, data) for codec in codecs]
            finally:
                byteshuffle.use_native(True)
        assert stored[True] == stored[False], size
        for native in (True, False):
            byteshuffle.use_native(native)
            try:
                for codec, chunk in zip(codecs, stored[not native], strict=True):
                    assert compress.decode(codec, chunk, size) == data, (native, codec, size)
            finally:
                byteshuffle.use_native(True)


def test_stored_examples_of_every_codec_decode_on_both_paths(path: str) -> None:
    x = (((np.arange(1024, dtype=np.int64) * 2654435761) % 2001 - 1000).astype(np.float32) * np.float32(1e-5))
    plain = {"f32": x.tobytes() + b"\x05", "bf16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() + b"\x05"}
    for codec, g in _GOLDEN.items():
        if codec.startswith("zipnn"):
            continue  # ZipNN's own decoder (tests/persistent/test_codec.py), no byte planes of ours
        want = plain[g["plain"]]
        assert compress.decode(codec, bytes.fromhex(g["stored"]), len(want)) == want, (path, codec)


@native_only
def test_corrupt_chunks_fail_or_decode_alike_on_both_paths() -> None:
    """Bit flips, truncations and length forgeries of bp chunks: the same DataLossError or the
    same bytes (a flipped bit in a raw plane) whichever path merges."""
    rnd = random.Random(5)
    for dtype in _WIDTH:
        data = _floats(dtype, 200_003, 1)
        stored = compress.encode(compress.PLANES[dtype], data)
        for _ in range(150):
            bad = bytearray(stored)
            kind = rnd.randrange(3)
            if kind == 0:
                bad[rnd.randrange(1, len(bad))] ^= 1 << rnd.randrange(8)
            elif kind == 1:
                del bad[rnd.randrange(1, len(bad)):]
            else:
                bad[2:6] = rnd.randrange(1 << 32).to_bytes(4, "little")
            outcome = []
            for native in (True, False):
                byteshuffle.use_native(native)
                try:
                    outcome.append(bytes(compress.decode(compress.PLANES[dtype], bytes(bad), len(data))))
                except DataLossError:
                    outcome.append(b"DataLossError")
                finally:
                    byteshuffle.use_native(True)
            assert outcome[0] == outcome[1]


def test_merge_refuses_planes_of_other_lengths() -> None:
    with pytest.raises(ValueError, match="byte planes"):
        byteshuffle.merge([b"ab", b"a"], b"", 2)
    with pytest.raises(ValueError, match="byte planes"):
        byteshuffle.merge([b"ab"], b"", 2)


@native_only
def test_the_library_is_loaded_without_importing_blosc2s_package() -> None:
    """libblosc2 is found and loaded, and blosc2's Python package (numexpr, pydantic, httpx ...)
    is never imported: not by the daemon's codec path, nor by the lookup."""
    probe = ("import sys\nfrom tierckptd.persistent import byteshuffle, compress\n"
             "assert byteshuffle.native() is not None\n"
             "assert compress.decode('bp4-zstd', compress.encode('bp4-zstd', bytes(range(256)) * 99), 25344)"
             " == bytes(range(256)) * 99\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('blosc2', 'numexpr', 'torch')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_the_library_numpy_does_the_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No blosc2 wheel, or one whose folder has no loadable libblosc2: the codecs work on numpy."""
    data = _floats("float32", 100_003, 3)
    for finder in (lambda name: None, lambda name: importlib.machinery.ModuleSpec(name, None, origin=str(
            tmp_path / "__init__.py"))):
        monkeypatch.setattr(byteshuffle, "_state", {})
        monkeypatch.setattr(importlib.util, "find_spec", finder)
        assert byteshuffle.native() is None
        assert compress.decode("bp4-zstd", compress.encode("bp4-zstd", data), len(data)) == data
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libblosc2.so").write_bytes(b"not a library")
    monkeypatch.setattr(byteshuffle, "_state", {})
    assert byteshuffle.native() is None
