"""Forged peers against a real mTLS daemon: the Peer service believes a node id only when the
caller's certificate names it, stores copies only that placement assigns to it, honours drops
only from the owner, and is not served on the Unix socket. Nothing on disk changes on a refusal."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckptd.local.manifest import Manifest, ShardEntry
from tierckptd.testing import free_port

from ..certs import make_pki, tls_args
from ..harness import wait_until
from ._util import snapshot

NODES = ["n0", "n1", "n2", "n3", "n4"]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, dict[str, Path]]:
    return make_pki(tmp_path, [*NODES, "intruder"])


@pytest.fixture
def n1(daemon_factory, pki):
    """n1 of a five-node ring with n3 and n4 running too (n0 and n2 are not), replicas=1, mTLS."""
    ports = {n: free_port() for n in NODES}
    peers = ",".join(f"{n}=127.0.0.1:{ports[n]}" for n in NODES)
    started = {}
    for n in ("n1", "n3", "n4"):
        started[n] = daemon_factory(n, port=ports[n], args=(
            "--peers", peers, "--replicas", "1", "--knobs", "refresh_interval=0.2", *tls_args(pki[n])))
    with started["n1"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} >= {"n3", "n4"}, what="n1 sees n3, n4")
    return started["n1"]


def _stub(daemon, files: dict[str, Path]) -> tuple[grpc.Channel, ppb_grpc.PeerStub]:
    creds = grpc.ssl_channel_credentials(files["ca"].read_bytes(), files["key"].read_bytes(),
                                         files["cert"].read_bytes())
    ch = grpc.secure_channel(daemon.tcp_address, creds, options=[("grpc.ssl_target_name_override", "localhost")])
    return ch, ppb_grpc.PeerStub(ch)


def _manifest(owner: str) -> str:
    man = Manifest(job="j", step=7, rank=0, world_size=1, node=owner, generation="g1",
                   shards=(ShardEntry("w", 4, "0" * 16),))
    return man.to_json().decode()


def _code(fn, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value.code()


def test_forged_peers_are_refused_and_nothing_changes(n1, pki):
    before = snapshot(n1.local_dir)
    ch, stub = _stub(n1, pki["intruder"])
    with ch:
        # A certificate that names another node than the one claimed.
        assert _code(stub.PrepareReplica, ppb.PrepareReplicaRequest(sender="n0", manifest_json=_manifest("n0")),
                     timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(stub.OpenRead, ppb.OpenReadRequest(requester="n0", job="j", step=7, rank=0),
                     timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(stub.Catalog, ppb.CatalogRequest(node_id="n0"), timeout=10) == grpc.StatusCode.PERMISSION_DENIED
    ch, stub = _stub(n1, pki["n2"])
    with ch:
        # n2's own certificate, but n1 is not in n2's placement (R + 1 = 2 live nodes after n2: n3, n4).
        assert _code(stub.PrepareReplica, ppb.PrepareReplicaRequest(sender="n2", manifest_json=_manifest("n2")),
                     timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        # A copy that names the receiver itself as the owner.
        assert _code(stub.PrepareReplica, ppb.PrepareReplicaRequest(sender="n2", manifest_json=_manifest("n1")),
                     timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        # Dropping n0's replicas while n0 is not gone for the grace period, as n2.
        assert _code(stub.DropReplicas, ppb.DropReplicasRequest(owner="n0", job="j", step=7, ranks=[0], requester="n2"),
                     timeout=10) == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(n1.local_dir) == before
    ch, stub = _stub(n1, pki["n0"])
    with ch:  # the real predecessor may push its own rank: a ticket is issued
        resp = stub.PrepareReplica(ppb.PrepareReplicaRequest(sender="n0", manifest_json=_manifest("n0")), timeout=10)
        assert resp.ticket and resp.bulk_port
        stub.AbortReplica(ppb.AbortReplicaRequest(ticket=resp.ticket, sender="n0"), timeout=10)


def test_the_peer_service_is_not_served_on_the_unix_socket(n1):
    with grpc.insecure_channel(n1.address) as ch:
        stub = ppb_grpc.PeerStub(ch)
        assert _code(stub.Hello, ppb.HelloRequest(node_id="n0"), timeout=10) == grpc.StatusCode.UNIMPLEMENTED
        assert _code(stub.DropReplicas, ppb.DropReplicasRequest(owner="n0", job="j", step=1, ranks=[0]),
                     timeout=10) == grpc.StatusCode.UNIMPLEMENTED
