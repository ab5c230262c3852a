"""mTLS for peer traffic: replication and restore over TLS (gRPC and the bulk channel), and a
peer without a certificate signed by the cluster CA is refused on both channels."""

from __future__ import annotations

import json
import socket
import ssl
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from .certs import LOOPBACK, install, make_pki, tls_args
from .harness import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def pki(tmp_path):
    """A cluster CA with node certificates for n0 and n1, and a rogue CA with its own ones."""
    return {label: make_pki(tmp_path / label, ["n0", "n1"], sans=LOOPBACK, ca_name=f"{label} CA")
            for label in ("good", "rogue")}


def _read(p: str | Path) -> bytes:
    return Path(p).read_bytes()


def _hello(port: int, creds: grpc.ChannelCredentials) -> ppb.HelloResponse:
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        return ppb_grpc.PeerStub(ch).Hello(ppb.HelloRequest(node_id="n0"), timeout=5)


def _bulk_probe(port: int, ctx: ssl.SSLContext | None) -> bytes:
    """Send one bulk request; return what the server answers (b"" if it hung up)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw
        body = json.dumps({"v": 1, "op": "get", "ticket": "x", "shard": "a", "offset": 0, "length": 1}).encode()
        sock.sendall(struct.pack(">I", len(body)) + body)
        return sock.recv(100)
    except (ssl.SSLError, ConnectionError):
        return b""
    finally:
        raw.close()


def test_peer_traffic_over_mtls_and_rogue_peers_refused(daemon_factory, pki):
    good = pki["good"]["n0"]
    ports = {n: free_port() for n in ("n0", "n1")}
    base = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "1")
    d = {n: daemon_factory(n, port=ports[n], args=(*base, *tls_args(pki["good"][n]))) for n in ports}
    data = {"w": np.random.default_rng(3).integers(0, 256, 3_000_000, dtype=np.uint8)}
    with d["n0"].client() as c:
        fut = c.save("tls", 1, 0, 1, data)
        assert fut.wait("peer", timeout=60) == ["n1"]  # pushed over the TLS bulk channel
    d["n0"].kill()
    d["n0"].wipe()
    d["n0"] = daemon_factory("n0", port=ports["n0"], args=(*base, *tls_args(good)))
    with d["n0"].client() as c:
        ck = c.restore("tls", 0)  # fetched over the TLS bulk channel
        assert ck.tier == "peer" and np.array_equal(ck.shards["w"], data["w"])

    ok = grpc.ssl_channel_credentials(_read(good["ca"]), _read(good["key"]), _read(good["cert"]))
    hello = _hello(ports["n1"], ok)
    assert hello.node_id == "n1" and hello.bulk_port
    rogue = pki["rogue"]["n0"]
    for creds in (grpc.ssl_channel_credentials(_read(good["ca"]), _read(rogue["key"]), _read(rogue["cert"])),
                  grpc.ssl_channel_credentials(_read(good["ca"]))):  # rogue client cert, no client cert
        with pytest.raises(grpc.RpcError) as e:
            _hello(ports["n1"], creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    def ctx(client: dict | None) -> ssl.SSLContext:
        c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        c.load_verify_locations(good["ca"])
        if client:
            c.load_cert_chain(client["cert"], client["key"])
        return c

    assert _bulk_probe(hello.bulk_port, ctx(good))  # a CA-signed peer gets an answer (unknown ticket)
    assert b"ticket" in _bulk_probe(hello.bulk_port, ctx(good))
    assert _bulk_probe(hello.bulk_port, ctx(rogue)) == b""
    assert _bulk_probe(hello.bulk_port, ctx(None)) == b""
    assert _bulk_probe(hello.bulk_port, None) == b""  # plain TCP
    assert "refused" in d["n1"].log_text()


def _pair(root: Path, label: str) -> dict[str, Path]:
    """A CA and a node certificate for n0 (SANs localhost and 127.0.0.1), made by ``tierckpt certs``."""
    return make_pki(root / label, ["n0"], ca_name=f"{label} CA")["n0"]


def test_certificates_rotate_without_restart(daemon_factory, tmp_path):
    """Swap cert, key and CA under a running daemon: new handshakes (gRPC and bulk) use the new
    files at once, a client of the old CA is refused, and the daemon never restarted."""
    a, b = _pair(tmp_path, "a"), _pair(tmp_path, "b")
    live = tmp_path / "live"
    live.mkdir()
    install(a, live)
    port = free_port()
    d = daemon_factory("n0", port=port, args=(
        "--tls-cert", str(live / "cert.pem"), "--tls-key", str(live / "key.pem"), "--tls-ca", str(live / "ca.pem"),
        "--peers", f"n0=127.0.0.1:{port}", "--replicas", "0"))
    pid = d.proc.pid
    both = tmp_path / "both-ca.pem"  # a client that trusts either CA: only its own certificate decides
    both.write_bytes(_read(a["ca"]) + _read(b["ca"]))

    def creds(own: dict[str, str]) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(str(both)), _read(own["key"]), _read(own["cert"]))

    def ctx(own: dict[str, str]) -> ssl.SSLContext:
        c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        c.load_verify_locations(str(both))
        c.load_cert_chain(own["cert"], own["key"])
        return c

    hello = _hello(port, creds(a))
    assert hello.node_id == "n0"
    assert b"ticket" in _bulk_probe(hello.bulk_port, ctx(a))
    with pytest.raises(grpc.RpcError):
        _hello(port, creds(b))  # not signed by the CA in use

    install(b, live)
    assert _hello(port, creds(b)).node_id == "n0"
    with pytest.raises(grpc.RpcError) as e:
        _hello(port, creds(a))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert b"ticket" in _bulk_probe(hello.bulk_port, ctx(b))
    assert _bulk_probe(hello.bulk_port, ctx(a)) == b""  # the bulk listener follows the rotation too
    assert d.alive() and d.proc.pid == pid
    assert "TLS files reloaded (generation 2)" in d.log_text()

    # A key that goes group-readable is not taken up: the daemon keeps the files it has.
    (live / "key.pem").chmod(0o640)
    (live / "cert.pem").write_bytes(_read(a["cert"]))  # a change that would otherwise be tried
    assert _hello(port, creds(b)).node_id == "n0"
    assert "is readable by group or others (mode 0640)" in d.log_text()
    assert d.alive() and d.proc.pid == pid
