"""The storage-facing scenarios of PyTorch's own DCP tests (test_file_system_checkpoint_cpu.py,
e2e/test_e2e_save_and_load.py, test_dtensor_resharding.py: CPU/gloo parts), written for
tierckpt's Writer and Reader: each loads what DCP's FileSystemWriter/FileSystemReader load for
the same state (the control), and what the scenario expects. These are our own tests of the
same behaviours, not copies of PyTorch's files.

Run as ``python -m tests.dcp.test_scenarios --worker ADDRESS JOB FSDIR`` this module is one rank
of the two-rank (gloo) scenarios.
"""

from __future__ import annotations

import inspect
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import tierckpt.dcp as tdcp  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from tierckptd.testing import Daemon, free_port, scratch_dir  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from ..test_dcp import REPO, worker_path  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized")]


@pytest.fixture(scope="module")
def node():
    """One daemon for the module's single-process scenarios (each uses its own job)."""
    root = scratch_dir()
    d = Daemon(root, "scen").start()
    try:
        with d.client() as c:
            yield d, c
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


class Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(5, 5)
        self.b = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class Blob(Stateful):
    def __init__(self, value: bytes) -> None:
        self.value = value

    def state_dict(self):
        return {"blob": io.BytesIO(self.value)}

    def load_state_dict(self, state_dict) -> None:
        b = state_dict["blob"]
        b.seek(0)
        self.value = b.read()


def _both(node, job: str, tmp_path: Path, sd_save: dict, make_target, **load_kw) -> tuple[dict, dict]:
    """Save ``sd_save`` through tierckpt and through the filesystem control; load each into a
    fresh ``make_target()``; returns (tierckpt's, the control's)."""
    _, c = node
    dcp.save(sd_save, storage_writer=tdcp.Writer(job, 1, client=c), no_dist=True)
    dcp.save(sd_save, storage_writer=dcp.FileSystemWriter(str(tmp_path / job)), no_dist=True)
    got, control = make_target(), make_target()
    dcp.load(got, storage_reader=tdcp.Reader(job, 1, client=c), no_dist=True, **load_kw)
    dcp.load(control, storage_reader=dcp.FileSystemReader(str(tmp_path / job)), no_dist=True, **load_kw)
    return got, control


