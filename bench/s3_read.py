"""S3 restore throughput through one bandwidth limit: tierckpt's persistent tier vs DCP at its best.

The goodput benchmark's object store (``moto_server`` behind ``bench/_throttle.py``, ``--rate``
MiB/s per direction, the same ``ObjectStore`` as ``bench/goodput.py --s3``) and its state shape:
three float32 arrays of 43,690 x 1,024 (512 MiB; weights-like values, N(0, 0.02)). Each arm
writes its copy once straight to moto (not timed, not through the limit), then restores it
``--runs`` times through the limit, the arms taking turns within each round:

- ``dcp+s3torchconnector``: ``dcp.load`` with s3torchconnector's ``S3StorageReader`` (the CRT
  client; the copy written by ``S3StorageWriter``). Its readers (``S3ReaderConstructor``:
  ``dcp_optimized``, the default, ``sequential``, ``range_based``) each restore once first, and the
  fastest is the one measured.
- ``dcp+s3fs``: ``dcp.load`` with ``FsspecReader`` (s3fs: 32 MiB blocks, read-ahead; the fallback
  arm of ``bench/goodput.py --s3``; skipped when s3fs is not installed apart, see bench/README.md).
- ``tierckpt codec none`` / ``tierckpt codec auto``: a fresh daemon (local dir wiped, as after a
  cluster loss) restores the rank from ``--persistent s3://...`` (content layout, 8 MiB chunks
  fetched by parallel GETs); ``none`` stores the raw bytes (the throughput figure), ``auto`` the
  default float codec (fewer bytes through the limit); ``per-shard``: raw bytes in the per-shard
  layout (one object per shard, s3transfer's parallel ranged GETs above 64 MiB).

Every DCP restore runs in a fresh process (``--worker``) and times ``dcp.load`` alone (no
interpreter or torch import); tierckpt's time is ``Client.restore`` on a started daemon. The
ratio that issue 30 targets: tierckpt (codec none) MiB/s / the best DCP arm's >= 0.9.

Usage: PYTHONPATH=client:daemon .venv/bin/python bench/s3_read.py [--rate 64] [--runs 3] [--mib 512]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ROW = 1024  # LARGE_MODEL's d_model: 43,690 rows of 1,024 float32 per array at 512 MiB
DCP_KINDS = ("s3torchconnector", "s3fs")
TCK_ARMS = {"none": ("--codec", "none"), "auto": ("--codec", "auto"),
            "per-shard": ("--codec", "none", "--knobs", "per_shard_layout=1")}
"""tierckpt's arms: daemon flags by name (``tierckpt codec NAME`` in the report)."""


def make_state(mib: int) -> dict[str, np.ndarray]:
    rows = mib * 2**20 // 3 // (ROW * 4)
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal((rows, ROW), dtype=np.float32) * 0.02) for name in ("weight", "exp_avg",
                                                                                          "exp_avg_sq")}


# ---------------------------------------------------------------------------------------------- DCP worker


def _writer(kind: str, url: str) -> Any:
    if kind == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter("us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True),
                               thread_count=2)
    from goodput import _S3FS_OPTIONS
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, sync_files=False, thread_count=2, **{**_S3FS_OPTIONS,
                                                                   "endpoint_url": os.environ["AWS_ENDPOINT_URL"]})


S3TC_READERS = ("dcp_optimized", "sequential", "range_based")


def _reader(kind: str, url: str) -> Any:
    if kind.startswith("s3torchconnector"):
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader

        constructor = getattr(S3ReaderConstructor, kind.partition(":")[2] or "dcp_optimized")()
        return S3StorageReader("us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True),
                               reader_constructor=constructor)
    from goodput import _S3FS_OPTIONS
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **{**_S3FS_OPTIONS, "endpoint_url": os.environ["AWS_ENDPOINT_URL"]})


