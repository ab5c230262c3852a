"""Helpers of the peer-side security tests: a two-node mTLS cluster with node and client
certificates from ``tierckpt certs``, Peer stubs and raw bulk requests under any certificate."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckptd.peer import bulk
from tierckptd.testing import free_port

from ..certs import issue, issue_client, make_pki, tls_args
from ..harness import wait_until

Files = dict[str, Path]


def pki_with_roles(root: Path) -> dict[str, Files]:
    """Node certificates n0, n1 (members) and n9 (not a member); client certificates trainer-a and
    one named like a node, "n0" (keyed "client-n0")."""
    pki = make_pki(root, ["n0", "n1"])
    pki["n9"] = issue(root, "n9")
    pki["trainer-a"] = issue_client(root, "trainer-a")
    pki["client-n0"] = issue_client(root, "n0")
    return pki


def cluster(daemon_factory: Any, pki: dict[str, Files], *extra: str) -> dict[str, Any]:
    """n0 and n1, replicas=1, mTLS, each seeing the other up."""
    ports = {n: free_port() for n in ("n0", "n1")}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    d = {n: daemon_factory(n, port=ports[n], args=("--peers", peers, "--replicas", "1", "--knobs",
                                                  "refresh_interval=0.2", *tls_args(pki[n]), *extra))
         for n in ports}
    for n, other in (("n0", "n1"), ("n1", "n0")):
        with d[n].client() as c:
            wait_until(lambda c=c, other=other: any(p.node_id == other and p.up for p in c.status().peers),
                       what=f"{n} sees {other}")
    return d


def peer_stub(daemon: Any, files: Files) -> tuple[grpc.Channel, ppb_grpc.PeerStub]:
    creds = grpc.ssl_channel_credentials(files["ca"].read_bytes(), files["key"].read_bytes(),
                                         files["cert"].read_bytes())
    ch = grpc.secure_channel(daemon.tcp_address, creds, options=[("grpc.ssl_target_name_override", "localhost")])
    return ch, ppb_grpc.PeerStub(ch)


def code(fn: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value.code()


def every_peer_call(stub: ppb_grpc.PeerStub, caller: str, manifest_json: str) -> dict[str, Any]:
    """One call of every Peer RPC, naming ``caller``: {name: zero-argument callable}."""
    return {
        "Hello": lambda: stub.Hello(ppb.HelloRequest(node_id=caller), timeout=10),
        "Catalog": lambda: stub.Catalog(ppb.CatalogRequest(node_id=caller), timeout=10),
        "PrepareReplica": lambda: stub.PrepareReplica(ppb.PrepareReplicaRequest(
            sender=caller, manifest_json=manifest_json), timeout=10),
        "CommitReplica": lambda: stub.CommitReplica(ppb.CommitReplicaRequest(ticket="t", sender=caller), timeout=10),
        "AbortReplica": lambda: stub.AbortReplica(ppb.AbortReplicaRequest(ticket="t", sender=caller), timeout=10),
        "OpenRead": lambda: stub.OpenRead(ppb.OpenReadRequest(requester=caller, job="victim", step=1, rank=0),
                                          timeout=10),
        "DropReplicas": lambda: stub.DropReplicas(ppb.DropReplicasRequest(
            owner=caller, requester=caller, job="victim", step=1, ranks=[0]), timeout=10),
        "DeleteStepCopies": lambda: stub.DeleteStepCopies(ppb.DeleteStepCopiesRequest(
            requester=caller, job="victim", step=1), timeout=10),
        "VerifyCopies": lambda: stub.VerifyCopies(ppb.VerifyCopiesRequest(requester=caller, job="victim"),
                                                  timeout=10),
        "WarmReplica": lambda: stub.WarmReplica(ppb.WarmReplicaRequest(sender=caller, job="victim", rank=0,
                                                                       sizes=[4]), timeout=10),
    }


def bulk_connect(port: int, files: Files | None) -> socket.socket:
    """A bulk connection to 127.0.0.1:``port`` presenting ``files``' certificate (None: plain TCP)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    if files is None:
        return raw
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(files["ca"]))
    ctx.load_cert_chain(str(files["cert"]), str(files["key"]))
    return ctx.wrap_socket(raw, server_hostname="localhost")


def bulk_get(sock: socket.socket, ticket: str, shard: str, size: int) -> tuple[dict, bytes]:
    """One whole-shard "get" on an open bulk connection: (reply, bytes received)."""
    bulk.send_msg(sock, {"v": bulk.VERSION, "op": "get", "ticket": ticket, "shard": shard, "offset": 0,
                         "chunk": max(size, 1), "stride": max(size, 1)})
    reply = bulk.recv_msg(sock) or {}
    data = b""
    if reply.get("ok"):
        while len(data) < reply["length"]:
            chunk = sock.recv(reply["length"] - len(data))
            if not chunk:
                break
            data += chunk
    return reply, data


def bulk_first_reply(port: int, files: Files | None) -> dict:
    """What the bulk port says first to a new connection under ``files``' certificate, before any
    request: a refusal is sent at once after the handshake ({} if it hung up)."""
    try:
        with bulk_connect(port, files) as sock:
            sock.settimeout(10)
            return bulk.recv_msg(sock, eof_ok=True) or {}
    except (ssl.SSLError, ConnectionError):
        return {}
