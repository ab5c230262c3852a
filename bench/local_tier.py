"""Local tier benchmark: tierckpt vs the physical floor and vs DCP, side by side in one run.

State: 16 float32 arrays of 64 MiB (1 GiB). Every figure is the median of --runs runs (after a
warm-up), all on the same tmpfs. Printed:

- floor: memcpy into a pre-faulted buffer; write() into a new tmpfs file
- tierckpt: save() blocking time, time until committed locally, restore to usable arrays
- torch.save / torch.load of the same state
- DCP (FileSystemWriter/Reader): dcp.save, dcp.load, dcp.async_save blocking time
- the competitors at their best (bench/_competitors.py; --no-competitors leaves them out): DCP
  2.13's dcp.async_save with the fastest DefaultStager that works here, THREAD and PROCESS
  checkpointers; torch-checkpointing's CheckpointManager saving and loading
- the ratios the issue targets: save blocking vs the best competitor's (<= 0.5x), commit vs
  dcp.save (>= 5x faster), restore vs the best competitor's (>= 5x faster)
- save series: every save's blocking time, for keep_local 1 and 2, with and without a restore
  (mapped, then released) after each save; worst/first (target <= 1.5x) and the steady state
  (median from the first save that can reuse an evicted step's files, save keep_local + 2).
  Each series' daemon holds a reserve (``local_reserve``) of (keep_local + 1) x the state from
  start-up, as the shipped configs do; the series starts once it is filled (``--reserve 0``: none)

Usage: python bench/local_tier.py [--runs 5] [--arrays 16] [--mib 64] [--saves 8] [--series-only] [--reserve 0]
       python bench/local_tier.py --saves 0 --layout 16x64MiB,512x1MiB,4000x128KiB
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


def save_series(state: dict, work: Path, keep_local: int, restore: bool, saves: int, gap: float = 0.0,
                knobs: str = "", reserve: bool = True) -> list[float]:
    """Blocking time of each of ``saves`` saves into a fresh daemon; with ``restore``, the step is
    restored (mapped, checked, then released) after each commit, as an evaluation reader would.
    ``gap``: seconds of "training" between a commit and the next save; ``knobs``: daemon knobs;
    ``reserve``: the daemon holds (keep_local + 1) x the state from start-up (``local_reserve``)."""
    import tierckpt

    nbytes = (keep_local + 1) * sum(a.nbytes for a in state.values()) if reserve else 0
    flags = ("--keep-local", str(keep_local), "--local-reserve", str(nbytes), *(("--knobs", knobs) if knobs else ()))
    daemon = Daemon(work, f"k{keep_local}{'r' if restore else ''}", args=flags).start()
    blocking = []
    try:
        with tierckpt.Client(daemon.address) as c:
            t0 = time.perf_counter()
            while c.status().reserve_ready_bytes < nbytes:  # held from start-up: filled before the job saves
                time.sleep(0.1)
            if nbytes:
                print(f"  (reserve of {nbytes / 2**30:.2f} GiB filled {time.perf_counter() - t0:.1f} s after start-up)")
            for step in range(1, saves + 1):
                t0 = time.perf_counter()
                f = c.save("series", step, 0, 1, state)
                blocking.append(time.perf_counter() - t0)
                f.result()
                if restore:
                    ck = c.restore("series", 0, step=step)
                    first = next(iter(ck.shards))
                    assert ck.shards[first].nbytes == state[first].nbytes
                    release = getattr(ck, "close", None)
                    if release is not None:
                        release()
                    del ck
                time.sleep(gap)
    finally:
        daemon.terminate()
        shutil.rmtree(daemon.local_dir, ignore_errors=True)
    return blocking


def print_series(state: dict, work: Path, saves: int, gap: float = 0.0, knobs: str = "", reserve: bool = True) -> None:
    print(f"\nsave series ({saves} saves each, {gap:g} s between a commit and the next save"
          f"{', knobs ' + knobs if knobs else ''}, "
          f"{'a reserve of (keep_local + 1) x the state' if reserve else 'no reserve'}"
          "; blocking seconds per save; steady = median from save keep_local+2):")
    steady_of: dict[tuple[int, bool], float] = {}
    for keep_local in (1, 2):
        for restore in (False, True):
            b = save_series(state, work, keep_local, restore, saves, gap, knobs, reserve)
            steady = statistics.median(b[keep_local + 1:]) if len(b) > keep_local + 1 else float("nan")
            steady_of[(keep_local, restore)] = steady
            ratio = max(b) / b[0]
            label = f"keep_local {keep_local}, {'restore after each save' if restore else 'no reader'}"
            print(f"  {label:<42} " + " ".join(f"{x:.3f}" for x in b))
            print(f"  {'':<42} worst/first {ratio:.2f}x [<= 1.5x] {'OK' if ratio <= 1.5 else 'MISS'}; "
                  f"steady {steady:.3f}s (first {b[0]:.3f}s)")
    for keep_local in (1, 2):
        r = steady_of[(keep_local, True)] / steady_of[(keep_local, False)]
        print(f"  keep_local {keep_local}: steady with a reader / without = {r:.2f}x [<= 1.2x] "
              f"{'OK' if r <= 1.2 else 'MISS'}")


def parse_layout(text: str) -> list[tuple[int, int]]:
    """``16x64MiB,4000x128KiB`` -> [(count, bytes), ...]."""
    out = []
    for part in text.split(","):
        count, size = part.strip().lower().split("x")
        unit = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}[size[-3:]]
        out.append((int(count), int(size[:-3]) * unit))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--layout", default="", help="comma-separated COUNTxSIZE states, e.g. 16x64MiB,4000x128KiB "
                    "(default: ARRAYSxMIBMiB); each is compared with DCP in turn")
    ap.add_argument("--saves", type=int, default=8, help="saves per series, on the first layout (0: no series)")
    ap.add_argument("--series-only", action="store_true", help="only the save series")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds of training between a commit and the next save")
    ap.add_argument("--knobs", default="", help="daemon tuning knobs for the series (A/B runs), e.g. warm_pool=0")
    ap.add_argument("--reserve", type=int, choices=(0, 1), default=1,
                    help="1: each series' daemon holds local_reserve = (keep_local + 1) x the state (default); 0: none")
    ap.add_argument("--no-competitors", action="store_true",
                    help="leave out DCP's DefaultStager / PROCESS arms and torch-checkpointing")
    args = ap.parse_args()
    layouts = parse_layout(args.layout or f"{args.arrays}x{args.mib}MiB")
    rng = np.random.default_rng(0)
    work = scratch_dir("tck-bench-")
    try:
        for i, (count, size) in enumerate(layouts):
            state = {f"layer{j:04d}": rng.standard_normal(size // 4, dtype=np.float32) for j in range(count)}
            total = sum(a.nbytes for a in state.values())
            print(f"\n=== state: {count} float32 arrays of {size / 2**20:g} MiB, {total / 2**30:.2f} GiB; "
                  f"tmpfs dir {work}; median of {args.runs} runs")
            if args.saves and i == 0:
                print_series(state, work, args.saves, args.gap, args.knobs, bool(args.reserve))
            if not args.series_only:
                compare(state, work, args.runs, competitors=not args.no_competitors)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(state: dict, work: Path, runs: int, competitors: bool = True) -> None:
    """tierckpt vs the floor, torch.save and DCP on one state (see the module docstring)."""
    import tierckpt
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    total = sum(a.nbytes for a in state.values())
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    results: dict[str, float] = {}

    # ---- physical floor
    dst = {k: np.empty_like(v) for k, v in state.items()}
    for v in dst.values():
        v[:] = 1  # pre-fault

    def memcpy():
        for k, v in state.items():
            np.copyto(dst[k], v)

    results["memcpy (pre-faulted)"] = median_time(memcpy, runs)
    dst = None  # free the 1 GiB
    raw_dir = work / "raw"

    def raw_write():
        raw_dir.mkdir()
        for k, v in state.items():
            with open(raw_dir / k, "wb") as fh:
                fh.write(memoryview(v))

    results["write() new tmpfs files"] = median_time(raw_write, runs,
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
            for _i in range(runs + 2):
                step[0] += 1
                t0 = time.perf_counter()
                f = c.save("bench", step[0], 0, 1, tensors)
                blocking.append(time.perf_counter() - t0)
                f.result()
            results["tierckpt save() blocking"] = statistics.median(blocking[2:])
            results["tierckpt save -> committed"] = median_time(ck_commit, runs, warmup=1)
            last = step[0]

            def ck_restore():
                ck = c.restore("bench", 0, step=last)
                first = next(iter(state))
                assert float(ck.shards[first][0]) == float(state[first][0])
                release = getattr(ck, "close", None)  # tierckpt before Checkpoint.close() had none
                if release is not None:
                    release()

            results["tierckpt restore"] = median_time(ck_restore, runs)
    finally:
        daemon.terminate()
    shutil.rmtree(daemon.local_dir, ignore_errors=True)

    # ---- torch.save / torch.load
    pt = work / "state.pt"
    results["torch.save"] = median_time(lambda: torch.save(tensors, pt), runs,
                                        setup=lambda: pt.unlink(missing_ok=True))
    results["torch.load"] = median_time(lambda: torch.load(pt, weights_only=True), runs)
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
                                      runs, setup=clean)
    saved = dcp_path()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(saved))
    target = {k: torch.empty_like(v) for k, v in tensors.items()}
    results["dcp.load"] = median_time(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(saved)), runs)
    target = None
    blocking = []
    for _i in range(runs + 1):
        clean()
        t0 = time.perf_counter()
        f = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(dcp_path()))
        blocking.append(time.perf_counter() - t0)
        f.result()
    results["dcp.async_save blocking"] = statistics.median(blocking[1:])
    if competitors:
        import _competitors

        _competitors.dcp_competitors(tensors, work, runs, results)
    dist.destroy_process_group()
    if competitors:
        _competitors.torch_checkpointing(tensors, work, runs, results)

    width = max(map(len, results))
    print(f"\n{'operation':<{width}}  {'median s':>9}  {'GB/s':>7}")
    for k, v in results.items():
        print(f"{k:<{width}}  {v:9.4f}  {total / v / 1e9:7.2f}")
    print_ratios(results)


def print_ratios(results: dict[str, float]) -> None:
    """The issue's targets: against DCP's defaults, and against the best competitor of each row."""
    def best(*suffixes: str) -> tuple[str, float]:
        rows = {k: v for k, v in results.items() if k.startswith(("dcp", "torch-checkpointing"))
                and k.endswith(suffixes)}
        name = min(rows, key=rows.__getitem__)
        return name, rows[name]

    tck_block, tck_commit = results["tierckpt save() blocking"], results["tierckpt save -> committed"]
    tck_restore = results["tierckpt restore"]
    rows = [("save() blocking / dcp.async_save blocking", tck_block / results["dcp.async_save blocking"], "<=", 0.5),
            ("dcp.save / tierckpt committed", results["dcp.save"] / tck_commit, ">=", 5.0),
            ("dcp.load / tierckpt restore", results["dcp.load"] / tck_restore, ">=", 5.0)]
    name, v = best("blocking", "state free")
    rows.append((f"save() blocking / best ({name})", tck_block / v, "<=", 0.5))
    name, v = best("-> written", "dcp.save")
    rows.append((f"best committed ({name}) / tierckpt committed", v / tck_commit, "", 0.0))
    name, v = best("load")
    rows.append((f"best restore ({name}) / tierckpt restore", v / tck_restore, ">=", 5.0))
    width = max(len(r[0]) for r in rows)
    print("\nratios (target in brackets):")
    for label, r, op, target in rows:
        if not op:  # information, no target
            print(f"  {label:<{width}} = {r:6.2f}x")
            continue
        ok = r <= target if op == "<=" else r >= target
        print(f"  {label:<{width}} = {r:6.2f}x  [{op} {target:g}x]  {'OK' if ok else 'MISS'}")
    r4 = tck_block / results["memcpy (pre-faulted)"]
    print(f"  {'save() blocking / pre-faulted memcpy':<{width}} = {r4:6.2f}x  (the floor is 1x)")


if __name__ == "__main__":
    main()
