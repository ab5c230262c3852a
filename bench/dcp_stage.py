"""DCP ``async_save`` staging, one host copy vs two (issue 31 item 1), side by side in one run.

The same state (``--gib`` GiB of float32 in ``--tensors`` CPU tensors, default 1 GiB in 16) is
saved with ``dcp.async_save`` (THREAD executor, one process) by three arms, each with one stager
kept across its saves (as a trainer keeps it), ``--runs`` saves each after one warm-up save, in turns
(a, b, c, a, b, c, ...) so that a change of machine load hits every arm alike:

- (a) DCP's ``DefaultStager`` (async staging; no pinned memory or non-blocking copies without an
  accelerator) and ``FileSystemWriter`` (two write threads) into a directory on tmpfs;
- (b) ``tierckpt.dcp.Stager()`` unbound, ``tierckpt.dcp.Writer``: a host copy in the stager, a
  second into the local tier's staging files in ``write_data``;
- (c) ``tierckpt.dcp.Stager()`` bound to its ``Writer(job, step, stager=stager)``: one host copy,
  straight into the staging files; ``write_data`` only commits.

The daemon's local tier is on tmpfs too (started as the other bench/ scripts do). Printed per arm,
medians: "returns" (``async_save`` came back), "state free" (``staging_completion``: the tensors
may change), "committed" (``upload_completion``), and the ratios of (c) against (a) and (b).

Usage: PYTHONPATH=client:daemon python bench/dcp_stage.py [--gib 1] [--tensors 16] [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(dcp, sd, writer, stager) -> tuple[float, float, float]:
    """(returns, state free, committed) seconds of one ``dcp.async_save``."""
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=writer, async_stager=stager, no_dist=True)
    t1 = time.perf_counter()
    resp.staging_completion.result()
    t2 = time.perf_counter()
    resp.upload_completion.result()
    return t1 - t0, t2 - t0, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        print("bench/dcp_stage.py needs torch (pip install tierckpt[torch]); not run", file=sys.stderr)
        return 2
    import warnings

    import tierckpt
    import tierckpt.dcp as tdcp
    from tierckptd.testing import Daemon, scratch_dir
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    n = int(args.gib * (1 << 30) / 4) // args.tensors
    sd = {"model": {f"w{i}": torch.randn(n) for i in range(args.tensors)}, "step": 0}
    nbytes = n * 4 * args.tensors
    print(f"state: {nbytes / (1 << 30):.2f} GiB float32 in {args.tensors} CPU tensors; torch {torch.__version__}; "
          f"{args.runs} saves per arm after a warm-up, in turns")
    work = scratch_dir("dcp-stage-")
    daemon = Daemon(work, "dcpstage", args=("--keep-local", "1")).start()
    fs = work / "fs"
    times: dict[str, list[tuple[float, float, float]]] = {"a": [], "b": [], "c": []}
    try:
        with tierckpt.Client(daemon.address) as c:
            default = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
            unbound, bound = tdcp.Stager(), tdcp.Stager()

            def arm_a(i: int) -> tuple[float, float, float]:
                shutil.rmtree(fs, ignore_errors=True)  # one copy on tmpfs at a time, as keep_local=1
                return _timed(dcp, sd, dcp.FileSystemWriter(str(fs), thread_count=2), default)

            def arm_b(i: int) -> tuple[float, float, float]:
                return _timed(dcp, sd, tdcp.Writer("unbound", i + 1, client=c), unbound)

            def arm_c(i: int) -> tuple[float, float, float]:
                return _timed(dcp, sd, tdcp.Writer("bound", i + 1, client=c, stager=bound), bound)

            for i in range(args.runs + 1):
                for name, arm in (("a", arm_a), ("b", arm_b), ("c", arm_c)):
                    sd["step"] = i
                    got = arm(i)
                    if i:
                        times[name].append(got)
            default.close()
            unbound.close()
            bound.close()
    finally:
        daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: tuple(statistics.median(r[j] for r in v) for j in range(3)) for k, v in times.items()}
    labels = {"a": "(a) DCP DefaultStager + FileSystemWriter (tmpfs)",
              "b": "(b) tierckpt Writer + unbound Stager (2 host copies)",
              "c": "(c) tierckpt Writer + bound Stager (1 host copy)"}
    print()
    print("| arm | returns ms | state free ms | committed ms | committed GiB/s |")
    print("|---|---|---|---|---|")
    for k, (ret, free, done) in med.items():
        print(f"| {labels[k]} | {ret * 1e3:.1f} | {free * 1e3:.1f} | {done * 1e3:.1f} | "
              f"{nbytes / (1 << 30) / done:.2f} |")
    print()
    for other in ("a", "b"):
        r = [med[other][j] / med["c"][j] for j in range(3)]
        print(f"(c) vs {other}: committed {r[2]:.2f}x faster, state free {r[1]:.2f}x, returns {r[0]:.2f}x "
              f"(time of {other} / time of c)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
