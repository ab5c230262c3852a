"""Redundancy per job (issue 32 item 1): a job policy ``redundancy = "parity:K+M"`` on a cluster of
replicas daemons (and the default replicas for the other jobs), with real daemons on loopback. The
restorer of a wiped node does not know the job's policy: the protectors say which K+M they hold."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import tierckpt
from tierckpt import cli
from tierckpt.common import checksum as _checksum
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.config import ConfigError, parse_job_redundancy
from tierckptd.local.policies import JobPolicies, JobPolicy

from ..harness import Cluster, wait_until


def shard(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def test_job_redundancy_is_parsed_and_checked_naming_the_field():
    assert parse_job_redundancy("replicas:0") == (0, None)
    assert parse_job_redundancy("replicas:2") == (2, None)
    assert parse_job_redundancy("parity:4+1") == (0, (4, 1))
    assert parse_job_redundancy("parity:4+2") == (0, (4, 2))
    for bad in ("replicas", "replicas:-1", "parity:0+1", "parity:30+3", "raid5", "parity:4", ""):
        with pytest.raises(ConfigError, match="^redundancy: "):
            parse_job_redundancy(bad)
    pols = JobPolicies(JobPolicy(1, 0, 0, "replicas:1"))
    for bad in ("parity:4", 3, "replicas:99"):
        with pytest.raises(tierckpt.InvalidArgumentError, match=r"^policy\.redundancy: "):
            pols.update("j", JobPolicy(redundancy=bad))  # type: ignore[arg-type]
    assert pols.update("j", JobPolicy(redundancy="parity:2+1")).redundancy == "parity:2+1"
    assert pols.redundancy("j") == (0, (2, 1)) and pols.redundancy("other") is None


def _parity_bytes(d, shape: str = "4+1") -> int:
    return sum(p.stat().st_size for p in (d.local_dir / f"parity-{shape}" / "parity").rglob("slot-*.bin"))


def _rank_files(d, job: str) -> set[str]:
    return {p.name for p in (d.local_dir / "jobs" / job).rglob("rank-*") if p.is_dir()}


def _save(cl: Cluster, job: str, step: int, sizes: list[int]) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Rank r on node n{r}, all at once; wait('peer') on each. Returns checksums and peer holders."""
    sums, holders, clients, futs = {}, {}, [], []
    try:
        for rank, node in enumerate(cl.ids):
            c = cl.d[node].client()
            clients.append(c)
            a = shard(step * 100 + rank, sizes[rank])
            sums[rank] = _checksum.digest(a)
            futs.append((rank, c.save(job, step, rank, len(cl.ids), {"a": a}, metadata={"rank": rank})))
        for rank, fut in futs:
            holders[rank] = sorted(fut.wait("peer", timeout=120))
    finally:
        for c in clients:
            c.close()
    return sums, holders


