"""Revocation that bites, against a real mTLS daemon: a deny-list of certificate names takes
effect without a restart on new and open connections (gRPC calls on an open channel, a held bulk
connection), and a CA change closes the connections opened under the old CA (bulk: at once;
gRPC: by the maximum connection age)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckptd.testing import free_port

from ..certs import install, issue_client, make_pki, tls_args
from ..harness import wait_until
from ._peers import bulk_connect, bulk_first_reply, peer_stub


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _closed(sock: socket.socket) -> bool:
    """Whether the daemon closed a held connection (EOF or reset) within a short look."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True


def _node(daemon_factory, files: dict[str, Path], *extra: str):
    """n0, with n1 a member of its cluster (configured, not running): the tests call as n1."""
    port = free_port()
    return daemon_factory("n0", port=port, args=("--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}",
                                                 "--replicas", "0", *tls_args(files), *extra))


def _catalog(stub: ppb_grpc.PeerStub) -> ppb.CatalogResponse:
    return stub.Catalog(ppb.CatalogRequest(node_id="n1"), timeout=5)


def test_a_deny_list_bites_without_a_restart(daemon_factory, tmp_path: Path) -> None:
    pki = make_pki(tmp_path, ["n0", "n1"])
    pki["trainer-a"] = issue_client(tmp_path, "trainer-a")
    deny = tmp_path / "deny.txt"
    deny.write_text("# nobody yet\n")
    d = _node(daemon_factory, pki["n0"], "--tls-deny", str(deny))
    f = pki["trainer-a"]
    client = tierckpt.Client(d.tcp_address, tls_cert=str(f["cert"]), tls_key=str(f["key"]), tls_ca=str(f["ca"]),
                             tls_server_name="localhost", transfer="stream")
    ch, stub = peer_stub(d, pki["n1"])
    with client, ch:
        assert client.status().node_id == "n0" and _catalog(stub).node_id == "n0"
        port = stub.Hello(ppb.HelloRequest(node_id="n1"), timeout=5).bulk_port
        held = bulk_connect(port, pki["n1"])  # authenticated, waiting for a request
        assert not _closed(held)

        _write(deny, "trainer-a\nn1  # a compromised node\n")
        # The same channels, no reconnect: refused from the next call on.
        wait_until(lambda: _raises(client.status, tierckpt.PermissionDeniedError), timeout=10, what="client denied")
        with pytest.raises(grpc.RpcError) as e:
            _catalog(stub)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "tls_deny" in e.value.details()
        wait_until(lambda: _closed(held), timeout=10, what="held bulk connection closed")
        held.close()
        assert bulk_first_reply(port, pki["n1"]).get("code") == "PERMISSION_DENIED"

        _write(deny, "")  # lifted, again without a restart
        wait_until(lambda: not _raises(client.status, tierckpt.PermissionDeniedError), timeout=10,
                   what="client allowed again")
        assert _catalog(stub).node_id == "n0"
    assert "tls_deny" in d.log_text()


def _raises(fn, exc: type[BaseException]) -> bool:
    try:
        fn()
    except exc:
        return True
    return False




def test_a_ca_change_closes_connections_opened_before_it(daemon_factory, tmp_path: Path) -> None:
    old = make_pki(tmp_path / "old", ["n0", "n1"], ca_name="old CA")
    new = make_pki(tmp_path / "new", ["n0", "n1"], ca_name="new CA")
    live = tmp_path / "live"
    live.mkdir()
    install(old["n0"], live)
    files = {"cert": live / "cert.pem", "key": live / "key.pem", "ca": live / "ca.pem"}
    d = _node(daemon_factory, files, "--knobs", "max_connection_age=2,max_connection_age_grace=1")
    both = tmp_path / "both.pem"  # the caller trusts either CA: only the daemon's CA decides
    both.write_bytes(old["n0"]["ca"].read_bytes() + new["n0"]["ca"].read_bytes())
    caller = {**old["n1"], "ca": both}
    ch, stub = peer_stub(d, caller)
    with ch:
        assert _catalog(stub).node_id == "n0"
        port = stub.Hello(ppb.HelloRequest(node_id="n1"), timeout=5).bulk_port
        held = bulk_connect(port, caller)
        assert not _closed(held)
        t0 = time.monotonic()
        install(new["n0"], live)  # the old CA no longer signs anything this daemon accepts
        wait_until(lambda: _closed(held), timeout=10, what="bulk connection of the old CA closed")
        held.close()
        wait_until(lambda: _raises(lambda: _catalog(stub), grpc.RpcError), timeout=20,
                   what="gRPC connection of the old CA closed by its maximum age")
        assert time.monotonic() - t0 < 20
    ch, stub = peer_stub(d, {**new["n1"], "ca": both})
    with ch:
        assert _catalog(stub).node_id == "n0"  # a certificate of the new CA is served
