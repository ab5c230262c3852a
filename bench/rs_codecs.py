"""Reed-Solomon codec throughput (issue 32, ``parity:K+M``): ISA-L through ctypes (the libisal
bundled in pyeclib) against the numpy GF(2^8) fallback against memcpy, and zfec when it is
installed (skipped otherwise).

Per codec, on K blocks of ``--mib`` MiB each (one thread, best of ``--repeat``):

- encode: the M parity rows of K data blocks, data bytes per second (K x block / time);
- update: one data block's share added to one parity row in place (what a holder does per
  chunk it receives), bytes of that block per second;
- decode: M lost data blocks rebuilt from K survivors (M data lost, all parity rows used), data
  bytes per second (K x block / time).

memcpy: one ``np.copyto`` of K blocks (the same bytes). Ratios are printed against memcpy and
ISA-L against numpy. The machine is shared (loaded): compare ratios, not absolute figures.

Usage: PYTHONPATH=client:daemon .venv/bin/python bench/rs_codecs.py [--k 4] [--m 2] [--mib 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from tierckptd.parity import gf, isal, rs


def best(fn: Callable[[], object], repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def bench_codec(codec: rs.Codec, data: list[np.ndarray], repeat: int) -> dict[str, float]:
    k, m, n = codec.k, codec.m, len(data[0])
    parity = codec.encode(data)
    row = parity[0].copy()
    present = {i: data[i] for i in range(m, k)} | {k + j: parity[j] for j in range(m)}
    got = codec.decode(present, range(m))
    assert all(np.array_equal(got[i], data[i]) for i in range(m))
    return {
        "encode": k * n / best(lambda: codec.encode(data), repeat),
        "update": n / best(lambda: codec.update([0], [row], 1, data[1]), repeat),
        "decode": k * n / best(lambda: codec.decode(present, range(m)), repeat),
    }


def bench_zfec(k: int, m: int, data: list[np.ndarray], repeat: int) -> dict[str, float] | None:
    try:
        import zfec  # type: ignore[import-not-found]
    except ImportError:
        return None
    n = len(data[0])
    enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    blocks = [d.tobytes() for d in data]
    out = enc.encode(blocks)
    nums = list(range(m, k + m))
    return {"encode": k * n / best(lambda: enc.encode(blocks), repeat),
            "decode": k * n / best(lambda: dec.decode([out[i] for i in nums], nums), repeat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--mib", type=int, default=16, help="MiB per block")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = a.mib << 20
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(a.k)]
    dst = [np.empty(n, dtype=np.uint8) for _ in range(a.k)]
    memcpy = a.k * n / best(lambda: [np.copyto(d, s) for d, s in zip(dst, data)], a.repeat)
    results: dict[str, dict[str, float]] = {}
    lib = isal.load()
    if lib is not None:
        results["isal"] = bench_codec(rs.Codec(a.k, a.m, lib), data, a.repeat)
        print(f"ISA-L: {lib.path}")
    results["numpy"] = bench_codec(rs.Codec(a.k, a.m, gf.NumpyBackend()), data, a.repeat)
    z = bench_zfec(a.k, a.m, data, a.repeat)
    if z is not None:
        results["zfec"] = z
    else:
        print("zfec: not installed, skipped")
    if lib is not None:
        same = all(np.array_equal(x, y) for x, y in zip(rs.Codec(a.k, a.m, lib).encode(data),
                                                         rs.Codec(a.k, a.m, gf.NumpyBackend()).encode(data)))
        print(f"ISA-L and numpy parity identical: {same}")
    print(f"K={a.k} M={a.m}, {a.mib} MiB per block, best of {a.repeat}, one thread")
    print(f"memcpy: {memcpy / 1e9:7.2f} GB/s")
    print(f"{'codec':8s} {'op':7s} {'GB/s':>8s} {'x memcpy':>9s} {'x numpy':>8s}")
    for name, ops in results.items():
        for op, rate in ops.items():
            vs_np = rate / results["numpy"][op] if op in results["numpy"] else float("nan")
            print(f"{name:8s} {op:7s} {rate / 1e9:8.2f} {rate / memcpy:9.2f} {vs_np:8.1f}")


if __name__ == "__main__":
    main()
