"""The bound ``tierckpt.dcp.Stager`` under torch.distributed: 2 gloo ranks, one real daemon.

Each rank stages its own save in ``stage()`` (rank and world size from the process group) with a
row-sharded DTensor (its local shard), a plain tensor every rank holds (DCP's global plan keeps
it in one rank's plan: the other rank's staged copy stays unreferenced) and a non-tensor value;
the tensors change after ``staging_completion``. ``dcp.load`` on both ranks gives the bytes of
save time, byte for byte, and so does a single-process load of the whole state.

Run as ``python -m tests.dcp.test_stager_ranks --worker ADDR JOB`` this module is one rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ..test_dcp import REPO, worker_path  # noqa: E402

WORLD = 2


def _full(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {"sharded": torch.randn(64, 1024, generator=g),  # 256 KiB, 128 KiB per rank
            "rep": torch.randn(300, 1024, generator=g),  # ~1.2 MiB on every rank (deduplicated)
            "tiny": torch.arange(10, dtype=torch.float32) + version}


def _worker(address: str, job: str) -> None:
    import datetime

    import tierckpt
    import tierckpt.dcp as tdcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me = dist.get_rank()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full = _full(1)
    sd = {"model": {"sharded": distribute_tensor(full["sharded"].clone(), mesh, [Shard(0)]),
                    "rep": full["rep"].clone(), "tiny": full["tiny"].clone()}, "epoch": 5}
    stager = tdcp.Stager()
    with tierckpt.Client(address) as c:
        resp = dcp.async_save(sd, storage_writer=tdcp.Writer(job, 1, client=c, stager=stager), async_stager=stager)
        resp.staging_completion.result(60)
        sd["model"]["sharded"].to_local().fill_(-1.0)  # staged: the tensors may change
        sd["model"]["rep"].fill_(-1.0)
        sd["epoch"] = 6
        resp.upload_completion.result(120)
        got = {"model": {"sharded": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]),
                         "rep": torch.zeros(300, 1024), "tiny": torch.zeros(10)}, "epoch": 0}
        dcp.load(got, storage_reader=tdcp.Reader(job, 1, client=c))
    stager.close()
    assert torch.equal(got["model"]["sharded"].full_tensor(), full["sharded"]), "sharded"
    assert torch.equal(got["model"]["rep"], full["rep"]) and torch.equal(got["model"]["tiny"], full["tiny"])
    assert got["epoch"] == 5
    dist.barrier()
    print(f"rank {me} ok", flush=True)
    dist.destroy_process_group()


def test_bound_stagers_on_two_ranks_save_the_bytes_of_stage_time(daemon, scratch):
    import tierckpt
    import tierckpt.dcp as tdcp
    from tierckptd.testing import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", PYTHONPATH=worker_path(), PYTHONFAULTHANDLER="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dcp.test_stager_ranks", "--worker", daemon.address,
                               "ranks"], cwd=REPO, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(WORLD)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        finally:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, f"rank {r} failed:\n{out[-6000:]}"
    full = _full(1)
    got = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "epoch": 0}
    with tierckpt.Client(daemon.address) as c:  # one process loads what two saved
        dcp.load(got, storage_reader=tdcp.Reader("ranks", 1, client=c), no_dist=True)
    for k, v in full.items():
        assert torch.equal(got["model"][k], v), k
    assert got["epoch"] == 5


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3])
    os._exit(0)  # checked and destroyed: skip finalization, where torch's C++ threads rarely abort