def _same(a, b) -> bool:
    """Equal structure, dtypes, shapes and bytes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_module_state_round_trip_without_a_process_group(node, tmp_path):
    saved = Model(1).state_dict()
    got, control = _both(node, "scen-module", tmp_path, saved, lambda: Model(2).state_dict())
    assert _same(got, control) and _same(got, saved)


def test_tensors_and_a_stateful_blob(node, tmp_path):
    saved = {**Model(3).state_dict(), "blob": Blob(b"SomeBlobForTesting")}
    got, control = _both(node, "scen-blob", tmp_path, saved, lambda: {**Model(4).state_dict(), "blob": Blob(b"")})
    assert got["blob"].value == control["blob"].value == b"SomeBlobForTesting"
    assert all(torch.equal(got[k], saved[k]) for k in saved if k != "blob")


def test_a_narrower_target_dtype_is_cast_as_with_the_filesystem(node, tmp_path):
    saved = {"w": torch.rand(4, 3, dtype=torch.float32)}
    got, control = _both(node, "scen-cast", tmp_path, saved, lambda: {"w": torch.zeros(4, 3, dtype=torch.bfloat16)})
    assert got["w"].dtype == torch.bfloat16 and _same(got, control)
    wide, wide_control = _both(node, "scen-widen", tmp_path, {"w": torch.rand(4, 3, dtype=torch.bfloat16)},
                               lambda: {"w": torch.zeros(4, 3)})
    assert wide["w"].dtype == torch.float32 and _same(wide, wide_control)


@pytest.mark.skipif("allow_unsafe_types" not in inspect.signature(DefaultLoadPlanner).parameters,
                    reason="DefaultLoadPlanner(allow_unsafe_types=...) needs a newer torch than the pinned one")
def test_strict_planner_refuses_a_narrowing_cast(node):
    _, c = node
    dcp.save({"w": torch.rand(4, 3)}, storage_writer=tdcp.Writer("scen-strict", 1, client=c), no_dist=True)
    with pytest.raises(dcp.api.CheckpointException, match="dtype mismatch"):
        dcp.load({"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, storage_reader=tdcp.Reader("scen-strict", 1, client=c),
                 planner=DefaultLoadPlanner(allow_unsafe_types=False), no_dist=True)


def test_stateful_entries_load_in_place_and_plain_ones_are_replaced(node):
    _, c = node

    class Recording(dict):
        set_called = False

        def __setitem__(self, k, v):
            type(self).set_called = True
            super().__setitem__(k, v)

    class Foo(Stateful):
        loaded = False

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            Foo.loaded = True

    sd = Recording()
    sd["foo"] = Foo()
    Recording.set_called = False
    dcp.save(sd, storage_writer=tdcp.Writer("scen-stateful", 1, client=c))
    dcp.load(sd, storage_reader=tdcp.Reader("scen-stateful", 1, client=c))
    assert Foo.loaded and not Recording.set_called
    sd = Recording()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    Recording.set_called = False
    dcp.save(sd, storage_writer=tdcp.Writer("scen-stateful", 2, client=c))
    dcp.load(sd, storage_reader=tdcp.Reader("scen-stateful", 2, client=c))
    assert Recording.set_called


def test_an_empty_state_saves_and_loads(node):
    _, c = node
    dcp.save({}, storage_writer=tdcp.Writer("scen-empty", 1, client=c))
    dcp.load({}, storage_reader=tdcp.Reader("scen-empty", 1, client=c))
    assert c.latest("scen-empty") == 1


def test_model_and_optimizer_state_dicts_load_in_place(node):
    _, c = node
    model = Model(5)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    loss = model.b(model.a(torch.rand(3, 5))).sum() + model.emb(torch.tensor([[0, 1]])).sum()
    loss.backward()
    optim.step()
    saved = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
    dcp.save(saved, storage_writer=tdcp.Writer("scen-init", 1, client=c))
    model2 = Model(6)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.2)
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, optim2)
    target = {"model": msd, "optimizer": osd}
    dcp.load(target, storage_reader=tdcp.Reader("scen-init", 1, client=c))
    assert target["model"] is msd and target["optimizer"] is osd  # loaded in place
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    assert _same(get_model_state_dict(model2), saved["model"])
    assert optim2.param_groups[0]["lr"] == 0.1


def test_partial_load_by_keys(node):
    _, c = node
    model = Model(7)
    saved = {"model": model.state_dict(), "extra": {"epoch": 3}}
    dcp.save(saved, storage_writer=tdcp.Writer("scen-keys", 1, client=c))
    got = _load_state_dict_from_keys("model", storage_reader=tdcp.Reader("scen-keys", 1, client=c))
    assert set(got) == {"model"} and _same(got["model"], saved["model"])


# ---------------------------------------------------------------------------------- two gloo ranks


def _worker(address: str, job: str, fsdir: Path) -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharded_tensor import state_dict_hook
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = [0]

    def save_load(saved: dict, make_target) -> tuple[dict, dict]:
        step[0] += 1
        path = str(fsdir / str(step[0]))
        dcp.save(saved, storage_writer=tdcp.Writer(job, step[0], address=address))
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(path))
        got, control = make_target(), make_target()
        dcp.load(got, storage_reader=tdcp.Reader(job, step[0], address=address))
        dcp.load(control, storage_reader=dcp.FileSystemReader(path))
        return got, control

    # ShardedTensor saved with one sharding plan, loaded into another (every pair).
    e = [(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)]
    specs = [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec([ShardMetadata([o, 0], [n, 20], f"rank:{r}") for o, n, r in e]),
        EnumerableShardingSpec([ShardMetadata([0, 0], [8, 20], "rank:1"), ShardMetadata([8, 0], [2, 20], "rank:0")]),
    ]

    class Holder(torch.nn.Module):
        def __init__(self, spec) -> None:
            super().__init__()
            self.st = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
            self._register_state_dict_hook(state_dict_hook)

    def full(st):
        out = torch.zeros(st.shape) if rank == 0 else None
        st.gather(out=out)
        return out

    for i, s0 in enumerate(specs):
        for j, s1 in enumerate(specs):
            if i == j:
                continue
            src = Holder(s0)
            got, control = save_load(src.state_dict(), lambda s1=s1: Holder(s1).state_dict())
            a, b, want = full(got["st"]), full(control["st"]), full(src.st)
            if rank == 0:
                assert torch.equal(a, b) and torch.equal(a, want), (i, j)

    # DTensor: saved sharded one way, loaded sharded another way or replicated.
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(5)
    base = torch.randn(7, 9, generator=g)  # odd sizes: uneven shards
    for src_p, dst_p in (([Shard(0)], [Shard(1)]), ([Shard(1)], [Replicate()]), ([Replicate()], [Shard(0)])):
        saved = {"t": distribute_tensor(base, mesh, src_p)}
        got, control = save_load(saved, lambda dst_p=dst_p: {"t": distribute_tensor(torch.zeros(7, 9), mesh, dst_p)})
        assert torch.equal(got["t"].to_local(), control["t"].to_local()), (src_p, dst_p)
        assert torch.equal(got["t"].full_tensor(), base), (src_p, dst_p)

    # Keys in a different order on each rank.
    sd = {"a": torch.ones(2), "b": torch.zeros(2)} if rank == 0 else {"b": torch.zeros(2), "a": torch.ones(2)}
    got, control = save_load(sd, lambda: {"a": torch.empty(2), "b": torch.empty(2)})
    assert _same(got, control)

    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def test_sharded_and_dtensor_resharding_on_two_ranks(node, tmp_path):
    d, c = node
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=worker_path(), PYTHONFAULTHANDLER="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dcp.test_scenarios", "--worker", d.address, "scen-2",
                               str(tmp_path)], cwd=REPO, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, f"rank {r} failed:\n{out[-5000:]}"
    assert c.latest("scen-2") == 16  # 12 sharding pairs, 3 DTensor, 1 key order


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    os._exit(0)  # checked and destroyed: skip finalization, where torch's C++ threads rarely abort
