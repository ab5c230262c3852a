"""Data management end to end: per-job policy, rm, verify, persist (real daemons, file://)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckpt import JobPolicy

from ..harness import Cluster, wait_until


def _save(c, job: str, step: int, rank: int = 0, world: int = 1, **kw) -> None:
    data = np.full(4096, step % 251, dtype=np.uint8)
    c.save(job, step, rank, world, {"model": data}, **kw).result(timeout=60)


def _local_steps(c, job: str) -> list[int]:
    return [i.step for i in c.list(job) if "local" in {t for r in i.ranks for t in r.tiers}]


def test_policy_per_job_keep_local_and_persistence(daemon_factory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    d = daemon_factory(args=("--persistent", f"file://{store}", "--keep-local", "2"))
    with d.client() as c:
        _save(c, "a", 1, policy=JobPolicy(keep_local=1))
        _save(c, "a", 2)
        _save(c, "b", 1)
        _save(c, "b", 2)
        _save(c, "b", 3)
        assert _local_steps(c, "a") == [2]            # keep_local=1 for job a
        assert _local_steps(c, "b") == [2, 3]         # the daemon's flag for job b
        over, eff = c.get_job_policy("a")
        assert over == JobPolicy(keep_local=1) and eff == JobPolicy(1, 0, 0)
        with pytest.raises(tierckpt.InvalidArgumentError, match="keep_local"):
            c.set_job_policy("a", keep_local=0)
        c.set_job_policy("b", persist_every=2, keep_persistent=1)
        _save(c, "b", 4)
        _save(c, "b", 5)
        c.save("b", 6, 0, 1, {"model": b"x" * 10}).wait("persistent", timeout=60)
        with pytest.raises(tierckpt.TierError, match="not selected"):
            c.save("b", 7, 0, 1, {"model": b"y"}).wait("persistent", timeout=60)
        wait_until(lambda: sorted(os.listdir(store / "b" / "manifests")) == [f"{6:020d}"],
                   what="keep_persistent=1 leaves only step 6")
    d.restart()  # the policy survives a restart (and its directory is not quarantined)
    with d.client() as c:
        assert c.get_job_policy("b")[0] == JobPolicy(keep_persistent=1, persist_every=2)
        assert c.status().jobs


def test_rm_verify_persist_single_node(daemon_factory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    d = daemon_factory(args=("--persistent", f"file://{store}"))
    with d.client() as c:
        _save(c, "j", 1, persist=True)
        c.save("j", 2, 0, 1, {"model": b"z" * 100}, persist=True).wait("persistent", timeout=60)
        c.save("j", 1, 0, 1, {"model": np.full(4096, 1, dtype=np.uint8)}, persist=True).wait("persistent", 60)
        res = c.verify_job("j")
        assert res.mismatches == 0 and {(x.step, x.tier) for x in res.copies} >= {(1, "local"), (2, "persistent")}
        # corrupt the local copy of step 2: verify finds it
        f = next((d.local_dir / "jobs" / "j").glob("*2/rank-*/model.*"))
        f.write_bytes(b"q" * 100)
        res = c.verify_job("j", step=2)
        bad = [x for x in res.copies if x.state != "ok"]
        assert [(x.tier, x.state) for x in bad] == [("local", "mismatch")]
        # damage the chunk of step 2 in the store (the content layout): verify finds it too
        chunks = sorted(p for p in (store / "j" / "content").rglob("*") if p.is_file())
        assert len(chunks) == 2  # steps 1 (its re-save) and 2
        step2 = [p for p in chunks if p.name.endswith("-100.zstd")]
        saved = step2[0].read_bytes()
        step2[0].write_bytes(saved[:-1])
        res = c.verify_job("j", step=2)
        assert sorted((x.tier, x.state) for x in res.copies if x.state != "ok") == \
            [("local", "mismatch"), ("persistent", "mismatch")], res.copies
        step2[0].write_bytes(saved)
        # persist a step that was not selected
        _save(c, "j", 3)
        queued, done = c.persist_step("j", 3, wait=True, timeout=60)
        assert queued == [0] and done == [0]
        assert (store / "j" / "manifests" / f"{3:020d}").is_dir()
        # rm: every tier
        r = c.delete_step("j", 2)
        assert (r.local, r.persistent) == (1, 1)
        assert 2 not in [i.step for i in c.list("j")]
        assert os.listdir(store / "j" / "manifests" / f"{2:020d}") == ["deleted.json"]  # only its tombstone
        assert not step2[0].exists()  # its chunk, named by no other step, is collected
        r = c.delete_step("j", 3, tiers=["local"])
        assert (r.local, r.persistent) == (1, 0)
        assert [t for i in c.list("j") if i.step == 3 for t in i.tiers] == ["persistent"]
        with pytest.raises(tierckpt.InvalidArgumentError, match="tier"):
            c.delete_step("j", 3, tiers=["disk"])


def test_rm_and_verify_reach_peers(daemon_factory) -> None:
    cl = Cluster(daemon_factory, 2, replicas=1)
    with cl.d["n0"].client() as c0, cl.d["n1"].client() as c1:
        c0.save("p", 5, 0, 2, {"m": b"a" * 64}).wait("peer", timeout=60)
        c1.save("p", 5, 1, 2, {"m": b"b" * 64}).wait("peer", timeout=60)
        res = c0.verify_job("p", step=5)
        assert res.mismatches == 0
        assert {(x.rank, x.tier, x.node) for x in res.copies} == {
            (0, "local", "n0"), (1, "local", "n0"), (0, "peer", "n1"), (1, "peer", "n1")}
        r = c0.delete_step("p", 5)
        assert (r.local, r.peer) == (2, 2) and not r.unreachable
        assert c1.list("p") == [] and c0.list("p") == []


def test_policy_files_survive_and_bad_ones_are_ignored(tmp_path: Path) -> None:
    from tierckptd.local.localfs import LocalDir
    from tierckptd.local.policies import JobPolicies
    from tierckptd.local.policies import JobPolicy as DaemonPolicy

    fs = LocalDir(tmp_path)
    fs.open()
    pols = JobPolicies(DaemonPolicy(2, 0, 0))
    pols.load(fs)
    pols.update("a", DaemonPolicy(keep_local=4))
    pols.update("a", DaemonPolicy(persist_every=10))
    (tmp_path / "policies" / "bad.json").write_text("{not json")
    (tmp_path / "policies" / "worse.json").write_text('{"keep_local": 0}')
    again = JobPolicies(DaemonPolicy(2, 0, 0))
    again.load(fs)
    assert again.get("a") == DaemonPolicy(keep_local=4, persist_every=10)
    assert again.effective("bad") == DaemonPolicy(2, 0, 0) and again.keep_local("worse") == 2
    again.update("a", DaemonPolicy(), reset=True)
    assert not (tmp_path / "policies" / "a.json").exists() and again.get("a") == DaemonPolicy()
    with pytest.raises(tierckpt.InvalidArgumentError, match=r"policy\.keep_local"):
        again.update("a", DaemonPolicy(keep_local=0))
    fs.close()


def test_bad_requests_name_the_field_and_change_nothing(daemon_factory) -> None:
    import grpc
    from tierckpt.v1 import tierckpt_pb2 as pb
    from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

    d = daemon_factory()
    with d.client() as c:
        _save(c, "k", 1)
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.TierckptStub(ch)
        for call, req, field in [
            (stub.DeleteStep, pb.DeleteStepRequest(job="../k", step=1), "job"),
            (stub.DeleteStep, pb.DeleteStepRequest(job="k", step=1, tiers=pb.TierSelection(tiers=[9])), "tiers"),
            (stub.SetJobPolicy, pb.SetJobPolicyRequest(job="k", policy=pb.JobPolicy(keep_local=0)), "keep_local"),
            (stub.PersistStep, pb.PersistStepRequest(job="k", step=1, timeout_seconds=-1), "timeout_seconds"),
            (stub.Verify, pb.VerifyRequest(job=""), "job"),
        ]:
            with pytest.raises(grpc.RpcError) as ei:
                call(req, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()
    with d.client() as c:
        assert [i.step for i in c.list("k")] == [1]
        assert c.get_job_policy("k")[0] == JobPolicy()
