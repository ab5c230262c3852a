"""Issue 28: the float codec without torch (``bp2-zstd`` / ``bp4-zstd``, ``auto``'s choice) vs ZipNN, one run.

On bench/incremental.py's tensors (TinyLM trained --steps steps: weights bf16 and fp32, AdamW
moments fp32), 8 MiB chunks (the tier's unit):

1. one core (the process pinned to one CPU), best of --reps per chunk with the coders taking turns
   (bench/incremental.py's ``_best``; every output checked to decode to its input, every coder
   given a fresh copy of each chunk). Rows: ``bp`` as the tier calls it (``compress.encode(...,
   consume=True)`` / ``compress.decode``: framing and copies included); ``zipnn`` the ZipNN
   wrapper's compress / decompress (the reference of the issue); ``zipnn_core`` ZipNN's two C
   calls alone (no framing, no checks: its floor); ``zstd -3``. Then bytes / ZipNN's and speed /
   ZipNN's.
2. threads: every chunk encoded then decoded --reps times by a pool of 1, then 2 threads (not
   pinned), wall time, alternating, best of --rounds: aggregate MB/s and 2 threads / 1 thread,
   for ``bp`` (zstd and numpy release the GIL) and ``zipnn_core`` (holds it).

Command: PYTHONPATH=client:daemon:examples .venv/bin/python bench/float_codec.py
(needs ZipNN: the ``bench`` extra; the daemon itself has none).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zipnn  # the wrapper, the reference (imports torch; the daemon does not)
import zstandard
from incremental import _best, _model, _tensors
from tierckptd.persistent import compress
from tierckptd.persistent import zipnn as legacy

STEP = 8 << 20


def _core(dtype: str) -> tuple[Any, Any]:
    codec = legacy.ZIPNN[dtype]
    _, groups, bits, order = legacy._ZN_PARAMS[codec]
    import zipnn_core as core

    chunk, th, after = legacy._ZN_CHUNK, legacy._ZN_THRESHOLD, legacy._ZN_CHECK_AFTER_PERCENT
    return (lambda p: core.zipnn_core(legacy._zn_header(codec, len(p)), p, groups, bits, order, 0, chunk, th, after, 1),
            lambda e, n: core.combine_dtype(memoryview(e)[32:], groups, bits, order, chunk, n, 1))


def _coders(dtype: str) -> dict[str, Any]:
    ours = compress.choose("auto", dtype)
    z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte")
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    return {f"bp ({ours})": (lambda p: compress.encode(ours, p, consume=True),
                             lambda e, n: compress.decode(ours, e, n)),
            "zipnn": (z.compress, lambda e, n: z.decompress(e)),
            "zipnn_core": _core(dtype),
            "zstd -3": (zc.compress, lambda e, n: zd.decompress(e, max_output_size=n))}


def _threads(parts: list[bytes], coder: tuple[Any, Any], workers: int, reps: int) -> tuple[float, float]:
    """MB/s of encode + decode of every chunk ``reps`` times on ``workers`` threads, and the
    process's CPU seconds per wall second meanwhile (how many cores it kept busy)."""
    enc, dec = coder
    stored = [enc(bytearray(p)) for p in parts]

    def one(i: int) -> None:
        enc(bytearray(parts[i]))
        dec(stored[i], len(parts[i]))

    jobs = [i for _ in range(reps) for i in range(len(parts))]
    with cf.ThreadPoolExecutor(workers) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        list(pool.map(one, jobs))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(len(parts[i]) for i in jobs) / 1e6 / wall, cpu / wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model, opt, *_ = _model(args.steps)
    tensors = _tensors(model, opt)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    print(f"## one core (CPU {min(cpus)}), 8 MiB chunks, each chunk's best of {args.reps}, coders in turn\n")
    print("| tensors | MB | coder | ratio | compress MB/s | decompress MB/s | bytes / zipnn | compress / zipnn "
          "| decompress / zipnn |\n|---|---|---|---|---|---|---|---|---|")
    for name, (data, dtype) in tensors.items():
        parts = [data[i:i + STEP] for i in range(0, len(data), STEP)]
        mb = len(data) / 1e6
        res = _best(args.reps, parts, _coders(dtype))
        z = res["zipnn"]
        for label, (size, c, d) in res.items():
            print(f"| {name} | {mb:.1f} | {label} | {len(data) / size:.3f} | {mb / c:.0f} | {mb / d:.0f} "
                  f"| {size / z[0]:.4f} | {z[1] / c:.2f} | {z[2] / d:.2f} |")
    os.sched_setaffinity(0, cpus)
    print(f"\n## threads ({len(cpus)} CPUs), encode + decode of every chunk x {args.reps}, wall time, "
          f"best of {args.rounds} alternating\n")
    print("| tensors | coder | 1 thread MB/s | 2 threads MB/s | 2 / 1 | cores busy, 1 thread | cores busy, 2 threads |"
          "\n|---|---|---|---|---|---|---|")
    for name, (data, dtype) in tensors.items():
        parts = [data[i:i + STEP] for i in range(0, len(data), STEP)]
        coders = _coders(dtype)
        for label in (next(iter(coders)), "zipnn_core"):
            best = {1: (0.0, 0.0), 2: (0.0, 0.0)}
            for _ in range(args.rounds):  # alternating: load changes hit both alike
                for w, was in best.items():
                    best[w] = max(was, _threads(parts, coders[label], w, args.reps))
            (one, busy1), (two, busy2) = best[1], best[2]
            print(f"| {name} | {label} | {one:.0f} | {two:.0f} | {two / one:.2f} | {busy1:.2f} | {busy2:.2f} |")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
