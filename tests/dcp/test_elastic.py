"""Issue 24, "restart in any shape": a DCP checkpoint saved by 4 gloo ranks over two real daemons
(ranks 0-1 on node n0, ranks 2-3 on node n1; replicas=1; a file:// persistent tier) is loaded by
2, 1 and 8 ranks, after a save whose metadata commit failed and a save during which the node
holding ranks 2-3 was down -- from the local tier, after n1 is replaced (its ranks come from
the peer tier), and after both nodes are replaced (the persistent tier). ``Reader(step=None)``
must agree on the newest step every reader can load, and every result must equal, byte for
byte, what DCP's own FileSystemWriter/FileSystemReader give for the same state and shapes.

One run of 8 processes (world 8) does it all: the 4-, 2- and 1-rank jobs are subgroups of it
(``dcp.save``/``dcp.load`` with ``process_group``, ``Reader(group=...)``); rank 0 asks the test
for the daemon actions (kill, start, replace) through files in a control directory and the
others wait at a barrier.

Run as ``python -m tests.dcp.test_elastic --worker CTL ADDR0 ADDR1 JOB FSDIR`` this module is
one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ..harness import Cluster, wait_until  # noqa: E402
from ..test_dcp import REPO, worker_path  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORLD = 8
SAVED = 4  # DCP ranks of the checkpoint: tierckpt world size 5
SHAPES = (2, 1, 8)


def full_state(version: int) -> dict:
    g = torch.Generator().manual_seed(100 + version)
    return {
        "big": torch.randn(64, 96, generator=g),  # 6 KiB+ per rank: packed; "wide" gets own shards
        "wide": torch.randn(256, 128, generator=g),
        "small": torch.randn(6, 10, generator=g),  # 10 columns over 4 or 8 ranks: uneven shards
        "half": torch.randn(5, 12, generator=g).to(torch.bfloat16),
        "step": torch.tensor(version, dtype=torch.int64),
        "extra": {"epoch": version, "name": "elastic"},
    }


# ------------------------------------------------------------------------------------ one rank


def _worker(ctl: Path, addresses: list[str], job: str, fsdir: Path, full: bool) -> None:
    import datetime

    import tierckpt
    import tierckpt.dcp as tdcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    me = dist.get_rank()
    address = addresses[(me // 2) % 2]  # processes 0-1, 4-5 on n0; 2-3, 6-7 on n1
    world = dist.get_world_size()
    groups = {n: dist.group.WORLD if n == world else dist.new_group(list(range(n))) for n in (8, 4, 2, 1)
              if n <= world}
    meshes = {n: DeviceMesh.from_group(g, "cpu") for n, g in groups.items() if me < n}
    asked = [0]
    report: dict = {"rank": me, "tiers": {}}

    def ask(action: str) -> None:
        """Rank 0 asks the test to act on the daemons; everyone waits until it is done."""
        if me == 0:
            asked[0] += 1
            (ctl / f"req-{asked[0]:02d}-{action}").write_text("")
            done = ctl / f"done-{asked[0]:02d}"
            while not done.exists():  # the test answers as soon as it has acted
                time.sleep(0.05)
        dist.barrier()

    def sharded(full: dict, n: int) -> dict:
        mesh = meshes[n]
        return {"big": distribute_tensor(full["big"], mesh, [Shard(0)]),
                "wide": distribute_tensor(full["wide"], mesh, [Shard(1)]),
                "small": distribute_tensor(full["small"], mesh, [Shard(1)]),
                "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
                "step": full["step"].clone(), "extra": dict(full["extra"])}

    def zeros(n: int) -> dict:
        z = {k: torch.zeros_like(v) for k, v in full_state(0).items() if isinstance(v, torch.Tensor)}
        return sharded({**z, "extra": {"epoch": -1, "name": ""}}, n)

    def raw(v) -> bytes:
        t = v.to_local() if hasattr(v, "to_local") else v
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    def save(step: int, n: int, **kw) -> None:
        dcp.save(sharded(full_state(step), n), storage_writer=tdcp.Writer(job, step, address=address, **kw),
                 process_group=groups[n])

    def client() -> tierckpt.Client:
        return tdcp._client_for(address)

    # The state as a 4-rank job saves it, with the control copy through DCP's own filesystem plugin.
    if me < SAVED:
        save(1, SAVED, persist=True)
        dcp.save(sharded(full_state(1), SAVED), storage_writer=dcp.FileSystemWriter(str(fsdir)),
                 process_group=groups[SAVED])
        # Step 2: every data rank committed, the coordinator's metadata commit fails.
        real_finish = tdcp.Writer.finish
        if me == 0:
            def failing_finish(self, metadata, results):
                raise tierckpt.UnavailableError("metadata commit failed (test)")
            tdcp.Writer.finish = failing_finish  # type: ignore[method-assign]
        try:
            save(2, SAVED)
            raise AssertionError("step 2 was saved")
        except CheckpointException as e:
            assert "metadata commit failed" in str(e), e
        tdcp.Writer.finish = real_finish  # type: ignore[method-assign]
    dist.barrier()
    if me == 0:  # step 1 replicated and drained before a node goes
        def settled():
            info = next((i for i in client().list(job) if i.step == 1), None)
            return info is not None and info.complete and "persistent" in info.tiers and \
                all(len(r.nodes) >= 2 for r in info.ranks)
        deadline = time.monotonic() + 120
        while not settled():
            assert time.monotonic() < deadline, client().list(job)
            time.sleep(0.1)
    ask("kill-n1")
    if me < SAVED:  # step 3: the node holding ranks 2-3 is down during the save
        try:
            save(3, SAVED)
            raise AssertionError("step 3 was saved")
        except CheckpointException as e:
            assert "Unavailable" in str(e), e
    ask("start-n1")

    expected: dict[int, dict] = {}  # reader world size -> the control's bytes, loaded once

    def load_round(name: str, shapes=SHAPES, step=None) -> None:
        tiers = set()
        for n in shapes:
            if me < n:
                if n not in expected:
                    control = zeros(n)
                    dcp.load(control, storage_reader=dcp.FileSystemReader(str(fsdir)), process_group=groups[n])
                    assert control["extra"] == full_state(1)["extra"]
                    expected[n] = {k: raw(v) for k, v in control.items() if k != "extra"}
                    reference = sharded(full_state(1), n)
                    assert all(expected[n][k] == raw(reference[k]) for k in expected[n]), (name, n)
                target = zeros(n)
                reader = tdcp.Reader(job, step, address=address, group=groups[n])
                dcp.load(target, storage_reader=reader, process_group=groups[n])
                assert (reader.step, reader.world_size) == (1, SAVED + 1), (name, n, reader.step)
                got = {k: raw(v) for k, v in target.items() if k != "extra"}
                assert got == expected[n], (name, n, [k for k in got if got[k] != expected[n][k]])
                assert target["extra"] == full_state(1)["extra"], (name, n)
                tiers.update(reader.tiers.values())
            dist.barrier()
        report["tiers"][name] = sorted(tiers)

    if me == 0:  # one process alone under the group (no_dist): it resolves the step by itself
        alone = {k: torch.zeros_like(v) for k, v in full_state(0).items() if isinstance(v, torch.Tensor)}
        alone["extra"] = {}
        reader = tdcp.Reader(job, address=address, collective=False)
        dcp.load(alone, storage_reader=reader, no_dist=True)
        assert reader.step == 1 and all(torch.equal(alone[k], v) for k, v in full_state(1).items() if k != "extra")
    dist.barrier()
    if not full:  # 4 -> 2 and 4 -> 1 from the local tier
        load_round("local", shapes=(2, 1))
        load_round("explicit", shapes=(2,), step=1)
    else:
        load_round("local")  # 4 -> 2, 4 -> 1, 4 -> 8, the incomplete steps 2 and 3 skipped
        load_round("explicit", shapes=(8,), step=1)
        ask("replace-n1")  # n1's local dir lost: ranks 2-3 come from their replicas on n0
        load_round("peer", shapes=(2, 8))
        ask("replace-all")  # every local dir lost: the persistent tier
        load_round("persistent", shapes=(8, 1))
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    print(f"rank {me} ok", flush=True)


# ------------------------------------------------------------------------------------ the test


def _serve(cluster: Cluster, ctl: Path, procs: list[subprocess.Popen], deadline: float) -> list[str]:
    """Answer the workers' requests until they all exit; returns the actions taken."""
    done: list[str] = []
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, f"workers still running after {done}"
        reqs = sorted(ctl.glob("req-*"))
        if len(reqs) == len(done):
            time.sleep(0.05)
            continue
        req = reqs[len(done)]
        n, action = req.name.split("-", 2)[1:]
        if action == "kill-n1":
            cluster.d["n1"].kill()
        elif action == "start-n1":
            cluster.start("n1")
            cluster.wait_peers("n1")
            cluster.wait_peers("n0")
        elif action in ("replace-n1", "replace-all"):
            for node in ("n1",) if action == "replace-n1" else ("n0", "n1"):
                cluster.replace(node)
            for node in cluster.ids:
                cluster.wait_peers(node)
        else:
            raise AssertionError(f"unknown request {req.name}")
        done.append(action)
        (ctl / f"done-{n}").write_text("")
    return done


