"""Issue 28 item 4: the first persistent restore of a freshly started daemon vs a warm one.

One daemon (file:// persistent tier on the scratch dir, content layout, ``--codec auto``) saves
and drains two jobs of the same shape (bf16 + fp32 + f16 float shards, different values, so
nothing is shared); it is then killed, its local dir wiped, and started again. Job ``a`` is
restored first (the fresh process: any lazy import lands here, e.g. the zipnn wrapper's torch
before issue 28), then job ``b`` (the same work, warm). Repeated --runs times; prints each pair
and the medians. The daemon imports whatever tierckptd PYTHONPATH names, so the same command
against an older tree measures that tree's daemon.

Command: PYTHONPATH=client:daemon .venv/bin/python bench/first_restore.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import Daemon, scratch_dir


def _shards(seed: int, mib: int) -> dict[str, np.ndarray]:
    x = (np.random.default_rng(seed).standard_normal(mib << 18) * 0.02).astype(np.float32)  # mib MiB of fp32
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return {"w32": x, "w16": x[: len(x) // 2].astype(np.float16), "bf16": bf16[: len(x) // 2]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=16, help="MiB of fp32 per job (+ a quarter each in f16, bf16)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    work = scratch_dir("tck-first-restore-")
    firsts, warms = [], []
    try:
        url = (work / "store").as_uri()
        d = Daemon(work, "n", args=("--persistent", url, "--persist-every", "1", "--codec", "auto"))
        d.start()
        with d.client() as c:
            for job, seed in (("a", 1), ("b", 2)):
                c.save(job, 1, 0, 1, _shards(seed, args.mib)).wait("persistent", timeout=300)
        for run in range(args.runs):
            d.kill()
            d.wipe()
            d.start()
            times = []
            with d.client() as c:
                for job in ("a", "b"):
                    t0 = time.perf_counter()
                    ck = c.restore(job, 0, step=1)
                    times.append(time.perf_counter() - t0)
                    assert ck.tier == "persistent"
                    ck.close()
            firsts.append(times[0])
            warms.append(times[1])
            print(f"run {run}: first restore {times[0]:.3f} s, warm {times[1]:.3f} s")
        d.kill()
        mb = sum(a.nbytes for a in _shards(1, args.mib).values()) / 1e6
        first, warm = statistics.median(firsts), statistics.median(warms)
        print(f"{mb:.0f} MB per restore; median first {first:.3f} s, warm {warm:.3f} s, "
              f"first - warm {first - warm:+.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
