"""Restore after node replacement vs a raw Python TCP socket copy of the same bytes, in one run.

Three daemons on loopback (replicas=1), world size 3, one 1 GiB rank saved on each node. Each
round kills node n0 (kill -9), wipes its local directory, starts a replacement with the same id
and times ``restore(job, rank=0)`` on it: latest() from the peers' catalogs, the bulk fetch from
n1, checksum verification on receipt, the local commit, and the client's own mapping and
verification of the restored shard. The daemon's part (fetch, verify, commit) is read from its
log. Baselines, same run, same bytes: one raw socket into memory, and into a fresh tmpfs file
(a restore must land in the local tier; fresh tmpfs pages cost about as much as the copy).

Usage: .venv/bin/python bench/recovery.py [--gib 1] [--rounds 3] [--knobs warm_touch=0]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tierckptd.testing import Daemon, free_port, scratch_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rawsock import raw_copy_seconds

TARGET = 1.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--knobs", default="", help="tuning knobs for every daemon (A/B runs), e.g. warm_touch=0")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    root = scratch_dir("tck-bench-")
    ids = ("n0", "n1", "n2")
    ports = {n: free_port() for n in ids}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    flags = ("--peers", peers, "--replicas", "1", "--log-level", "INFO",
             *(("--knobs", args.knobs) if args.knobs else ()))
    ds = {n: Daemon(root, n, port=ports[n], args=flags) for n in ids}
    try:
        for d in ds.values():
            d.start()
        block = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
        data = np.resize(block, nbytes)
        for rank, n in enumerate(ids):
            with ds[n].client() as c:
                while not all(p.up for p in c.status().peers):
                    time.sleep(0.05)
                data[:8] = rank
                fut = c.save("bench", 1, rank, len(ids), {"w": data})
                assert fut.wait("peer", timeout=600)
        data[:8] = 0
        src = next((ds["n1"].local_dir / "jobs" / "bench").rglob("rank-0000000/w.*"))  # n1's replica of rank 0
        secs, fetch = [], []
        for i in range(args.rounds):
            ds["n0"].kill()
            ds["n0"].wipe()
            ds["n0"].start()
            with ds["n0"].client() as c:
                t0 = time.perf_counter()
                ck = c.restore("bench", 0)
                secs.append(time.perf_counter() - t0)
                assert ck.tier == "peer" and ck.step == 1
                assert np.array_equal(ck.shards["w"][:1 << 20], data[:1 << 20])
                del ck
            fetch.append(float(re.findall(r"fetched bench step 1 rank 0 from n1: \d+ bytes in ([0-9.]+)s",
                                          ds["n0"].log_path.read_text())[-1]))
            print(f"round {i + 1}: restore() of {nbytes / 2**30:.2f} GiB after replacement: {secs[-1]:.3f}s "
                  f"(daemon fetch+verify+commit {fetch[-1]:.3f}s)", flush=True)
        raw = raw_copy_seconds(src, rounds=3)
        raw_file = raw_copy_seconds(src, rounds=3, to_dir=root)
        for a, b in zip(raw, raw_file):
            print(f"raw socket: into memory {a:.3f}s ({nbytes / a / 1e9:.2f} GB/s), "
                  f"into a fresh tmpfs file {b:.3f}s ({nbytes / b / 1e9:.2f} GB/s)")
        med, med_fetch = statistics.median(secs), statistics.median(fetch)
        base, base_file = statistics.median(raw), statistics.median(raw_file)
        print(f"\nmedians of {len(secs)}: restore() {med:.3f}s, daemon fetch {med_fetch:.3f}s; "
              f"raw socket into memory {base:.3f}s, into a file {base_file:.3f}s")
        ratio = med / base
        print(f"restore()/raw-to-memory = {ratio:.2f}x (target <= {TARGET}x): {'PASS' if ratio <= TARGET else 'FAIL'}")
        print(f"restore()/raw-to-file = {med / base_file:.2f}x; daemon fetch/raw-to-memory = {med_fetch / base:.2f}x; "
              f"daemon fetch/raw-to-file = {med_fetch / base_file:.2f}x")
        return 0 if ratio <= TARGET else 1
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
