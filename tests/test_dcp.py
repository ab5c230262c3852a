"""tierckpt.dcp: DCP save / async_save / load through real daemons, with a 2-process gloo group.

Run as ``python -m tests.test_dcp --worker`` (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
this module is the body of one rank of the distributed test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tierckpt
import tierckpt.dcp as tdcp
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .harness import free_port

REPO = Path(__file__).resolve().parents[1]


def worker_path() -> str:
    """PYTHONPATH for worker processes: the repository (for ``tests``), then this process's own
    path, so that a checkout run with PYTHONPATH=client:daemon tests its own code in workers too."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full_state(version: int) -> dict:
    """The global (unsharded) state the distributed test saves; ``version`` changes every value."""
    g = torch.Generator().manual_seed(version)
    return {
        "big": torch.randn(128, 256, generator=g),  # 64 KiB per rank when sharded: own shards
        "small": torch.randn(8, 6, generator=g),
        "half": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "bias": torch.arange(5, dtype=torch.int64) * version,
        "extra": {"epoch": version, "name": "run"},
    }


def _zeros_like_full() -> dict:
    return {"big": torch.zeros(128, 256), "small": torch.zeros(8, 6), "half": torch.zeros(4, 10, dtype=torch.bfloat16),
            "bias": torch.zeros(5, dtype=torch.int64), "extra": {"epoch": -1, "name": ""}}


def _worker(address: str, job: str) -> None:
    """One rank: save step 1 (dcp.save), 2 (dcp.async_save) and 3 (async_save with tierckpt.dcp.Stager)
    with DTensor shards, load them back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(full: dict) -> dict:
        return {"big": distribute_tensor(full["big"], mesh, [Shard(0)]),
                "small": distribute_tensor(full["small"], mesh, [Shard(1)]),
                "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
                "bias": full["bias"].clone(), "extra": dict(full["extra"])}

    dcp.save(sharded(full_state(1)), storage_writer=tdcp.Writer(job, 1, address=address))
    sd2 = sharded(full_state(2))
    fut = dcp.async_save(sd2, storage_writer=tdcp.Writer(job, 2, address=address))
    for t in ("big", "small"):  # the staged copy is saved, not what training does next
        sd2[t].to_local().add_(1000)
    fut.result()
    stager = tdcp.Stager()  # step 3: staged by tierckpt's AsyncStager (DTensor shards), off the caller's thread
    sd3 = sharded(full_state(3))
    resp = dcp.async_save(sd3, storage_writer=tdcp.Writer(job, 3, address=address), async_stager=stager)
    resp.staging_completion.result()
    for t in ("big", "small"):  # staged: training may change the tensors
        sd3[t].to_local().add_(1000)
    resp.upload_completion.result()
    stager.close()
    dist.barrier()
    for step, version in ((1, 1), (2, 2), (None, 3)):
        target = sharded(_zeros_like_full())
        dcp.load(target, storage_reader=tdcp.Reader(job, step, address=address))
        expect = sharded(full_state(version))
        for k in ("big", "small", "half"):
            assert torch.equal(target[k].to_local(), expect[k].to_local()), (rank, step, k)
        assert torch.equal(target["bias"], expect["bias"]) and target["extra"] == expect["extra"], (rank, step)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def _worker_shapes(address: str, job: str) -> None:
    """One rank: process-based async save, overwrite=False, and a step re-saved from fewer ranks."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    alone = dist.new_group([0])  # the job restarted on fewer ranks

    def sharded(full: dict) -> dict:
        return {"big": distribute_tensor(full["big"], mesh, [Shard(0)]),
                "small": distribute_tensor(full["small"], mesh, [Shard(1)]),
                "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
                "bias": full["bias"].clone(), "extra": dict(full["extra"])}

    def check(step, version: int) -> None:
        target = sharded(_zeros_like_full())
        reader = tdcp.Reader(job, step, address=address)
        dcp.load(target, storage_reader=reader)
        expect = sharded(full_state(version))
        for k in ("big", "small", "half"):
            assert torch.equal(target[k].to_local(), expect[k].to_local()), (rank, step, k)
        assert torch.equal(target["bias"], expect["bias"]) and target["extra"] == expect["extra"], (rank, step)

    # The writer is pickled to a checkpoint process (which connects to the daemon itself).
    fut = dcp.async_save(sharded(full_state(1)), storage_writer=tdcp.Writer(job, 1, address=address),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut = getattr(fut, "upload_completion", fut)
    fut.result()
    check(1, 1)
    try:
        dcp.save(sharded(full_state(9)), storage_writer=tdcp.Writer(job, 1, address=address, overwrite=False))
        raise AssertionError("overwrite=False replaced a step")
    except CheckpointException as e:
        assert "Checkpoint already exists" in str(e), e
    check(1, 1)
    # Step 2 saved by both ranks, then re-saved by rank 0 alone: a load reads only the re-save.
    dcp.save(sharded(full_state(2)), storage_writer=tdcp.Writer(job, 2, address=address))
    if rank == 0:
        dcp.save(full_state(3), storage_writer=tdcp.Writer(job, 2, address=address), process_group=alone)
    dist.barrier()
    check(None, 3)
    check(2, 3)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def _run_ranks(address: str, job: str, world: int = 2, timeout: float = 50, mode: str = "--worker") -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=worker_path(), PYTHONFAULTHANDLER="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_dcp", mode, address, job], cwd=REPO,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, f"rank {r} failed:\n{out[-4000:]}"


