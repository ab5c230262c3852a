"""Issue 28 item 3: drain throughput with 1 vs 2 codec workers (``--knobs codec_threads=N``), one run.

Two daemons, each with its own ``file://`` persistent store on tmpfs (so the store's writes cost
the least and the codec is what the drain waits for), content layout, ``codec = auto`` (byte
planes + zstd for floats), ``upload_threads`` 8 on both: one with ``codec_threads=1``, one with
``codec_threads=2``. Per round and daemon (alternating, the order swapped every round): a --mib
MiB rank (16 float32 shards of trained-weight-like values; new values every round, so nothing is
deduplicated) is saved with ``persist=True``; measured from its local commit until
``wait("persistent")`` returns: the drain as a trainer sees it. No other save runs meanwhile.
Also measured: the daemon's CPU seconds (``/proc/PID/stat``, all threads) per wall second of
the drain, i.e. how many cores it kept busy. Printed per daemon: median drain MB/s and cores
busy; then 2 workers / 1 worker.

The same drain on N cores: the codec's part scales with min(codec_threads, idle cores) as long as
the codec, not the store's writes or the hashing on upload threads, is what the drain waits for.

Command: PYTHONPATH=client:daemon .venv/bin/python bench/drain_workers.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import Daemon, scratch_dir


def _state(mib: int, shards: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = (mib << 20) // shards // 4
    return {f"layer{i}": (rng.standard_normal(n) * 0.02).astype(np.float32) for i in range(shards)}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--knobs", default="", help="more daemon knobs for both")
    args = ap.parse_args()
    root = scratch_dir("tck-dw-")
    workers = (1, 2)
    stores = {w: Path(tempfile.mkdtemp(prefix="tck-dw-store-", dir="/dev/shm")) for w in workers}
    knobs = {w: f"codec_threads={w},upload_threads=8" + (f",{args.knobs}" if args.knobs else "") for w in workers}
    ds = {w: Daemon(root, f"w{w}", args=("--persistent", stores[w].as_uri(), "--codec", "auto", "--keep-local", "2",
                                          "--log-level", "WARNING", "--knobs", knobs[w]))
          for w in workers}
    rate: dict[int, list[float]] = {w: [] for w in workers}
    busy: dict[int, list[float]] = {w: [] for w in workers}
    mb = args.mib * 1.048576
    try:
        for d in ds.values():
            d.start()
        clients = {w: d.client() for w, d in ds.items()}
        for r in range(1, args.rounds + 1):
            big = _state(args.mib, 16, r)
            for w in (workers if r % 2 else workers[::-1]):
                c, pid = clients[w], ds[w].proc.pid
                fut = c.save("big", r, 0, 1, big, persist=True)
                fut.result(600)
                t0, c0 = time.perf_counter(), _cpu_seconds(pid)
                fut.wait("persistent", timeout=600)
                wall, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - c0
                rate[w].append(mb / wall)
                busy[w].append(cpu / wall)
                print(f"round {r}, codec_threads={w}: drain {wall:.2f} s, {mb / wall:.0f} MB/s, "
                      f"{cpu / wall:.2f} cores busy", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)
        for s in stores.values():
            shutil.rmtree(s, ignore_errors=True)
    print(f"\n{args.mib} MiB float32 per drain, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    for w in workers:
        print(f"  codec_threads={w}: drain median {statistics.median(rate[w]):.0f} MB/s, "
              f"{statistics.median(busy[w]):.2f} cores busy")
    ratios = [two / one for one, two in zip(rate[1], rate[2])]
    print(f"  drain throughput, 2 workers / 1: {statistics.median(rate[2]) / statistics.median(rate[1]):.2f}x "
          f"(per round: {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