def worker(argv: list[str]) -> int:
    """``--worker save|load KIND URL MIB``: one dcp.save or dcp.load; prints ``{"seconds": ...}``."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")  # no process group
    op, kind, url, mib = argv[1], argv[2], argv[3], int(argv[4])
    state = {k: torch.from_numpy(v) for k, v in make_state(mib).items()}
    if op == "save":
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=_writer(kind, url), no_dist=True)
    else:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=_reader(kind, url), no_dist=True)
        dt = time.perf_counter() - t0
        if not all(torch.equal(target[k], state[k]) for k in state):
            sys.exit(f"{kind}: the loaded state differs")
        print(json.dumps({"seconds": dt}))
        return 0
    print(json.dumps({"seconds": time.perf_counter() - t0}))
    return 0


def s3fs_path() -> Path | None:
    from goodput import S3FS_PATH

    return S3FS_PATH if (S3FS_PATH / "s3fs").is_dir() else None


def run_worker(op: str, kind: str, url: str, mib: int, env: dict[str, str]) -> float:
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [str(s3fs_path()), os.environ.get("PYTHONPATH")]))} \
        if kind == "s3fs" else {}
    out = subprocess.run([sys.executable, __file__, "--worker", op, kind, url, str(mib)], capture_output=True,
                         text=True, env={**os.environ, **env, **extra}, timeout=900)
    if out.returncode:
        sys.exit(f"{kind} {op} failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


# ---------------------------------------------------------------------------------------------- main


def stored_bytes(store: Any, prefix: str) -> int:
    s3 = store._admin()
    return sum(o["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="goodput", Prefix=prefix)
               for o in page.get("Contents", []))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return worker(argv)
    from goodput import ObjectStore
    from tierckptd.testing import Daemon, scratch_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=64.0, help="MiB/s per direction through the limit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tck-s3read-"))
    sock = scratch_dir("tck-s3r-")
    store = ObjectStore(work, args.rate * 2**20)
    limited = store.env
    direct = {**store.env, "AWS_ENDPOINT_URL": store.direct}
    state = make_state(args.mib)
    nbytes = sum(a.nbytes for a in state.values())
    kinds = [k for k in DCP_KINDS if k != "s3fs" or s3fs_path()]
    if "s3fs" not in kinds:
        print("dcp+s3fs: skipped (s3fs is not installed apart; see bench/README.md, Goodput)")
    times: dict[str, list[float]] = {}
    daemons: dict[str, Any] = {}
    try:
        print(f"state {nbytes / 2**20:.0f} MiB (3 float32 arrays); S3 (moto_server) through {args.rate:g} MiB/s "
              f"per direction; writes straight to moto, {args.runs} restores per arm through the limit", flush=True)
        for kind in kinds:
            run_worker("save", kind, store.url(f"dcp-{kind}"), args.mib, direct)
        for codec, extra in TCK_ARMS.items():
            flags = ("--persistent", store.url(f"tck-{codec}"), "--keep-local", "1", *extra)
            d = Daemon(sock, f"w{codec}", env=direct, args=flags).start()
            with d.client() as c:
                c.save("s3read", 1, 0, 1, state, persist=True).wait("persistent", timeout=600)
            d.kill()
            d.wipe()
            daemons[codec] = Daemon(sock, f"r{codec}", env=limited, args=flags)
        url = store.url("dcp-s3torchconnector")
        picks = {r: run_worker("load", f"s3torchconnector:{r}", url, args.mib, limited) for r in S3TC_READERS}
        reader = min(picks, key=picks.__getitem__)
        print("s3torchconnector readers, one restore each: " + ", ".join(f"{r} {t:.2f} s" for r, t in picks.items())
              + f"; measured: {reader}", flush=True)
        sizes = {f"dcp+{k}": stored_bytes(store, f"dcp-{k}/") for k in kinds}
        sizes.update({f"tierckpt codec {c}": stored_bytes(store, f"tck-{c}/") for c in daemons})
        for run in range(args.runs):
            for kind in kinds:
                how = f"{kind}:{reader}" if kind == "s3torchconnector" else kind
                times.setdefault(f"dcp+{kind}", []).append(
                    run_worker("load", how, store.url(f"dcp-{kind}"), args.mib, limited))
            for codec, d in daemons.items():
                d.wipe()
                d.start()
                with d.client() as c:
                    t0 = time.perf_counter()
                    ck = c.restore("s3read", 0, step=1)
                    dt = time.perf_counter() - t0
                    assert ck.tier == "persistent", ck.tier
                    first = next(iter(state))
                    assert np.array_equal(np.asarray(ck.shards[first][:4]), state[first][:4])
                    ck.close()
                d.kill()
                times.setdefault(f"tierckpt codec {codec}", []).append(dt)
            print(f"round {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    finally:
        for d in daemons.values():
            d.kill()
        store.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    report(times, sizes, nbytes, args.rate)
    return 0


def report(times: dict[str, list[float]], sizes: dict[str, int], nbytes: int, rate: float) -> None:
    print(f"\n{'arm':<26} {'median s':>9} {'MiB/s':>7} {'/limit':>7} {'stored MiB':>11}  runs")
    mibs = {}
    for k, v in times.items():
        med = statistics.median(v)
        mibs[k] = nbytes / 2**20 / med
        print(f"{k:<26} {med:9.2f} {mibs[k]:7.1f} {mibs[k] / rate:6.2f}x {sizes[k] / 2**20:11.1f}  "
              + " ".join(f"{x:.2f}" for x in v))
    dcp = {k: v for k, v in mibs.items() if k.startswith("dcp")}
    best = max(dcp, key=dcp.__getitem__)
    for k in (k for k in mibs if k.startswith("tierckpt")):
        r = mibs[k] / dcp[best]
        print(f"{k} / {best} = {r:.2f}x  [>= 0.9x]  {'OK' if r >= 0.9 else 'MISS'}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
