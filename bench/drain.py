"""Persistent-tier drain benchmark: tierckptd draining to S3 vs plain boto3, same server, same run.

A ``moto_server`` (moto[server], a real S3-compatible HTTP server) runs on a free loopback port. In
each round, in alternating order:

- baseline: ``boto3`` ``client.upload_file`` of a 1 GiB file on tmpfs, with the same
  ``TransferConfig`` the daemon's S3 backend uses (``tierckptd.backends.s3.default_transfer_config``);
- drain: a real ``tierckptd`` (``--persistent s3://... --persist-every 1``) is given the same bytes
  by ``Client.save`` (one rank, ``--shards`` shards); the time measured runs from the local
  commit to ``fut.wait("persistent")`` returning (the manifest is uploaded, so the step is
  restorable), i.e. the drain as a trainer sees it, RPCs included.

Objects are deleted after each round (moto keeps them in memory). Printed: median seconds and
MiB/s of each, and the ratio drain/baseline throughput (target >= 0.9x).

Usage: python bench/drain.py [--runs 3] [--gib 1] [--shards 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import Daemon, scratch_dir  # noqa: E402
from tests.servers import MotoServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=1, help="shards the drained rank is split into")
    ap.add_argument("--layout", default="content", choices=("content", "per-shard"),
                    help="the daemon's persistent_layout (content: 8 MiB chunks, hashed and compressed)")
    args = ap.parse_args()

    import boto3
    import tierckpt
    from tierckptd.backends.s3 import default_transfer_config

    work = scratch_dir("tck-drain-bench-")
    server = MotoServer(work)
    server.start()
    os.environ.update(server.env)
    env = {**server.env, "AWS_EC2_METADATA_DISABLED": "true"}
    bucket = server.create_bucket()
    total = int(args.gib * (1 << 30))
    per = total // args.shards
    rng = np.random.default_rng(0)
    shards = {f"s{i:02d}": rng.integers(0, 256, per, dtype=np.uint8) for i in range(args.shards)}
    total = per * args.shards
    src = work / "src.bin"
    with open(src, "wb") as fh:
        for arr in shards.values():
            fh.write(memoryview(arr))
    config = default_transfer_config()
    s3 = boto3.client("s3")
    print(f"{total / 2**20:.0f} MiB ({args.shards} shard(s)); moto_server {server.endpoint_url}; "
          f"TransferConfig: {config.multipart_chunksize >> 20} MiB parts, "
          f"concurrency {config.max_request_concurrency}; "
          f"{os.cpu_count()} CPUs; layout {args.layout}; median of {args.runs} rounds")

    daemon = Daemon(work, "bench", args=("--persistent", f"s3://{bucket}/drain", "--persist-every", "1",
                                         "--keep-local", "1", "--persistent-layout", args.layout), env=env).start()
    base: list[float] = []
    drain: list[float] = []
    try:
        with tierckpt.Client(daemon.address) as c:
            def run_baseline() -> None:
                t0 = time.perf_counter()
                s3.upload_file(str(src), bucket, "baseline/src.bin", Config=config)
                base.append(time.perf_counter() - t0)
                s3.delete_object(Bucket=bucket, Key="baseline/src.bin")

            def run_drain(step: int) -> None:
                fut = c.save("bench", step, 0, 1, shards)
                fut.result()
                t0 = time.perf_counter()
                fut.wait("persistent")
                drain.append(time.perf_counter() - t0)
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="drain/"):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                    if keys:
                        s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})

            run_baseline()  # warm-up: connections, moto's first multipart upload
            run_drain(1)
            base.clear()
            drain.clear()
            for i in range(args.runs):
                if i % 2:
                    run_drain(i + 2)
                    run_baseline()
                else:
                    run_baseline()
                    run_drain(i + 2)
    finally:
        daemon.terminate()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    mib = total / 2**20
    b, d = statistics.median(base), statistics.median(drain)
    print("| path | seconds (median) | MiB/s | runs |")
    print("|---|---|---|---|")
    print(f"| boto3 upload_file | {b:.2f} | {mib / b:.0f} | {', '.join(f'{x:.2f}' for x in base)} |")
    print(f"| tierckptd drain (commit -> wait('persistent')) | {d:.2f} | {mib / d:.0f} | "
          f"{', '.join(f'{x:.2f}' for x in drain)} |")
    print(f"drain / upload_file throughput: {b / d:.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
