"""Parity (``--redundancy parity:K+M``, default 4+1) against full replicas (``--replicas 1``),
side by side in one run, on K+M daemons on loopback each time (five for 4+1, six for 4+2).

Per configuration: each of the nodes saves one rank of ``--mib`` MiB (two shards) of one
step; the bench reports

- host memory per node: bytes in the local dir (own ranks + replicas or parity slots) divided by
  the node's own data (the issue's target: <= 1.3x with single-loss survival);
- commit to redundant: from the local commit (``fut.result()``) to ``fut.wait("peer")``, the
  median over the five ranks (the five are saved and waited for concurrently);
- bytes on the network to protect: derived from the protocol (replicas: one full copy per rank;
  parity: each chunk, 1/K of the rank, goes to M protectors, so M ranks' worth in all);
- bytes on the network to restore, measured from the daemons' counters over each restore
  (parity only; replicas: one copy, derived): into the restorer,
  ``tierckpt_parity_rebuild_bulk_bytes_total`` of n2 (XOR: each chunk decoded on its protector
  and received once, about 1x; Reed-Solomon: the K blocks of each chunk's stripe, about Kx), and
  on all links that plus the survivors' ``tierckpt_parity_decode_bulk_bytes_total`` (the other
  members' chunks the XOR protectors pulled to decode; a member held by the protector itself is
  read locally and not counted);
- restore after a node loss: n2 is killed (-9) and wiped, restarted, and restores its rank
  (replicas: a full copy from its replica holder over the bulk channel; parity: every chunk from
  its protector at once, XOR: decoded there from blocks it pulled over the bulk channel,
  Reed-Solomon: decoded here from blocks pulled from all survivors, as they arrive);
  the median of ``--restores`` repeats, each one replacing n2 again (every repeat is listed too:
  a single one can be disturbed by the replaced node catching up in the background);
- XOR encode rate against memcpy (numpy, one thread, ``--xor-mib`` MiB buffers, best of 5).

Network-bound mode (``--link-mbit N``, root only): every daemon in its own network namespace behind
a link shaped to N Mbit/s each way (:mod:`netlink`), as on a cluster whose NICs are the limit
rather than loopback's memory bandwidth; the raw rate of one such link, measured with a plain
TCP copy, is printed first.

Usage: PYTHONPATH=client:daemon .venv/bin/python bench/parity.py [--mib 64] [--restores 3] [--runs 3] [--xor-mib 256]
       [--redundancy parity:4+2] [--link-mbit 800]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from netlink import NetLab
from tierckpt.common import checksum
from tierckptd.parity.xor import xor_into
from tierckptd.testing import Daemon, free_port, scratch_dir

NODES = [f"n{i}" for i in range(5)]  # K+M of them: set by main()


def dir_bytes(d: Daemon) -> int:
    total = 0
    for sub in ("jobs", "parity", "parity-rs"):  # own ranks and replicas, XOR slots, Reed-Solomon rows
        for p in (d.local_dir / sub).rglob("*"):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def _all_up(c) -> bool:
    """Every peer the node watches is up (a node watches its ring neighbourhood and parity group:
    with six nodes and replicas, not every other node)."""
    peers = c.status().peers
    return bool(peers) and all(p.up for p in peers)


def start(root: Path, flags: tuple[str, ...], lab: NetLab | None = None) -> dict[str, Daemon]:
    """The K+M daemons on loopback, or each in its namespace of ``lab``."""
    if lab is not None:
        ds = {n: lab.daemon(root, n, ("--peers", lab.peers_flag(), "--log-level", "WARNING", *flags))
              for n in NODES}
    else:
        ports = {n: free_port() for n in NODES}
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
        ds = {n: Daemon(root, n, port=ports[n], args=("--peers", peers, "--log-level", "WARNING", "--metrics-port",
                                                      str(free_port()), *flags))
              for n in NODES}
    try:
        for d in ds.values():
            d.start()
        for n, d in ds.items():
            with d.client() as c:
                deadline = time.monotonic() + 60
                while not _all_up(c):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{n} does not see its peers")
                    time.sleep(0.2)
    except BaseException:  # never leave daemons behind
        for d in ds.values():
            d.kill()
        raise
    return ds


RECEIVED = "tierckpt_parity_rebuild_bulk_bytes_total"
DECODED = "tierckpt_parity_decode_bulk_bytes_total"


def counter(d: Daemon, name: str) -> float:
    """A counter of the daemon's /metrics (0 if it has none yet)."""
    host = getattr(d, "host", "127.0.0.1")  # a namespaced daemon serves /metrics on its own address
    with urllib.request.urlopen(f"http://{host}:{d.info['metrics_port']}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def one_config(name: str, flags: tuple[str, ...], mib: int, restores: int, settle: float = 0.0,
               lab: NetLab | None = None) -> dict:
    root = scratch_dir("tck-parity-")
    ds = start(root, flags, lab)
    nbytes = mib << 20
    half = nbytes // 2
    rng = np.random.default_rng(1)
    data = {r: (rng.integers(0, 256, half, dtype=np.uint8), rng.integers(0, 256, nbytes - half, dtype=np.uint8))
            for r in range(len(NODES))}
    sums = {r: (checksum.digest(a), checksum.digest(b)) for r, (a, b) in data.items()}
    try:
        def save(rank: int) -> float:
            with ds[NODES[rank]].client() as c:
                fut = c.save("bench", 1, rank, len(NODES), {"a": data[rank][0], "b": data[rank][1]})
                fut.result(timeout=300)
                t0 = time.perf_counter()
                fut.wait("peer", timeout=300)
                return time.perf_counter() - t0

        with ThreadPoolExecutor(len(NODES)) as pool:
            to_redundant = list(pool.map(save, range(len(NODES))))
        mem = [dir_bytes(ds[n]) / nbytes for n in NODES]
        restore_s, into, links = [], [], []
        for _ in range(restores):
            ds["n2"].kill()
            ds["n2"].wipe()
            ds["n2"].start()
            with ds["n2"].client() as c:
                deadline = time.monotonic() + 60
                while not _all_up(c):
                    if time.monotonic() > deadline:
                        raise RuntimeError("n2 does not see its peers after the restart")
                    time.sleep(0.2)
                time.sleep(settle)  # let the replaced node's background catch-up (replicas, parity) run first
                others = [ds[n] for n in NODES if n != "n2"]
                before = sum(counter(d, DECODED) for d in others)
                t0 = time.perf_counter()
                ck = c.restore("bench", 2, step=1)
                restore_s.append(time.perf_counter() - t0)
                got_in = counter(ds["n2"], RECEIVED)
                into.append(got_in / nbytes)
                links.append((got_in + sum(counter(d, DECODED) for d in others) - before) / nbytes)
                got = (checksum.digest(np.asarray(ck.shards["a"])), checksum.digest(np.asarray(ck.shards["b"])))
                assert got == sums[2], "restored bytes differ"
                ck = None
        return {"name": name, "mem_max": max(mem), "mem_mean": statistics.mean(mem),
                "to_redundant": statistics.median(to_redundant), "restore": statistics.median(restore_s),
                "restores": restore_s, "into": statistics.median(into), "links": statistics.median(links)}
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)


