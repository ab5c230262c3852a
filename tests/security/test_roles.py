"""Certificate roles against real mTLS daemons: node and client certificates are distinct
(``tierckpt certs node`` / ``certs client``). The Peer service and the bulk channel serve only
node certificates of current cluster members, for the node id the certificate names; every Peer
call names its caller. A client certificate (even one named like a node), a node certificate of
a non-member, and a call that names no caller get PERMISSION_DENIED; nothing on disk changes."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.v1 import peer_pb2 as ppb
from tierckptd.local.manifest import Manifest, ShardEntry

from ._peers import bulk_first_reply, bulk_get, cluster, code, every_peer_call, peer_stub, pki_with_roles
from ._util import snapshot


@pytest.fixture
def pki(tmp_path: Path):
    return pki_with_roles(tmp_path)


@pytest.fixture
def nodes(daemon_factory, pki):
    d = cluster(daemon_factory, pki)
    with d["n0"].client() as c:
        c.save("victim", 1, 0, 1, {"w": b"secret"}).wait("peer", timeout=60)
    return d


def _manifest(owner: str) -> str:
    return Manifest(job="victim", step=9, rank=0, world_size=1, node=owner, generation="g9",
                    shards=(ShardEntry("w", 4, "0" * 16),)).to_json().decode()


def test_certs_issues_distinct_node_and_client_certificates(pki) -> None:
    from cryptography import x509

    def uris(files) -> list[str]:
        cert = x509.load_pem_x509_certificate(files["cert"].read_bytes())
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)

    def usages(files) -> set[str]:
        cert = x509.load_pem_x509_certificate(files["cert"].read_bytes())
        return {u._name for u in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value}

    assert uris(pki["n0"]) == ["tierckpt://node/n0"] and usages(pki["n0"]) == {"serverAuth", "clientAuth"}
    assert uris(pki["trainer-a"]) == ["tierckpt://client/trainer-a"] and usages(pki["trainer-a"]) == {"clientAuth"}
    assert pki["trainer-a"]["key"].stat().st_mode & 0o777 == 0o600


def test_certs_client_on_the_command_line(tmp_path: Path) -> None:
    import io

    from tierckpt.certs import main

    assert main(["certs", "ca", "--out", str(tmp_path / "ca")], io.StringIO()) == 0
    out = io.StringIO()
    assert main(["certs", "client", "--ca", str(tmp_path / "ca"), "--name", "ops", "--out", str(tmp_path / "ops")],
                out) == 0
    assert f'tls_cert = "{tmp_path / "ops" / "client.pem"}"' in out.getvalue()
    assert (tmp_path / "ops" / "client.key").stat().st_mode & 0o777 == 0o600
    assert main(["certs", "client", "--ca", str(tmp_path / "ca"), "--name", "a b", "--out",
                 str(tmp_path / "bad")], io.StringIO()) == 2  # a bad name: one line naming the field
    assert main(["certs", "client", "--ca", str(tmp_path / "ca"), "--name", "ops", "--out", str(tmp_path / "ops")],
                io.StringIO()) == 1  # an existing key is never replaced without --force


@pytest.mark.parametrize("who", ["trainer-a", "client-n0", "n9"])
def test_only_member_node_certificates_reach_the_peer_service(nodes, pki, who) -> None:
    """A client certificate (whatever node id it claims, even one named n0) and a CA-signed node
    certificate of a non-member are refused on every Peer RPC (Hello, which discovery sends to
    unknown nodes, is refused to clients only)."""
    n1 = nodes["n1"]
    before = snapshot(n1.local_dir)
    claim = "n9" if who == "n9" else "n0"
    ch, stub = peer_stub(n1, pki[who])
    with ch:
        for name, call in every_peer_call(stub, claim, _manifest(claim)).items():
            if who == "n9" and name == "Hello":
                assert call().node_id == "n1"
                continue
            assert code(call) == grpc.StatusCode.PERMISSION_DENIED, name
    assert snapshot(n1.local_dir) == before
    with nodes["n0"].client() as c:
        assert bytes(c.restore("victim", 0).shards["w"]) == b"secret"


def test_every_peer_call_names_its_caller(nodes, pki) -> None:
    ch, stub = peer_stub(nodes["n1"], pki["n0"])
    with ch:
        assert code(stub.Catalog, ppb.CatalogRequest(), timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        assert code(stub.DropReplicas, ppb.DropReplicasRequest(owner="n0", job="victim", step=1, ranks=[0]),
                    timeout=10) == grpc.StatusCode.PERMISSION_DENIED
        # n0's own node certificate, naming itself: served (the victim's rank is listed).
        entries = stub.Catalog(ppb.CatalogRequest(node_id="n0"), timeout=10).entries
        assert [(e.job, e.step, e.owner) for e in entries] == [("victim", 1, "n0")]
        # ... but it cannot claim to be another member.
        assert code(stub.Catalog, ppb.CatalogRequest(node_id="n1"), timeout=10) == grpc.StatusCode.PERMISSION_DENIED


def test_only_member_node_certificates_reach_the_bulk_channel(nodes, pki) -> None:
    """A real read ticket, issued to n0, is useless to a client certificate or a non-member: the
    bulk port refuses them right after the handshake; n0 itself reads the bytes."""
    ch, stub = peer_stub(nodes["n1"], pki["n0"])
    with ch:
        resp = stub.OpenRead(ppb.OpenReadRequest(requester="n0", job="victim", step=1, rank=0), timeout=10)
    for who in ("trainer-a", "client-n0", "n9"):
        reply = bulk_first_reply(resp.bulk_port, pki[who])
        assert reply.get("code") == "PERMISSION_DENIED", (who, reply)
    from ._peers import bulk_connect

    with bulk_connect(resp.bulk_port, pki["n0"]) as sock:
        reply, data = bulk_get(sock, resp.ticket, "w", 6)
    assert reply.get("ok") and data == b"secret"


def test_a_client_certificate_still_uses_the_tierckpt_service(nodes, pki) -> None:
    f = pki["trainer-a"]
    with tierckpt.Client(nodes["n0"].tcp_address, tls_cert=str(f["cert"]), tls_key=str(f["key"]),
                         tls_ca=str(f["ca"]), tls_server_name="localhost", transfer="stream") as c:
        assert bytes(c.restore("victim", 0).shards["w"]) == b"secret"


def test_one_shared_node_certificate_without_id_binding(daemon_factory, tmp_path: Path) -> None:
    """The Kubernetes layout: every daemon serves one node certificate (tierckpt://node/shared)
    and tls_bind_node_id = false. Replication works; a client certificate is still no peer."""
    from tierckptd.testing import free_port

    from ..certs import issue, issue_client, make_pki, tls_args

    make_pki(tmp_path, [])  # the CA only
    shared, client = issue(tmp_path, "shared"), issue_client(tmp_path, "trainer-a")
    ports = {n: free_port() for n in ("n0", "n1")}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    d = {n: daemon_factory(n, port=ports[n], args=("--peers", peers, "--replicas", "1", "--no-tls-bind-node-id",
                                                  *tls_args(shared))) for n in ports}
    with d["n0"].client() as c:
        assert c.save("j", 1, 0, 1, {"w": b"x" * 1000}).wait("peer", timeout=60) == ["n1"]
    ch, stub = peer_stub(d["n1"], client)
    with ch:
        assert code(stub.Catalog, ppb.CatalogRequest(node_id="n0"), timeout=10) == grpc.StatusCode.PERMISSION_DENIED
    ch, stub = peer_stub(d["n1"], shared)
    with ch:
        port = stub.Hello(ppb.HelloRequest(node_id="n0"), timeout=10).bulk_port
    assert bulk_first_reply(port, client).get("code") == "PERMISSION_DENIED"
