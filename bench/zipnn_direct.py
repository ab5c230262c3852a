"""Issue 28: the ZipNN codecs without the zipnn wrapper (torch-free), against the wrapper, one run.

On bench/incremental.py's tensors (TinyLM trained --steps steps: weights bf16 and fp32, AdamW
moments fp32), 8 MiB chunks, the process pinned to one CPU, best of --reps per chunk with the
coders taking turns (bench/incremental.py's ``_best``; every output checked to decode to its
input, every coder given a fresh copy of each chunk). Rows:

- ``codec``: ``compress.encode(..., consume=True)`` / ``compress.decode`` as the tier calls them
  (zipnn_core called directly; tag byte, xxh3 digest, header and chunk-index checks included);
- ``zipnn_core bare``: the same two C calls alone, no framing or checks;
- ``before``: the codec as it was (8d8af13): the same framing, digest and header check around
  ``zipnn.ZipNN(bytearray_dtype=..., threads=1, input_format="byte")`` compress / decompress;
- ``wrapper bare``: those two wrapper calls alone.

The codec's output is checked to be the wrapper's stream byte for byte. The ratio columns
compare with ``before``.

Then the import cost of each, in fresh interpreters: ``import zipnn_core`` vs ``import zipnn``.

Command: PYTHONPATH=client:daemon:examples .venv/bin/python bench/zipnn_direct.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zipnn  # the wrapper, for comparison only (imports torch; the daemon does not)
from incremental import _best, _model, _tensors
from tierckptd.persistent import compress
from tierckptd.persistent import zipnn as legacy


def _coders(dtype: str) -> dict[str, Any]:
    codec = legacy.ZIPNN[dtype]
    _, groups, bits, order = legacy._ZN_PARAMS[codec]
    core = legacy._zipnn_core(codec)
    z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte")
    chunk, th, after = legacy._ZN_CHUNK, legacy._ZN_THRESHOLD, legacy._ZN_CHECK_AFTER_PERCENT
    return {
        f"codec ({codec})": (lambda p: compress.encode(codec, p, consume=True),
                             lambda e, n: compress.decode(codec, e, n)),
        "zipnn_core bare": (lambda p: core.zipnn_core(legacy._zn_header(codec, len(p)), p, groups, bits, order, 0,
                                                      chunk, th, after, 1),
                            lambda e, n: core.combine_dtype(memoryview(e)[32:], groups, bits, order, chunk, n, 1)),
        "before": (lambda p: _before_encode(z, p, groups), lambda e, n: _before_decode(z, e, n, groups)),
        "wrapper bare": (z.compress, lambda e, n: z.decompress(e)),
    }


def _before_encode(z: Any, data: bytearray, width: int) -> bytes:
    n = len(data) - len(data) % width
    tail = bytes(data[n:])
    stream = z.compress(data if n == len(data) else bytearray(data[:n]))
    return b"".join([b"\x01", legacy._digest(stream, tail), stream, tail])


def _before_decode(z: Any, stored: bytes, size: int, width: int) -> bytes | bytearray:
    body = memoryview(stored)[1:]
    tail = size % width
    end = len(body) - tail
    stream = body[8:end]
    assert legacy._digest(stream, body[end:]) == bytes(body[:8])
    assert bytes(stream[:2]) == b"ZN" and int.from_bytes(stream[16:24], "little") == size - tail
    out = z.decompress(stream)
    return out + body[end:] if tail else out


def _import_seconds(module: str, runs: int = 3) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return min(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                     .stdout) for _ in range(runs))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    model, opt, *_ = _model(args.steps)
    tensors = _tensors(model, opt)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    step = 8 << 20
    print("| tensors | MB | coder | ratio | compress MB/s | decompress MB/s | compress / before "
          "| decompress / before |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (data, dtype) in tensors.items():
        parts = [data[i:i + step] for i in range(0, len(data), step)]
        width = 2 if dtype == "bfloat16" else 4
        z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte")
        for part in parts:  # the stored stream is the wrapper's, byte for byte
            n = len(part) - len(part) % width
            assert compress.encode(legacy.ZIPNN[dtype], part)[9:9 + n] == bytes(z.compress(bytearray(part[:n])))[:n]
        mb = len(data) / 1e6
        rows = {label: (len(data) / r[0], mb / r[1], mb / r[2])
                for label, r in _best(args.reps, parts, _coders(dtype)).items()}
        w = rows["before"]
        for label, (ratio, c, d) in rows.items():
            print(f"| {name} | {mb:.1f} | {label} | {ratio:.3f} | {c:.0f} | {d:.0f} | {c / w[1]:.2f} "
                  f"| {d / w[2]:.2f} |")
    print(f"\nimport zipnn_core: {_import_seconds('zipnn_core') * 1e3:.1f} ms; "
          f"import zipnn (wrapper, torch): {_import_seconds('zipnn'):.2f} s (fresh interpreters, best of 3)")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