def test_two_rank_save_async_save_load_and_reshard_to_one(daemon_factory):
    daemon = daemon_factory(args=("--keep-local", "3"))
    _run_ranks(daemon.address, "dcpjob")
    with daemon.client() as c:
        infos = {i.step: i for i in c.list("dcpjob")}
        assert set(infos) == {1, 2, 3} and all(i.complete and i.world_size == 3 for i in infos.values())
        assert c.latest("dcpjob") == 3
        meta = c.restore("dcpjob", rank=2, step=2)
        assert list(meta.shards) == [tdcp.METADATA_SHARD] and meta.metadata["dcp_world_size"] == 2
        # The 64 KiB half of "big" is its own shard on each rank; the rest is packed.
        assert len(c.restore("dcpjob", rank=1, step=2).shards) == 2

        # Resharding 2 -> 1: one process, no process group, reads both saved ranks.
        for step, version in ((1, 1), (2, 2), (3, 3)):
            target = _zeros_like_full()
            dcp.load(target, storage_reader=tdcp.Reader("dcpjob", step, client=c))
            expect = full_state(version)
            for k in ("big", "small", "half", "bias"):
                assert torch.equal(target[k], expect[k]), (step, k)
            assert target["extra"] == expect["extra"]


def test_process_async_save_overwrite_false_and_resave_from_fewer_ranks(daemon):
    """Issue 24: the Writer pickles into DCP's checkpoint process; overwrite=False raises on
    every rank; a step re-saved from 1 of 2 ranks loads exactly the re-save, at 2 ranks."""
    _run_ranks(daemon.address, "shapes", timeout=120, mode="--worker-shapes")
    with daemon.client() as c:
        infos = {i.step: i for i in c.list("shapes")}
        assert (infos[1].world_size, infos[2].world_size) == (3, 2) and infos[2].complete
        assert c.restore("shapes", rank=1, step=2).metadata["dcp_world_size"] == 1  # the re-save's metadata


def test_single_process_round_trip_and_checkpoint_id(daemon):
    with daemon.client() as c:
        sd = {"w": torch.randn(300, 300), "n": torch.tensor(7), "obj": {"k": [1, 2, 3]}}
        meta = dcp.save(sd, storage_writer=tdcp.Writer(client=c), checkpoint_id="tierckpt://single/5")
        assert meta.storage_meta.checkpoint_id == "tierckpt://single/5"
        assert c.latest("single") == 5
        target = {"w": torch.zeros(300, 300), "n": torch.tensor(0), "obj": {"k": None}}
        ptr = target["w"].data_ptr()
        dcp.load(target, storage_reader=tdcp.Reader(client=c), checkpoint_id="tierckpt://single/latest")
        assert torch.equal(target["w"], sd["w"]) and target["w"].data_ptr() == ptr
        assert target["n"].item() == 7 and target["obj"] == {"k": [1, 2, 3]}
        assert tdcp.Writer.validate_checkpoint_id("tierckpt://single/5")
        assert not tdcp.Writer.validate_checkpoint_id("/tmp/ckpt")


def test_reader_refuses_incomplete_or_missing_steps(daemon):
    with daemon.client() as c:
        with pytest.raises(tierckpt.NotFoundError):
            tdcp.Reader("nothing", client=c).read_metadata()
        dcp.save({"x": torch.ones(3)}, storage_writer=tdcp.Writer("part", 1, client=c))
        # Step 2: rank 0's data committed, but the metadata rank never was (a save that died).
        c.save("part", 2, rank=0, world_size=2, shards={"packed": b"x"}).result()
        assert c.latest("part") == 1
        with pytest.raises(tierckpt.NotFoundError, match="incomplete"):
            tdcp.Reader("part", 2, client=c).read_metadata()
        target = {"x": torch.zeros(3)}
        dcp.load(target, storage_reader=tdcp.Reader("part", client=c))  # latest: the complete step 1
        assert torch.equal(target["x"], torch.ones(3))


def test_save_failure_surfaces_through_dcp(daemon):
    with daemon.client() as c:
        daemon.kill()
        with pytest.raises(CheckpointException, match="UnavailableError"):
            dcp.save({"x": torch.ones(3)}, storage_writer=tdcp.Writer("down", 1, client=c))


if __name__ == "__main__" and sys.argv[1:2] in (["--worker"], ["--worker-shapes"]):
    (_worker if sys.argv[1] == "--worker" else _worker_shapes)(sys.argv[2], sys.argv[3])
    # Everything is checked and the group destroyed: skip interpreter finalization, where torch's
    # C++ threads rarely abort ("terminate called without an active exception", seen once in CI).
    os._exit(0)