def xor_rate(mib: int) -> tuple[float, float]:
    n = mib << 20
    a = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    b = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    best_x = best_c = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        xor_into(a, b)
        best_x = min(best_x, time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(a, b)
        best_c = min(best_c, time.perf_counter() - t0)
    return n / best_x / 1e9, n / best_c / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--xor-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.0, help="seconds between the replaced node seeing its "
                    "peers and its restore (0: at once, as a replacement's trainer would)")
    ap.add_argument("--redundancy", default="parity:4+1", help="parity:K+M (M >= 2: Reed-Solomon on K+M nodes)")
    ap.add_argument("--link-mbit", type=float, default=0.0, help="network-bound: each daemon in its own network "
                    "namespace behind a link of this many Mbit/s each way (root only; 0: loopback)")
    args = ap.parse_args()
    k, m = (int(x) for x in args.redundancy.removeprefix("parity:").split("+"))
    NODES[:] = [f"n{i}" for i in range(k + m)]
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(NetLab(NODES, args.link_mbit)) if args.link_mbit else None
        run_all(args, m, k, lab)
    x, c = xor_rate(args.xor_mib)
    print(f"XOR encode {x:.2f} GB/s vs memcpy {c:.2f} GB/s ({x / c:.2f}x), one thread, {args.xor_mib} MiB")


