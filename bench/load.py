"""Load: N client processes x M saves of mixed sizes against replicating daemons.

Every client process saves its own job (rank 0 of 1) through the daemon of its node, waits for
the local commit of each save (and, with ``--wait-peer``, for its replica), and records the
commit latency (``save()`` called -> committed locally). Afterwards every committed step is
restored and compared byte for byte. Prints saves/s and p50/p99 commit latency as JSON.

    python bench/load.py --clients 8 --saves 50 --nodes 2 --replicas 1

``run_load`` is also what ``tests/faults/test_load.py`` runs (smaller numbers there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

SIZE_MIX = (1 << 10, 64 << 10, 256 << 10, 1 << 20, 3 << 20)


def payload(job: str, step: int, name: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{job}/{step}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def sizes_for(job: str, step: int) -> dict[str, int]:
    """Mixed sizes, deterministic per (job, step): one to three shards."""
    h = hashlib.sha256(f"{job}/{step}".encode()).digest()
    return {f"s{i}": SIZE_MIX[h[i] % len(SIZE_MIX)] + h[i + 3] for i in range(1 + h[7] % 3)}


def _client(address: str, job: str, saves: int, wait_peer: bool) -> dict[str, Any]:
    import tierckpt

    lat: list[float] = []
    committed: list[int] = []
    errors: list[str] = []
    with tierckpt.Client(address) as c:
        for step in range(1, saves + 1):
            shards = {n: payload(job, step, n, s) for n, s in sizes_for(job, step).items()}
            t0 = time.perf_counter()
            try:
                fut = c.save(job, step, 0, 1, shards)
                fut.result(120)
                lat.append(time.perf_counter() - t0)
                if wait_peer:
                    fut.wait("peer", timeout=120)
                committed.append(step)
            except tierckpt.TierckptError as e:
                errors.append(f"step {step}: {e!r}")
    return {"job": job, "latencies": lat, "committed": committed, "errors": errors}


def verify(address: str, job: str, steps: list[int]) -> tuple[int, int]:
    """Restore every committed step; returns (verified, corrupt or missing)."""
    import tierckpt

    ok = bad = 0
    with tierckpt.Client(address) as c:
        for step in steps:
            try:
                ck = c.restore(job, rank=0, step=step)
                want = {n: payload(job, step, n, s) for n, s in sizes_for(job, step).items()}
                got = {n: bytes(v) for n, v in ck.shards.items()}
                ok, bad = (ok + 1, bad) if got == want else (ok, bad + 1)
            except tierckpt.TierckptError:
                bad += 1
    return ok, bad


def _spawn(address: str, job: str, saves: int, wait_peer: bool) -> subprocess.Popen:
    """One client process (this file with ``--worker``); it prints its results as JSON."""
    argv = [sys.executable, __file__, "--worker", address, job, str(saves), "1" if wait_peer else "0"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, env=dict(os.environ))


def run_load(addresses: list[str], clients: int, saves: int, wait_peer: bool = True) -> dict[str, Any]:
    """Run the load and the verification; returns the figures."""
    t0 = time.perf_counter()
    procs = [_spawn(addresses[i % len(addresses)], f"load{i}", saves, wait_peer) for i in range(clients)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        results.append(json.loads(out))
    elapsed = time.perf_counter() - t0
    lat = sorted(x for r in results for x in r["latencies"])
    verified = bad = 0
    for r in results:
        i = int(r["job"][4:])
        ok, b = verify(addresses[i % len(addresses)], r["job"], r["committed"])
        verified, bad = verified + ok, bad + b
    committed = sum(len(r["committed"]) for r in results)
    return {
        "clients": clients, "saves_per_client": saves, "committed": committed, "verified": verified,
        "corrupt_or_missing": bad, "errors": [e for r in results for e in r["errors"]],
        "seconds": round(elapsed, 2), "saves_per_s": round(committed / elapsed, 1),
        "commit_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "commit_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
        "bytes": sum(sum(sizes_for(r["job"], s).values()) for r in results for s in r["committed"]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        address, job, saves, wait_peer = argv[1:5]
        print(json.dumps(_client(address, job, int(saves), wait_peer == "1")))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--no-wait-peer", action="store_true", help="do not wait for each replica")
    args = ap.parse_args(argv)
    from tierckptd.testing import Daemon, free_port, scratch_dir

    root = scratch_dir("tck-load-")
    ids = [f"n{i}" for i in range(args.nodes)]
    ports = {i: free_port() for i in ids}
    peers = ",".join(f"{i}=127.0.0.1:{ports[i]}" for i in ids)
    daemons = [Daemon(root, i, port=ports[i], args=("--peers", peers, "--replicas", str(args.replicas),
                                                  "--keep-local", str(args.saves + 2)))
               for i in ids]
    try:
        for d in daemons:
            d.start()
        time.sleep(1.5)  # let the peers see each other
        res = run_load([d.address for d in daemons], args.clients, args.saves, not args.no_wait_peer)
        res["load_average"] = os.getloadavg()
        res["cpus"] = os.cpu_count()
        print(json.dumps(res, indent=1))
        return 0 if res["corrupt_or_missing"] == 0 and not res["errors"] else 1
    finally:
        for d in daemons:
            d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
