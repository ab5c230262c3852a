"""Issue 28 item 3: save() blocking while a compressed drain runs vs with no drain, same run.

Two daemons, each with its own ``file://`` persistent store on disk (``--store-dir``: elsewhere,
e.g. /dev/shm), content layout,
``codec = auto`` (byte planes + zstd for floats), default knobs but one: ``drain_yield=2.0``
(the default: the drain's workers are stopped while a save is open or committing) on one,
``drain_yield=0`` (the drain never waits) on the other. Per round and daemon (alternating): a
--mib MiB float32 rank (16 shards, trained-weight-like values) is saved with ``persist=True``;
from its local commit until its drain has stored the manifest, small saves (--small MiB, not
persisted) run --gap seconds apart (0: back to back): their blocking times (the save and its
local commit, ``save(...).result()``) are "during a drain"; then as many small saves run with no
drain in flight: "no drain". The other daemon is stopped (``SIGSTOP``) during a round, so its
background work after its own round (refilling its page pool) stays out of this one's figures
(``--no-freeze-other``: not stopped). Reported: median blocking during / no drain (same daemon, same run),
and the drain time of the big rank per daemon (what yielding costs the drain).

Command: PYTHONPATH=client:daemon .venv/bin/python bench/save_during_drain.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import Daemon, scratch_dir


def _state(mib: int, shards: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = (mib << 20) // shards // 4
    return {f"layer{i}": (rng.standard_normal(n) * 0.02).astype(np.float32) for i in range(shards)}


def _save(c: object, step: int, small: dict) -> tuple[float, float]:
    """(seconds until save() returned: the bytes are copied out; until its local commit) of one small save."""
    s0 = time.perf_counter()
    fut = c.save("small", step, 0, 1, small)  # type: ignore[attr-defined]
    s1 = time.perf_counter()
    fut.result(600)
    return s1 - s0, time.perf_counter() - s0


def _train_step(work: np.ndarray | None, gap: float) -> None:
    """What a trainer does between two saves: ``gap`` seconds, with ``work`` (its activations and
    gradients, --step-mib) written once, so the caches hold the trainer's data, not the last save's."""
    if work is not None:
        work += 1
    time.sleep(gap)


def _round(c: object, big: dict, small: dict, step: int, gap: float,
           work: np.ndarray | None = None) -> tuple[list, list, float]:
    """(blocking during the drain, blocking with no drain: (copy, commit) pairs; drain seconds) of one round."""
    fut = c.save("big", step, 0, 1, big, persist=True)  # type: ignore[attr-defined]
    fut.result(600)
    t0 = time.perf_counter()
    done = threading.Event()
    drain = [0.0]

    def wait() -> None:
        fut.wait("persistent", timeout=600)
        drain[0] = time.perf_counter() - t0
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    during: list[tuple[float, float]] = []
    k = 0
    while not done.is_set():
        k += 1
        timed = _save(c, step * 1000 + k, small)
        if not done.is_set():  # only saves that ended while the drain still ran
            during.append(timed)
        _train_step(work, gap)
    idle = []
    for j in range(max(3, len(during))):
        idle.append(_save(c, step * 1000 + 500 + j, small))
        _train_step(work, gap)
    return during, idle, drain[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--small", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between two small saves (a trainer's step)")
    ap.add_argument("--step-mib", type=int, default=0,
                    help="MiB the trainer writes between two saves (its activations and gradients; 0: none, so a "
                         "save with no drain finds the last save's bytes still in the CPU caches)")
    ap.add_argument("--codec", default="auto", help="the daemons' codec setting (none: the drain without a codec)")
    ap.add_argument("--variants", nargs=2, default=["drain_yield=2.0", "drain_yield=0"],
                    help="the knobs of the two daemons (default: the drain yields to saves, and it does not)")
    ap.add_argument("--store-dir", default=None,
                    help="where the file:// stores go (default: the temporary directory, on disk; /dev/shm: tmpfs)")
    ap.add_argument("--knobs", default="", help="more daemon knobs, e.g. drain_nice=0 (the drain at full priority)")
    ap.add_argument("--no-freeze-other", dest="freeze_other", action="store_false",
                    help="leave the other arm's daemon running during a round (by default it is stopped with SIGSTOP: "
                         "its pool warming after its own round would land in this round's saves)")
    args = ap.parse_args()
    root = scratch_dir("tck-sdd-")
    workers = tuple(args.variants)
    stores = {w: Path(tempfile.mkdtemp(prefix="tck-sdd-store-", dir=args.store_dir)) for w in workers}
    knobs = {w: w + (f",{args.knobs}" if args.knobs else "") for w in workers}
    ds = {w: Daemon(root, f"w{i}", args=("--persistent", stores[w].as_uri(), "--codec", args.codec, "--keep-local", "2",
                                          "--log-level", "WARNING", "--knobs", knobs[w]))
          for i, w in enumerate(workers)}
    during: dict[str, list[tuple[float, float]]] = {w: [] for w in workers}
    idle: dict[str, list[tuple[float, float]]] = {w: [] for w in workers}
    drains: dict[str, list[float]] = {w: [] for w in workers}
    small = _state(args.small, 4, 0)
    work = np.zeros(args.step_mib << 18, dtype=np.float32) if args.step_mib else None
    try:
        for d in ds.values():
            d.start()
        clients = {w: d.client() for w, d in ds.items()}
        for r in range(1, args.rounds + 1):
            big = _state(args.mib, 16, r)
            for w, c in clients.items():
                others = [d for v, d in ds.items() if v != w] if args.freeze_other else []
                for d in others:  # the other arm's background work (pool warming) stays out of this one
                    os.kill(d.proc.pid, signal.SIGSTOP)
                try:
                    a, b, t = _round(c, big, small, r, args.gap, work)
                finally:
                    for d in others:
                        os.kill(d.proc.pid, signal.SIGCONT)
                during[w] += a
                idle[w] += b
                drains[w].append(t)
                print(f"round {r}, {w}: drain {t:.2f} s, {len(a)} saves during it "
                      f"(median {statistics.median(t for _, t in a) if a else float('nan'):.4f} s), no drain median "
                      f"{statistics.median(t for _, t in b):.4f} s", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for d in ds.values():
            d.kill()
        shutil.rmtree(root, ignore_errors=True)
        for s in stores.values():
            shutil.rmtree(s, ignore_errors=True)
    mb = args.mib * 1.048576
    print(f"\n{args.mib} MiB float32 drained per round; small saves of {args.small} MiB; {args.rounds} rounds; "
          f"{args.step_mib} MiB written between saves")
    for w in workers:
        dm, im = (statistics.median(t for _, t in x[w]) for x in (during, idle))
        dc, ic = (statistics.median(c for c, _ in x[w]) for x in (during, idle))
        print(f"  {w}: save blocking during a drain {dm:.4f} s ({len(during[w])} saves), no drain "
              f"{im:.4f} s: {dm / im:.2f}x; of which the copy (save() returned) {dc:.4f} s vs {ic:.4f} s: "
              f"{dc / ic:.2f}x; drain median {statistics.median(drains[w]):.2f} s "
              f"({mb / statistics.median(drains[w]):.0f} MB/s)")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
