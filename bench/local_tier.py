"""Local tier benchmark: tierckpt vs the physical floor and vs DCP, side by side in one run.

State: 16 float32 arrays of 64 MiB (1 GiB). Every figure is the median of --runs runs (after a
warm-up), all on the same tmpfs. Printed:

- floor: memcpy into a pre-faulted buffer; write() into a new tmpfs file
- tierckpt: save() blocking time, time until committed locally, restore to usable arrays
- torch.save / torch.load of the same state
- DCP (FileSystemWriter/Reader): dcp.save, dcp.load, dcp.async_save blocking time
- the ratios the issue targets: save blocking vs async_save blocking (<= 0.5x), commit vs
  dcp.save (>= 2x faster), restore vs dcp.load (>= 5x faster)

Usage: python bench/local_tier.py [--runs 5] [--arrays 16] [--mib 64]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierckptd.testing import Daemon, scratch_dir  # noqa: E402


def median_time(fn, runs: int, warmup: int = 1, setup=None) -> float:
    times = []
    for i in range(warmup + runs):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tierckpt

    n = (args.mib << 20) // 4
    rng = np.random.default_rng(0)
    state = {f"layer{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(args.arrays)}
    total = sum(a.nbytes for a in state.values())
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    work = scratch_dir("tck-bench-")
    results: dict[str, float] = {}
    print(f"state: {len(state)} float32 arrays, {total / 2**30:.2f} GiB; tmpfs dir {work}; median of {args.runs} runs")

    # ---- physical floor
    dst = {k: np.empty_like(v) for k, v in state.items()}
    for k in dst:
        dst[k][:] = 1  # pre-fault

    def memcpy():
        for k, v in state.items():
            np.copyto(dst[k], v)

    results["memcpy (pre-faulted)"] = median_time(memcpy, args.runs)
    dst = None  # free the 1 GiB
    raw_dir = work / "raw"

    def raw_write():
        raw_dir.mkdir()
        for k, v in state.items():
            with open(raw_dir / k, "wb") as fh:
                fh.write(memoryview(v))

    results["write() new tmpfs files"] = median_time(raw_write, args.runs,
                                                     setup=lambda: shutil.rmtree(raw_dir, ignore_errors=True))
    shutil.rmtree(raw_dir, ignore_errors=True)

    # ---- tierckpt
    daemon = Daemon(work, "bench", args=("--keep-local", "1")).start()
    step = [0]
    try:
        with tierckpt.Client(daemon.address) as c:
            def ck_commit():
                step[0] += 1
                c.save("bench", step[0], 0, 1, tensors).result()

            # Blocking time: the caller waits for save() only; commits finish in the background
            # before the next run starts (as between training steps).
            blocking = []
            for i in range(args.runs + 2):
                step[0] += 1
                t0 = time.perf_counter()
                f = c.save("bench", step[0], 0, 1, tensors)
                blocking.append(time.perf_counter() - t0)
                f.result()
            results["tierckpt save() blocking"] = statistics.median(blocking[2:])
            results["tierckpt save -> committed"] = median_time(ck_commit, args.runs, warmup=1)
            last = step[0]

            def ck_restore():
                ck = c.restore("bench", 0, step=last)
                assert float(ck.shards["layer00"][0]) == float(state["layer00"][0])

            results["tierckpt restore"] = median_time(ck_restore, args.runs)
    finally:
        daemon.terminate()
    shutil.rmtree(daemon.local_dir, ignore_errors=True)

    # ---- torch.save / torch.load
    pt = work / "state.pt"
    results["torch.save"] = median_time(lambda: torch.save(tensors, pt), args.runs, setup=lambda: pt.unlink(missing_ok=True))
    results["torch.load"] = median_time(lambda: torch.load(pt, weights_only=True), args.runs)
    pt.unlink()

    # ---- DCP
    store_file = tempfile.mktemp(dir=work)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    dcp_dir = work / "dcp"
    counter = [0]

    def dcp_path():
        counter[0] += 1
        return dcp_dir / str(counter[0])

    def clean():
        shutil.rmtree(dcp_dir, ignore_errors=True)

    results["dcp.save"] = median_time(lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(dcp_path())),
                                      args.runs, setup=clean)
    saved = dcp_path()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(saved))
    target = {k: torch.empty_like(v) for k, v in tensors.items()}
    results["dcp.load"] = median_time(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(saved)), args.runs)
    target = None
    blocking = []
    for i in range(args.runs + 1):
        clean()
        t0 = time.perf_counter()
        f = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(dcp_path()))
        blocking.append(time.perf_counter() - t0)
        f.result()
    results["dcp.async_save blocking"] = statistics.median(blocking[1:])
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)

    width = max(map(len, results))
    print(f"\n{'operation':<{width}}  {'median s':>9}  {'GB/s':>7}")
    for k, v in results.items():
        print(f"{k:<{width}}  {v:9.4f}  {total / v / 1e9:7.2f}")
    r1 = results["tierckpt save() blocking"] / results["dcp.async_save blocking"]
    r2 = results["dcp.save"] / results["tierckpt save -> committed"]
    r3 = results["dcp.load"] / results["tierckpt restore"]
    r4 = results["tierckpt save() blocking"] / results["memcpy (pre-faulted)"]
    print("\nratios (target in brackets):")
    print(f"  save() blocking / dcp.async_save blocking = {r1:.2f}x  [<= 0.5x]  {'OK' if r1 <= 0.5 else 'MISS'}")
    print(f"  dcp.save / tierckpt committed              = {r2:.2f}x  [>= 2x]    {'OK' if r2 >= 2 else 'MISS'}")
    print(f"  dcp.load / tierckpt restore                = {r3:.2f}x  [>= 5x]    {'OK' if r3 >= 5 else 'MISS'}")
    print(f"  save() blocking / pre-faulted memcpy       = {r4:.2f}x  (the floor is 1x)")


if __name__ == "__main__":
    main()