def _run(daemon_factory, scratch: Path, world: int) -> tuple[list[str], dict[str, set[str]]]:
    """The workers on a 2-node cluster; returns the daemon actions taken and the tiers the
    readers' metadata came from, per round."""
    persistent = scratch / "persistent"
    persistent.mkdir()
    cluster = Cluster(daemon_factory, 2, replicas=1, extra=("--persistent", f"file://{persistent}"))
    ctl, fsdir = scratch / "ctl", scratch / "fs-control"
    ctl.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=worker_path(), PYTHONFAULTHANDLER="1")
    args = [str(ctl), cluster.d["n0"].address, cluster.d["n1"].address, "elastic", str(fsdir),
            "full" if world == WORLD else "quick"]
    logs = [open(scratch / f"rank{r}.out", "w+b") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dcp.test_elastic", "--worker", *args], cwd=REPO,
                              env=dict(env, RANK=str(r)), stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        actions = _serve(cluster, ctl, procs, time.monotonic() + 540)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read().decode(errors="replace"))
        log.close()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, f"rank {r} failed:\n{out[-6000:]}"
    reports = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outs]
    tiers = {name: set().union(*(set(rep["tiers"].get(name, ())) for rep in reports))
             for name in ("local", "explicit", "peer", "persistent")}
    with cluster.d["n0"].client() as c:  # step 1 is what is left complete; 2 and 3 never were
        wait_until(lambda: [i.step for i in c.list("elastic") if i.complete] == [1], what="only step 1 complete")
    return actions, tiers


