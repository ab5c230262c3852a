"""Does the content layout + codec cost the trainer anything? save() blocking and drain time, per-shard raw vs
content + auto codec, in one run.

Issue 13's full-pretraining-step target: content addressing and compression must leave save() blocking unchanged
(they run in the daemon's drain, in the background, but on the same node's CPUs) and must not make the drain slower
than the raw one. Two daemons, each with its own file:// persistent store on the same disk: "raw" drains the
per-shard layout without a codec (the earlier default), "content" the content layout with ``codec = auto`` (ZipNN for
floats). Every step is persisted and everything changes each step (a pretraining step: a new float32 state of
normally distributed values, compressible like trained weights and moments). The arms alternate save by save, so both
see the same machine load; the next save starts ``--gap`` seconds after the previous one committed locally, while
its drain is still running. Reported: median save() blocking per arm and the ratio, median drain time (local commit
to the manifest in the store) and the ratio, and the stored bytes per step.

Usage: .venv/bin/python bench/drain_overhead.py [--mib 512] [--shards 16] [--steps 6] [--gap 0.5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tierckptd.testing import Daemon, scratch_dir

ALL_ARMS = {"raw": ("--persistent-layout", "per-shard", "--codec", "none"),
            "content": ("--persistent-layout", "content", "--codec", "auto"),
            "content-none": ("--persistent-layout", "content", "--codec", "none")}


def _state(mib: int, shards: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    n = (mib << 20) // shards // 4
    return {f"layer{i}.weight": (rng.standard_normal(n) * 0.02).astype(np.float32) for i in range(shards)}


def _stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between a local commit and the next save")
    ap.add_argument("--arms", default="raw,content",
                    help="comma-separated, the first is the baseline: " + ",".join(ALL_ARMS))
    args = ap.parse_args()
    arms = {a: ALL_ARMS[a] for a in args.arms.split(",")}
    base = next(iter(arms))
    root = scratch_dir("tck-bench-")
    stores = {arm: Path(tempfile.mkdtemp(prefix="tck-bench-store-")) for arm in arms}  # on disk, not tmpfs
    ds = {arm: Daemon(root, arm, args=("--persistent", f"file://{stores[arm]}", "--keep-local", "2",
                                       "--log-level", "WARNING", *flags)) for arm, flags in arms.items()}
    blocking: dict[str, list[float]] = {arm: [] for arm in arms}
    drain: dict[str, list[float]] = {arm: [] for arm in arms}
    stored: dict[str, list[int]] = {arm: [] for arm in arms}
    try:
        for d in ds.values():
            d.start()
        clients = {arm: d.client() for arm, d in ds.items()}
        for step in range(1, args.steps + 1):
            state = _state(args.mib, args.shards, step)
            for arm, c in clients.items():
                before = _stored_bytes(stores[arm])
                t0 = time.perf_counter()
                fut = c.save("pretrain", step, 0, 1, state, persist=True)
                blocking[arm].append(time.perf_counter() - t0)
                fut.result(600)
                t1 = time.perf_counter()
                fut.wait("persistent", timeout=600)
                drain[arm].append(time.perf_counter() - t1)
                stored[arm].append(_stored_bytes(stores[arm]) - before)
                time.sleep(args.gap)
            print(f"step {step}: " + "; ".join(f"{arm} blocking {blocking[arm][-1]:.3f}s drain {drain[arm][-1]:.3f}s "
                                               f"stored {stored[arm][-1] / 2**20:.1f} MiB" for arm in arms), flush=True)
        for c in clients.values():
            c.close()
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)
        for s in stores.values():
            shutil.rmtree(s, ignore_errors=True)
    med = {k: {arm: statistics.median(v[arm][1:] or v[arm]) for arm in arms} for k, v in
           (("blocking", blocking), ("drain", drain), ("stored", stored))}
    print(f"\n{args.mib} MiB rank in {args.shards} float32 shards, {args.steps} steps (medians from step 2):")
    for k, unit in (("blocking", "s"), ("drain", "s"), ("stored", "MiB")):
        scale = 2**20 if unit == "MiB" else 1
        print(f"  {k:<9} " + ", ".join(f"{arm} {med[k][arm] / scale:.3f} {unit}" for arm in arms) + "; " +
              ", ".join(f"{arm}/{base} = {med[k][arm] / med[k][base]:.2f}x" for arm in arms if arm != base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
