"""Issue 28 item 3: how much a drain chunk worker slows a memory copy on the same node (a save's
copy), and how fast it drains, for two source trees (before / after a change) in one run.

A save's blocking during a compressed drain is mostly its memory copy slowed by the drain's memory
traffic (bench/README.md "28.3": the drain's CPU is at SCHED_IDLE). This isolates that: this
process copies a --copy-mib MiB buffer in a loop (a save's copy: into a new mapped /dev/shm file
each time, as the client writes a staging file) and records each copy's time,
while a driver process, started from one tree's ``daemon``/``client`` (``--trees``), has one
:class:`~tierckptd.persistent.chunkproc.ChunkWorker` (a SCHED_IDLE child, as in the daemon) hash
and encode 8 MiB chunks of a float32 file in /dev/shm (bench/drain_workers.py's values), writing
each stored chunk to a new file in /dev/shm as the ``file://`` store does. Windows of --secs
seconds: no driver, then each tree's, in turn, --rounds times (so the node's other load falls on
all alike). Printed per window kind: median copy time, its ratio to the no-drain windows, and
the drain MB/s (plain bytes hashed and encoded per second) and the worker's CPU seconds per GB
drained (its work per byte, memory stalls included: the least sensitive to the node's other load).

Command: PYTHONPATH=client:daemon .venv/bin/python bench/drain_membw.py --trees OLD NEW
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_DRIVER = r"""
import os, sys, time
from tierckptd.persistent.chunkproc import ChunkWorker
path, secs, codec, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
size = 8 << 20
fd = os.open(path, os.O_RDONLY)
total = os.fstat(fd).st_size
w = ChunkWorker(size)
w.hash(fd, 0, size, True, None, "x")
def cpu():
    fields = open(f"/proc/{w.proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print("ready", flush=True)
sys.stdin.readline()
t0, n, off, k, c0 = time.perf_counter(), 0, 0, 0, cpu()
while time.perf_counter() - t0 < secs:
    d = w.hash(fd, off, size, True, None, "x")
    v = w.encode(fd, off, size, d, codec, "x")
    name = os.path.join(out, str(k))
    with open(name, "wb") as f:
        f.write(v)
    v.release()
    if k:
        os.unlink(os.path.join(out, str(k - 1)))
    n, off, k = n + size, (off + size) % total, k + 1
print(n / (time.perf_counter() - t0), (cpu() - c0) / max(n, 1) * 1e9, flush=True)
w.close()
"""


def _window(tree: str | None, args: argparse.Namespace, data: Path, out: Path) -> tuple[list[float], float, float]:
    src = np.random.default_rng(0).integers(0, 255, args.copy_mib << 20, np.uint8)
    dst = np.empty_like(src)
    proc = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": f"{tree}/client:{tree}/daemon"}
        proc = subprocess.Popen([sys.executable, "-c", _DRIVER, str(data), str(args.secs), args.codec, str(out)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"driver of {tree} failed")
        proc.stdin.write("go\n")
        proc.stdin.flush()
    times: list[float] = []
    end = time.perf_counter() + args.secs
    while time.perf_counter() < end:
        t = time.perf_counter()
        if args.staging:  # as a save: into a new file in /dev/shm, mapped (page faults, zeroed pages)
            fd = os.open(out / "staging", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, len(src))
            with mmap.mmap(fd, len(src)) as m:
                np.copyto(np.frombuffer(m, np.uint8), src)
                del m
            os.close(fd)
            os.unlink(out / "staging")
        else:
            np.copyto(dst, src)
        times.append(time.perf_counter() - t)
        time.sleep(args.gap)
    rate = cpu = 0.0
    if proc is not None:
        assert proc.stdout is not None
        rate, cpu = map(float, proc.stdout.readline().split())
        proc.wait(30)
    for f in out.iterdir():
        f.unlink()
    return times, rate, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", required=True, help="source trees (each with client/ and daemon/)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--copy-mib", type=int, default=16)
    ap.add_argument("--staging", type=int, default=1, help="1: copy into a new mapped /dev/shm file each time "
                    "(as a save does), 0: into the same buffer")
    ap.add_argument("--gap", type=float, default=0.01, help="seconds between two copies")
    ap.add_argument("--mib", type=int, default=256, help="the file drained (over and over)")
    ap.add_argument("--codec", default="bp4-zstd")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tck-membw-", dir="/dev/shm"))
    try:
        data = work / "shard"
        n = (args.mib << 20) // 4
        data.write_bytes((np.random.default_rng(1).standard_normal(n) * 0.02).astype(np.float32).tobytes())
        out = work / "store"
        out.mkdir()
        kinds: list[str | None] = [None, *args.trees]
        copies: dict[str | None, list[float]] = {k: [] for k in kinds}
        rates: dict[str | None, list[float]] = {k: [] for k in kinds}
        cpus: dict[str | None, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for k in (kinds if r % 2 == 0 else [None, *reversed(args.trees)]):
                times, rate, cpu = _window(k, args, data, out)
                copies[k] += times
                rates[k].append(rate)
                cpus[k].append(cpu)
                print(f"round {r + 1} {k or 'no drain'}: copy median {statistics.median(times) * 1e3:.2f} ms "
                      f"({len(times)} copies), drain {rate / 1e6:.0f} MB/s, worker {cpu:.2f} CPU s/GB, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    idle = statistics.median(copies[None])
    print(f"\n{args.copy_mib} MiB copies; {args.rounds} rounds of {args.secs} s windows; codec {args.codec}")
    print(f"  no drain: copy median {idle * 1e3:.2f} ms")
    for k in args.trees:
        med = statistics.median(copies[k])
        print(f"  {k}: copy median {med * 1e3:.2f} ms, {med / idle:.2f}x no drain; drain median "
              f"{statistics.median(rates[k]) / 1e6:.0f} MB/s (per window {[round(x / 1e6) for x in rates[k]]}); the "
              f"worker's CPU per GB drained {statistics.median(cpus[k]):.2f} s "
              f"(per window {[round(x, 2) for x in cpus[k]]})")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