def test_restart_on_fewer_ranks_after_a_failed_save(daemon_factory, scratch):
    """4 -> 2 and 4 -> 1 from the local tier, after a failed metadata commit and a dead node."""
    actions, tiers = _run(daemon_factory, scratch, SAVED)
    assert actions == ["kill-n1", "start-n1"]
    assert "local" in tiers["local"] and "persistent" not in tiers["local"], tiers


@pytest.mark.long
def test_restart_in_any_shape_from_every_tier(daemon_factory, scratch):
    """4 -> 2, 1 and 8 from the local tier, then the peer tier, then the persistent tier."""
    actions, tiers = _run(daemon_factory, scratch, WORLD)
    assert actions == ["kill-n1", "start-n1", "replace-n1", "replace-all"]
    assert "local" in tiers["local"] and "persistent" not in tiers["local"], tiers
    assert "peer" in tiers["peer"], tiers  # readers on the replaced n1 took the metadata from n0
    assert "persistent" in tiers["persistent"], tiers


def _port() -> int:
    from tierckptd.testing import free_port

    return free_port()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), sys.argv[3:5], sys.argv[5], Path(sys.argv[6]), sys.argv[7] == "full")
    os._exit(0)  # checked and destroyed: skip finalization, where torch's C++ threads rarely abort
