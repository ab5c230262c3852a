"""Peer tier, unchanged shards (issue 13 items 1-2): a replica's shard that the receiver already
holds byte-identically is linked there and not sent again. Two real daemons on loopback."""

from __future__ import annotations

import json
import os

import grpc
import numpy as np
import tierckpt
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from .harness import Cluster
from .metrics_scrape import scrape as metrics

MIB = 1 << 20


def _rand(seed: int, n: int = MIB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=n, dtype=np.uint8)


def _replica(d, job: str, step: int, shard: str):
    (p,) = d.local_dir.glob(f"jobs/{job}/{step:020d}/rank-0000000/{shard}.*")
    return os.stat(p)


def test_replica_of_an_unchanged_shard_links_the_previous_replica(daemon_factory):
    cl = Cluster(daemon_factory, 2, replicas=1, extra=("--keep-local", "5"), metrics=True)
    owner, peer = cl.d["n0"], cl.d["n1"]
    frozen, w1, w2 = _rand(1), _rand(2, 200_000), _rand(3, 200_000)
    with owner.client() as c:
        assert c.save("job", 1, 0, 1, {"frozen": frozen, "w": w1}).wait("peer", timeout=60) == ["n1"]
        fut = c.save("job", 2, 0, 1, {"frozen": frozen, "w": w2}, unchanged=["frozen"])
        assert fut.wait("peer", timeout=60) == ["n1"]
        assert fut.result().shared_bytes == frozen.nbytes
        on_peer = metrics(peer.info["metrics_port"])
        assert on_peer['tierckpt_shared_bytes_total{tier="peer"}'] == frozen.nbytes  # linked, not received
        # Nothing changed at all: nothing travels on the bulk channel, the replica still commits.
        fut = c.save("job", 3, 0, 1, {"frozen": frozen, "w": w2}, unchanged=["frozen", "w"])
        assert fut.wait("peer", timeout=60) == ["n1"]
    on_peer = metrics(peer.info["metrics_port"])
    assert on_peer['tierckpt_shared_bytes_total{tier="peer"}'] == 2 * frozen.nbytes + w2.nbytes
    assert metrics(owner.info["metrics_port"])['tierckpt_saved_bytes_total{tier="peer"}'] == (
        3 * frozen.nbytes + w1.nbytes + 2 * w2.nbytes)
    assert _replica(peer, "job", 3, "w").st_ino == _replica(peer, "job", 2, "w").st_ino
    r1, r2 = _replica(peer, "job", 1, "frozen"), _replica(peer, "job", 2, "frozen")
    assert (r1.st_ino, r2.st_nlink) == (r2.st_ino, 3)  # steps 1, 2 and 3 name one inode
    assert _replica(peer, "job", 1, "w").st_ino != _replica(peer, "job", 2, "w").st_ino
    # The replica restores byte-exact once the owner loses its copy.
    owner.kill()
    owner.wipe()
    with tierckpt.Client(peer.tcp_address, transfer="stream") as c:
        ck = c.restore("job", 0, 2)
        assert np.array_equal(np.asarray(ck.shards["frozen"]), frozen)
        assert np.array_equal(np.asarray(ck.shards["w"]), w2)


def test_a_changed_shard_under_the_same_name_is_sent(daemon_factory):
    cl = Cluster(daemon_factory, 2, replicas=1, extra=("--keep-local", "5"), metrics=True)
    owner, peer = cl.d["n0"], cl.d["n1"]
    with owner.client() as c:
        c.save("job", 1, 0, 1, {"a": _rand(1)}).wait("peer", timeout=60)
        c.save("job", 2, 0, 1, {"a": _rand(2)}).wait("peer", timeout=60)  # same name, size, dtype: other bytes
    assert metrics(peer.info["metrics_port"])['tierckpt_shared_bytes_total{tier="peer"}'] == 0
    assert _replica(peer, "job", 2, "a").st_nlink == 1
    with tierckpt.Client(peer.tcp_address, transfer="stream") as c:
        assert np.array_equal(np.asarray(c.restore("job", 0, 2).shards["a"]), _rand(2))


def test_a_sender_that_does_not_skip_linked_shards_gets_none_linked(daemon_factory):
    """Rolling upgrades: an older owner sends every shard, so the receiver links only for a
    sender that says it leaves the linked ones out."""
    cl = Cluster(daemon_factory, 2, replicas=1, extra=("--keep-local", "5"))
    owner, peer = cl.d["n0"], cl.d["n1"]
    with owner.client() as c:
        c.save("job", 1, 0, 1, {"a": _rand(1), "b": _rand(2, 5000)}).wait("peer", timeout=60)
    (path,) = owner.local_dir.glob("jobs/job/*/rank-0000000/manifest.json")
    man = json.loads(path.read_text())
    man.update(step=2, generation="0123456789abcdef")  # the same bytes as a new step
    with grpc.insecure_channel(peer.tcp_address) as ch:
        stub = ppb_grpc.PeerStub(ch)
        for skips, linked in ((False, []), (True, ["a", "b"])):
            prep = stub.PrepareReplica(ppb.PrepareReplicaRequest(sender="n0", manifest_json=json.dumps(man),
                                                                 skips_linked=skips))
            assert sorted(prep.linked) == linked and prep.ticket
            stub.AbortReplica(ppb.AbortReplicaRequest(ticket=prep.ticket, sender="n0"))
    assert os.stat(next(peer.local_dir.glob("jobs/job/*/rank-0000000/a.*"))).st_nlink == 1
