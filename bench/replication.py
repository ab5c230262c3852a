"""Peer-tier replication throughput vs a raw Python TCP socket, in one run.

Two daemons on loopback (replicas=1, keep_local=1). Each round saves one 1 GiB shard on n0 and
times ``fut.wait("peer")`` from the local commit until n1 has verified and committed its copy
(prepare, bulk transfer, checksum, manifest). Rounds 1-2 write fresh tmpfs pages on the replica;
from round 3 on, the daemons reuse the pages of evicted steps (the steady state of periodic
checkpointing, and what the target is checked on). Right after each round the same file is moved
over one raw socket (see ``_rawsock.py``) ``--raw-copies`` times, and the median of those copies
is the round's baseline (one raw copy on this VM takes either ~0.45 s or ~1.0 s per GiB, which
made single-copy ratios swing 2x), so both see the same machine load; the target is checked on
the median of the per-round ratios.

The baseline is the issue's, a raw socket copy *into a file* on the same tmpfs, in the page state
the replica's copy had: a fresh file in rounds 1-2 (the replica's pages are fresh too), one file
rewritten in place from round 3 (the daemons reuse their pages then; its pages are touched by an
untimed copy first). The copy that discards the bytes (the fastest a plain Python socket moves
them, no write at all) is printed beside it as a stricter reference. The raw copy waits ``--settle`` seconds first:
a commit makes the daemons top their warm pools up once they are idle, and a raw copy racing that
work would be slowed by it (flattering the ratio).

Round 1 is the issue-17 case: the receiver's pages are fresh. The owner's WarmReplica hint (sent when
the save begins, see tierckptd.peer.hints) lets the receiver allocate them while the trainer is still
copying; ``--knobs warm_hint=0`` turns that off for an A/B pair.

Round 1 happens once per pair of daemons, so ``--runs N`` repeats everything with fresh daemons
and checks round 1 on the median of the N runs (one round-1 figure on a shared 2-core machine
swings 0.7-1.2x between runs).

Usage: .venv/bin/python bench/replication.py [--gib 1] [--rounds 4] [--runs 5] [--knobs warm_hint=0] [--settle 1]
       [--raw-copies 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tierckptd.testing import Daemon, free_port, scratch_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rawsock import raw_copy_seconds

TARGET = 0.9
"""Steady state (median of rounds 3.. of every run) against the raw socket into a file (issue 30)."""
TARGET_ROUND1 = 0.8
"""Round 1 (fresh pages on the replica; median over the runs) against the raw socket (issue 17)."""


def one_run(args: argparse.Namespace, run: int) -> tuple[list[float], list[float], list[float]]:
    """Fresh daemons, ``args.rounds`` rounds: (replication seconds, raw socket into a file seconds,
    raw socket discarding seconds) per round."""
    nbytes = int(args.gib * (1 << 30))
    root = scratch_dir("tck-bench-")
    ports = {n: free_port() for n in ("n0", "n1")}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    flags = ("--peers", peers, "--replicas", "1", "--keep-local", "1", "--log-level", "WARNING",
             *(("--knobs", args.knobs) if args.knobs else ()),
             *(("--local-reserve", str(int(args.reserve * (1 << 30)))) if args.reserve else ()))
    ds = {n: Daemon(root, n, port=ports[n], args=flags) for n in ports}
    try:
        for d in ds.values():
            d.start()
        block = np.random.default_rng(run).integers(0, 256, 16 << 20, dtype=np.uint8)
        data = np.resize(block, nbytes)
        secs: list[float] = []
        raw: list[float] = []
        discard: list[float] = []
        with ds["n0"].client() as c:
            while not all(p.up for p in c.status().peers):
                time.sleep(0.05)
            if args.reserve:  # held from start-up: filled (touched) before the job saves, as local_tier.py waits
                t0 = time.perf_counter()
                for d in ds.values():
                    with d.client() as dc:
                        while dc.status().reserve_ready_bytes < int(args.reserve * (1 << 30)):
                            time.sleep(0.1)
                print(f"run {run}: reserves filled {time.perf_counter() - t0:.1f} s after the peers were up",
                      flush=True)
            for step in range(1, args.rounds + 1):
                data[:8] = step  # a new checkpoint each round
                fut = c.save("bench", step, 0, 1, {"w": data})
                fut.result()
                t0 = time.perf_counter()
                assert fut.wait("peer", timeout=600) == ["n1"]
                secs.append(time.perf_counter() - t0)
                src = next((ds["n0"].local_dir / "jobs" / "bench" / f"{step:020d}").rglob("w.*"))
                time.sleep(args.settle)
                raw.append(statistics.median(raw_copy_seconds(src, rounds=args.raw_copies, to_dir=root,
                                                              warm=step >= 3)))
                discard.append(statistics.median(raw_copy_seconds(src, rounds=args.raw_copies)))
                print(f"run {run} round {step}: replicated {nbytes / 2**30:.2f} GiB in {secs[-1]:.3f}s "
                      f"({nbytes / secs[-1] / 1e9:.2f} GB/s); raw socket into a {'warm' if step >= 3 else 'fresh'} "
                      f"file {raw[-1]:.3f}s ({nbytes / raw[-1] / 1e9:.2f} GB/s), ratio {raw[-1] / secs[-1]:.2f}x; "
                      f"discarding {discard[-1]:.3f}s, ratio {discard[-1] / secs[-1]:.2f}x", flush=True)
        return secs, raw, discard
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=1, help="repeat with fresh daemons (round 1 happens once per run)")
    ap.add_argument("--reserve", type=float, default=0.0,
                    help="GiB of local_reserve on both daemons (issue 30: (keep_local + 1) x the state = 2 x --gib)")
    ap.add_argument("--knobs", default="", help="tuning knobs for both daemons (A/B runs), e.g. warm_hint=0")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between a round and its raw copy")
    ap.add_argument("--raw-copies", type=int, default=3,
                    help="raw-socket copies after each round; the round's baseline is their median")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    steady: list[float] = []
    steady_secs: list[float] = []
    steady_raw: list[float] = []
    first: list[float] = []
    strict: list[float] = []
    for run in range(1, args.runs + 1):
        secs, raw, discard = one_run(args, run)
        first.append(raw[0] / secs[0])
        warm = list(range(2, len(secs))) or list(range(len(secs)))
        steady += [raw[i] / secs[i] for i in warm]
        strict += [discard[i] / secs[i] for i in warm]
        steady_secs += [secs[i] for i in warm]
        steady_raw += [raw[i] for i in warm]
    ratio, ratio1 = statistics.median(steady), statistics.median(first)
    label = "rounds 3.." if args.rounds > 2 else "all rounds: too few for a steady state"
    print(f"\nsteady state ({label}, {len(steady)} rounds): replication "
          f"{nbytes / statistics.median(steady_secs) / 1e9:.2f} GB/s, raw socket "
          f"{nbytes / statistics.median(steady_raw) / 1e9:.2f} GB/s into a file")
    print(f"ratio replication/raw into a file = {ratio:.2f}x (target >= {TARGET}x): "
          f"{'PASS' if ratio >= TARGET else 'FAIL'}; against a raw socket discarding the bytes "
          f"{statistics.median(strict):.2f}x")
    print(f"round 1 (fresh pages on the replica and the raw copy's file), {len(first)} runs: "
          f"{' '.join(f'{r:.2f}x' for r in first)}; "
          f"median {ratio1:.2f}x (target >= {TARGET_ROUND1}x): {'PASS' if ratio1 >= TARGET_ROUND1 else 'FAIL'}")
    return 0 if ratio >= TARGET and ratio1 >= TARGET_ROUND1 else 1


if __name__ == "__main__":
    sys.exit(main())
