"""Float codec candidates for the persistent tier, on the tensors of bench/incremental.py, one run.

Single core (the process is pinned to one CPU), 8 MiB chunks (the tier's unit), every coder given
a fresh copy of each chunk (ZipNN rewrites its input), repetitions interleaved, best of --reps;
every output is checked to decode to its input. Ratio and throughput are also shown relative to
ZipNN's. Rows:

- ZipNN (the reference), ours (``compress.choose("auto")``), ours before (``bg-zstd``);
- blosc2 (SIMD shuffle / bitshuffle / shuffle+bytedelta, then zstd level 1 or 3, or lz4;
  typesize = element size, nthreads 1);
- pcodec (levels 0, 4, 8; bfloat16 as uint16);
- byte planes after a 1-bit rotation (exponent alone in a byte), the exponent plane through
  zstd level 1 with a tiny window (few matches) or zlib's Huffman-only deflate, the rest raw;
- "order-0 bound": the ratio an ideal order-0 entropy coder would reach on those byte planes
  (per 256 KiB), no timing.

Optional packages (skipped with a note when missing): ``pip install blosc2 pcodec``.
Command: PYTHONPATH=client:daemon:examples .venv/bin/python bench/codec_candidates.py
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from incremental import _best, _coders, _model, _tensors

Coder = tuple[Callable[[bytearray], Any], Callable[[Any, int], Any]]
_UINT = {2: np.uint16, 4: np.uint32}


def _blosc2(width: int) -> dict[str, Coder]:
    try:
        import blosc2
    except ImportError:
        print("(blosc2 not installed: skipped)")
        return {}
    blosc2.set_nthreads(1)
    f = blosc2.Filter
    out = {}
    for codec, level in (("ZSTD", 1), ("ZSTD", 3), ("LZ4", 1)):
        for name, filters in (("shuffle", [f.SHUFFLE]), ("bitshuffle", [f.BITSHUFFLE]),
                              ("shuffle+bytedelta", [f.SHUFFLE, f.BYTEDELTA])):
            kw = {"codec": getattr(blosc2.Codec, codec), "clevel": level, "filters": filters,
                  "filters_meta": [0] * len(filters), "typesize": width, "nthreads": 1}
            out[f"blosc2 {name} {codec.lower()}-{level}"] = (
                lambda p, kw=kw: blosc2.compress2(p, **kw), lambda e, n: blosc2.decompress2(e))
    return out


def _pcodec(width: int) -> dict[str, Coder]:
    try:
        from pcodec import ChunkConfig, DeltaSpec, standalone
    except ImportError:
        print("(pcodec not installed: skipped)")
        return {}
    kind = np.uint16 if width == 2 else np.float32
    out = {}
    for level in (0, 4, 8):
        cfg = ChunkConfig(compression_level=level, delta_spec=DeltaSpec.no_op())
        out[f"pcodec level {level}"] = (lambda p, cfg=cfg: standalone.simple_compress(np.frombuffer(p, kind), cfg),
                                        lambda e, n: standalone.simple_decompress(e).tobytes())
    return out


def _split(p: Any, width: int) -> list[bytes]:
    x = np.frombuffer(p, _UINT[width])
    x = (x << 1) | (x >> (8 * width - 1))
    g = x.view(np.uint8).reshape(-1, width).T
    return [g[i].tobytes() for i in range(width)]


def _join(planes: list[bytes], width: int) -> bytes:
    g = np.empty((len(planes[0]), width), np.uint8)
    for i, plane in enumerate(planes):
        g[:, i] = np.frombuffer(plane, np.uint8)
    x = g.reshape(-1).view(_UINT[width])
    return ((x >> 1) | (x << (8 * width - 1))).tobytes()


def _planes(width: int) -> dict[str, Coder]:
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=10, hash_log=6, min_match=7)
    zc, zd = zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()

    def huff(b: bytes) -> bytes:
        c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        return c.compress(b) + c.flush()

    def coder(enc: Callable[[bytes], bytes], dec: Callable[[bytes, int], bytes]) -> Coder:
        def encode(p: bytearray) -> bytes:  # mantissa planes raw, then the coded exponent plane
            planes = _split(p, width)
            return b"".join(planes[:-1]) + enc(planes[-1])

        def decode(e: bytes, n: int) -> bytes:
            k = n // width
            return _join([e[i * k:(i + 1) * k] for i in range(width - 1)] + [dec(e[(width - 1) * k:], k)], width)

        return encode, decode

    small = coder(zc.compress, lambda b, n: zd.decompress(b, max_output_size=n))
    return {"planes, exponent zstd-1 small window": small,
            "planes, exponent deflate huffman-only": coder(huff, lambda b, n: zlib.decompress(b, -15))}


def _order0(data: bytes, width: int) -> float:
    bits = 0.0
    for plane in _split(data, width):
        for i in range(0, len(plane), 256 << 10):
            counts = np.bincount(np.frombuffer(plane[i:i + (256 << 10)], np.uint8), minlength=256)
            p = counts[counts > 0] / counts.sum()
            bits += float(-(p * np.log2(p)).sum()) * counts.sum()
    return len(data) * 8 / bits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    model, opt, *_ = _model(args.steps)
    tensors = _tensors(model, opt)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    step = 8 << 20
    print("| tensors | codec | ratio | compress MB/s | decompress MB/s | ratio / zipnn | compress / zipnn "
          "| decompress / zipnn |\n|---|---|---|---|---|---|---|---|")
    for name, (data, dtype) in tensors.items():
        width = 2 if dtype == "bfloat16" else 4
        parts = [data[i:i + step] for i in range(0, len(data), step)]
        coders = {**_coders(dtype), **_blosc2(width), **_pcodec(width), **_planes(width)}
        mb = len(data) / 1e6
        rows = {label: (len(data) / r[0], mb / r[1], mb / r[2]) for label, r in _best(args.reps, parts, coders).items()}
        zn = rows["zipnn"]
        for label, (ratio, c, d) in rows.items():
            print(f"| {name} | {label} | {ratio:.3f} | {c:.0f} | {d:.0f} | {ratio / zn[0]:.3f} | {c / zn[1]:.2f} "
                  f"| {d / zn[2]:.2f} |")
        bound = _order0(data, width)
        print(f"| {name} | order-0 bound of the byte planes | {bound:.3f} | | | {bound / zn[0]:.3f} | | |")


if __name__ == "__main__":
    main()