def test_parity_job_and_replicas_job_on_one_cluster_survive_a_lost_node(daemon_factory):
    cl = Cluster(daemon_factory, 5, replicas=1)
    sizes = [300_000 + 7_919 * r for r in range(5)]
    # bad values: the client, the daemon (raw gRPC) and the CLI each refuse naming the field
    with cl.d["n0"].client() as c:
        with pytest.raises(tierckpt.InvalidArgumentError, match=r"policy\.redundancy"):
            c.set_job_policy("a", redundancy="raid5")
        for bad in ("parity:4+2", "replicas:2"):  # a group of 6 on 5 nodes; more copies than the daemons' R
            with pytest.raises(tierckpt.InvalidArgumentError, match=r"policy\.redundancy"):
                c.set_job_policy("a", redundancy=bad)
    with grpc.insecure_channel(cl.d["n0"].address) as ch:
        stub = pb_grpc.TierckptStub(ch)
        for bad in ("replicas", "parity:0+1", "parity:9+1"):
            with pytest.raises(grpc.RpcError) as ei:
                stub.SetJobPolicy(pb.SetJobPolicyRequest(job="a", policy=pb.JobPolicy(redundancy=bad)), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "policy.redundancy" in ei.value.details()
    err = io.StringIO()
    assert cli.main(["--address", cl.d["n0"].address, "policy", "a", "--redundancy", "parity:9+1"],
                    out=io.StringIO(), err=err) != 0
    assert "policy.redundancy" in err.getvalue() and err.getvalue().count("\n") == 1
    out = io.StringIO()
    assert cli.main(["--address", cl.d["n0"].address, "policy", "x", "--redundancy", "replicas:0"], out=out,
                    err=io.StringIO()) == 0
    assert "redundancy" in out.getvalue() and "replicas:0" in out.getvalue()
    # job "a" chooses parity:4+1 on every node (each rank's client sets it on its daemon); "b" keeps replicas:1
    for n in cl.ids:
        with cl.d[n].client() as c:
            over, eff = c.set_job_policy("a", redundancy="parity:4+1")
            assert over.redundancy == eff.redundancy == "parity:4+1"
            assert c.get_job_policy("b")[1].redundancy == "replicas:1"
    sums_a, holders_a = _save(cl, "a", 3, sizes)
    sums_b, holders_b = _save(cl, "b", 3, sizes)
    for rank, n in enumerate(cl.ids):
        assert holders_a[rank] == sorted(set(cl.ids) - {n})  # its four protectors
        assert len(holders_b[rank]) == 1 and n not in holders_b[rank]  # one full copy
    # memory: "a" is its own rank plus ~1/4 of parity per node, no full copies; "b" two ranks per node
    for i, n in enumerate(cl.ids):
        d = cl.d[n]
        assert _rank_files(d, "a") == {f"rank-{i:07d}"}, n
        assert len(_rank_files(d, "b")) == 2, n
        parity = _parity_bytes(d)
        assert 0 < parity <= -(-max(sizes) // 4) + 8, (n, parity)
        assert not (d.local_dir / "parity").exists() or not any((d.local_dir / "parity").rglob("slot-*.bin"))
    victim = "n2"
    cl.replace(victim)  # kill -9 and wipe: the new daemon knows no policy of "a"
    cl.wait_peers(victim)
    with cl.d[victim].client() as c:
        assert c.get_job_policy("a")[0] == tierckpt.JobPolicy()
        assert c.latest("a") == 3 and c.latest("b") == 3
        for job, sums in (("a", sums_a), ("b", sums_b)):
            ck = c.restore(job, 2)
            assert ck.step == 3 and ck.tier == "peer", job
            assert _checksum.digest(np.asarray(ck.shards["a"])) == sums[2], job
            assert ck.metadata == {"rank": 2}
        for rank in (0, 4):  # the others' ranks too, from their owners
            for job, sums in (("a", sums_a), ("b", sums_b)):
                ck = c.restore(job, rank)
                assert _checksum.digest(np.asarray(ck.shards["a"])) == sums[rank], (job, rank)
    assert "reconstructed a step 3 rank 2 from parity" in cl.d[victim].log_text()
    # the wiped node's lost parity of "a" is rebuilt by the owners' catch-up (its instance changed)
    wait_until(lambda: _parity_bytes(cl.d[victim]) > 0, timeout=120, what="parity:4+1 re-protected on n2")


def test_replicas_job_on_a_parity_cluster(daemon_factory):
    """The other way round: parity:4+1 daemons, one job choosing replicas:1 (full copies, no parity)."""
    cl = Cluster(daemon_factory, 5, replicas=0, extra=("--redundancy", "parity:4+1"))
    sizes = [200_000 + 4_001 * r for r in range(5)]
    for n in cl.ids:
        with cl.d[n].client() as c:
            assert c.get_job_policy("r")[1].redundancy == "parity:4+1"
            with pytest.raises(tierckpt.InvalidArgumentError, match=r"policy\.redundancy"):
                c.set_job_policy("r", redundancy="replicas:2")  # a peer accepts replicas of at most R=1 here
            c.set_job_policy("r", redundancy="replicas:1")
    sums, holders = _save(cl, "r", 5, sizes)
    for i, n in enumerate(cl.ids):
        assert len(holders[i]) == 1 and n not in holders[i]
        assert len(_rank_files(cl.d[n], "r")) == 2, n  # its own rank and one replica
        assert not any((cl.d[n].local_dir / "parity").rglob("slot-*.bin")), n  # nothing of "r" in parity
    cl.replace("n3")
    cl.wait_peers("n3")
    with cl.d["n3"].client() as c:
        ck = c.restore("r", 3)
        assert ck.tier == "peer" and _checksum.digest(np.asarray(ck.shards["a"])) == sums[3]