def run_all(args: argparse.Namespace, m: int, k: int, lab: NetLab | None) -> None:
    net = {"replicas:1": (1.0, 1.0, 1.0), args.redundancy: (float(m), 0.0, 0.0)}
    ratios: dict[str, list[float]] = {"to_redundant": [], "restore": []}
    if lab is not None:
        one = lab.raw_rate(NODES[0], NODES[1])
        print(f"network-bound: each node in its own namespace, links shaped to {lab.mbit:g} Mbit/s each way; raw TCP "
              f"copy n0 -> n1 measured {one * 8 / 1e6:.0f} Mbit/s ({one / 1e6:.1f} MB/s): one {args.mib} MiB rank "
              f"takes {(args.mib << 20) / one:.2f} s over one link")
    else:
        print("loopback (no --link-mbit)")
    print(f"{args.mib} MiB per rank, {len(NODES)} nodes, one rank each; {args.runs} runs, the two configurations in "
          "turn")
    print("| run | redundancy | memory per node (max / mean, x own data) | commit -> redundant (median s) | network "
          "to protect (x rank) | network to restore, all links / into the restorer (x rank; parity: measured, "
          "median) | restore after a node loss (median s; each) |")
    print("|---|---|---|---|---|---|---|")
    mem_ok = True
    for run in range(1, args.runs + 1):
        rows = [one_config("replicas:1", ("--replicas", "1"), args.mib, args.restores, args.settle, lab),
                one_config(args.redundancy, ("--redundancy", args.redundancy), args.mib, args.restores, args.settle,
                           lab)]
        for r in rows:
            n = net[r["name"]]
            if r["name"] != "replicas:1":
                n = (n[0], r["links"], r["into"])
            print(f"| {run} | {r['name']} | {r['mem_max']:.3f} / {r['mem_mean']:.3f} | {r['to_redundant']:.3f} | "
                  f"{n[0]:.2f} | {n[1]:.2f} / {n[2]:.2f} | {r['restore']:.3f} "
                  f"({', '.join(f'{x:.2f}' for x in r['restores'])}) |", flush=True)
        rep, par = rows
        mem_ok = mem_ok and par["mem_max"] <= 1.3 + (m - 1) / k  # 4+1: 1.3x; 4+2: 1.55x
        for key, values in ratios.items():
            values.append(par[key] / rep[key])
    print(f"parity / replicas, per run: commit->redundant {', '.join(f'{x:.2f}' for x in ratios['to_redundant'])} "
          f"(median {statistics.median(ratios['to_redundant']):.2f}x); restore after a loss "
          f"{', '.join(f'{x:.2f}' for x in ratios['restore'])} (median {statistics.median(ratios['restore']):.2f}x, "
          f"target <= 1.5x: {'met' if statistics.median(ratios['restore']) <= 1.5 else 'NOT met'}; every run: "
          f"{'met' if max(ratios['restore']) <= 1.5 else 'NOT met'}); memory <= {1.3 + (m - 1) / k:.2f}x "
          f"of own data with {m}-loss survival: {'met' if mem_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
