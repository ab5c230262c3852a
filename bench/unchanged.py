"""Unchanged shards: save() blocking, bytes written and bytes replicated with vs without ``unchanged=``.

Two daemons on loopback (replicas=1, keep_local=2). A 1 GiB rank state in 10 shards of ~102 MiB;
each step changes one shard (10%), the other nine are as before. Job "full" saves every shard
every step; job "incr" passes the nine untouched ones as ``unchanged=`` (the daemon links the
previous step's files, and the peer links its previous replica's). The two jobs alternate step by
step, so both see the same machine load. The first ``--warmup`` steps are not counted: step 1 is
all new, and until retention evicts steps the daemons write fresh tmpfs pages rather than
recycled ones (the steady state of periodic checkpointing is what is compared).

The peer links a shard by name, size, layout and checksum whatever the client's hint, so job
"full" replicates only the changed shard too: before this change every step sent the whole rank
(``rank_bytes``).

Per step: the time save() blocked the caller, the time to the local commit, the bytes the client
wrote (the SaveResult's bytes less ``shared_bytes``), the time until the peer copy is committed,
and the bytes sent to the peer (the rank's bytes less what the peer linked:
``tierckpt_shared_bytes_total{tier="peer"}`` on n1). Medians, then the ratios incr/full.

Usage: .venv/bin/python bench/unchanged.py [--gib 1] [--steps 8] [--warmup 3] [--changed 0.1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import urllib.request

import numpy as np
from tierckptd.testing import Daemon, free_port, scratch_dir

SHARDS = 10


def _peer_linked(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith('tierckpt_shared_bytes_total{tier="peer"}'):
            return float(line.split()[1])
    return 0.0


def _one(c, job: str, step: int, shards: dict, unchanged: list[str], mport: int) -> dict[str, float]:
    before = _peer_linked(mport)
    t0 = time.perf_counter()
    fut = c.save(job, step, 0, 1, shards, unchanged=unchanged)
    blocked = time.perf_counter() - t0
    res = fut.result(600)
    committed = time.perf_counter() - t0
    assert fut.wait("peer", timeout=600) == ["n1"]
    replicated = time.perf_counter() - t0
    linked = _peer_linked(mport) - before
    return {"blocking_s": blocked, "commit_s": committed, "written_bytes": res.nbytes - res.shared_bytes,
            "peer_s": replicated, "replicated_bytes": res.nbytes - linked}


def _shards(nbytes: int, changed: float, step: int, base: list[np.ndarray]) -> tuple[dict, list[str]]:
    """``base`` with the first ``changed`` fraction of the shards given new bytes for ``step``."""
    n_changed = max(1, round(SHARDS * changed))
    out = {}
    for i, arr in enumerate(base):
        if i < n_changed:
            arr = arr.copy()
            arr[:8] = step
            arr[-8:] = step
        out[f"s{i:02d}"] = arr
    return out, [f"s{i:02d}" for i in range(n_changed, SHARDS)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="first steps not counted")
    ap.add_argument("--changed", type=float, default=0.1, help="fraction of the shards that change per step")
    args = ap.parse_args()
    per = int(args.gib * (1 << 30)) // SHARDS
    base = [np.random.default_rng(i).integers(0, 256, per, dtype=np.uint8) for i in range(SHARDS)]
    root = scratch_dir("tck-bench-")
    ports = {n: free_port() for n in ("n0", "n1")}
    mports = {n: free_port() for n in ports}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    ds = {n: Daemon(root, n, port=ports[n], args=("--peers", peers, "--replicas", "1", "--keep-local", "2",
                                                   "--log-level", "WARNING", "--metrics-port", str(mports[n])))
          for n in ports}
    rows: dict[str, list[dict[str, float]]] = {"full": [], "incr": []}
    try:
        for d in ds.values():
            d.start()
        with ds["n0"].client() as c:
            while not all(p.up for p in c.status().peers):
                time.sleep(0.05)
            for step in range(1, args.steps + 1):
                shards, unchanged = _shards(per * SHARDS, args.changed, step, base)
                for job in ("full", "incr"):
                    r = _one(c, job, step, shards, unchanged if job == "incr" else [], mports["n1"])
                    if step > args.warmup:
                        rows[job].append(r)
                    print(f"step {step} {job}: " + ", ".join(f"{k} {v:.3f}" if k.endswith("_s") else f"{k} {v:.0f}"
                                                             for k, v in r.items()), flush=True)
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)
    med = {job: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for job, rs in rows.items()}
    print(f"\n{per * SHARDS / 2**30:.2f} GiB per step, {SHARDS} shards, {args.changed:.0%} changed per step; "
          f"medians of steps {args.warmup + 1}..{args.steps}; rank_bytes {per * SHARDS / 2**20:.1f} MiB:")
    for k in med["full"]:
        f, i = med["full"][k], med["incr"][k]
        unit = "s" if k.endswith("_s") else " MiB"
        scale = 1 if k.endswith("_s") else 1 / 2**20
        print(f"  {k:17s} full {f * scale:10.3f}{unit}  incr {i * scale:10.3f}{unit}  ratio incr/full {i / f:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
