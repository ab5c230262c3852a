"""The bulk port against idle and flooding connections, and its read tickets.

- 70 idle connections from another host (127.0.0.2) neither stall replication nor stay open (a
  connection that sends no request is closed quickly).
- 70 idle connections from the peers' own address, under mTLS with a long handshake deadline,
  do not stall replication either: unauthenticated connections have their own small pool (a new
  one closes the oldest), so they never take the slot of an authenticated peer.
- A read ticket serves one transfer: bytes already read with it are refused.
"""

from __future__ import annotations

import socket
import time

import grpc
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..harness import Cluster
from ._peers import bulk_connect, bulk_get, cluster, peer_stub, pki_with_roles


def _bulk_port(tcp_address: str) -> int:
    with grpc.insecure_channel(tcp_address) as ch:
        return ppb_grpc.PeerStub(ch).Hello(ppb.HelloRequest(node_id="n0"), timeout=10).bulk_port


def _hold_idle(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) for _ in range(n)]


def test_idle_connections_do_not_stall_replication_and_are_closed(daemon_factory):
    cl = Cluster(daemon_factory, 2, extra=("--knobs", "bulk_first_request_timeout=2,refresh_interval=0.3"))
    port = _bulk_port(cl.d["n1"].tcp_address)
    idle = _hold_idle(port, 70, "127.0.0.2")
    try:
        t0 = time.monotonic()
        with cl.d["n0"].client() as c:
            assert c.save("flood", 1, 0, 1, {"w": b"x" * 100_000}).wait("peer", timeout=60) == ["n1"]
        # Not held up behind the idle connections (70 x bulk_first_request_timeout = 140 s if they
        # were served one by one); 45 s is room for a loaded machine.
        assert time.monotonic() - t0 < 45
        closed = 0
        for s in idle:  # every idle connection was closed by the daemon (EOF or reset)
            s.settimeout(15)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == len(idle)
    finally:
        for s in idle:
            s.close()
    assert "connection limit reached" in cl.d["n1"].log_text() or "no request in time" in cl.d["n1"].log_text()


def test_unauthenticated_connections_cannot_take_authenticated_slots(daemon_factory, tmp_path) -> None:
    pki = pki_with_roles(tmp_path)
    d = cluster(daemon_factory, pki, "--knobs", "bulk_first_request_timeout=60")
    ch, stub = peer_stub(d["n1"], pki["n0"])
    with ch:
        port = stub.Hello(ppb.HelloRequest(node_id="n0"), timeout=10).bulk_port
    idle = _hold_idle(port, 70)  # from 127.0.0.1, like the peers; never a handshake
    try:
        t0 = time.monotonic()
        with d["n0"].client() as c:
            assert c.save("flood", 1, 0, 1, {"w": b"x" * 100_000}).wait("peer", timeout=60) == ["n1"]
        # The 60 s handshake deadline never expired: the replica got a slot at once (a loaded
        # machine still lands it in seconds).
        assert time.monotonic() - t0 < 20
    finally:
        for s in idle:
            s.close()
    assert "unauthenticated connection" in d["n1"].log_text()


def test_a_read_ticket_serves_one_transfer(daemon_factory, tmp_path) -> None:
    pki = pki_with_roles(tmp_path)
    d = cluster(daemon_factory, pki)
    with d["n0"].client() as c:
        c.save("victim", 1, 0, 1, {"w": b"secret"}).wait("peer", timeout=60)
    ch, stub = peer_stub(d["n1"], pki["n0"])
    with ch:
        resp = stub.OpenRead(ppb.OpenReadRequest(requester="n0", job="victim", step=1, rank=0), timeout=10)
    with bulk_connect(resp.bulk_port, pki["n0"]) as sock:
        assert bulk_get(sock, resp.ticket, "w", 6) == ({"ok": True, "length": 6}, b"secret")
    for _ in range(2):  # used again, on a new connection: refused, nothing sent
        with bulk_connect(resp.bulk_port, pki["n0"]) as sock:
            reply, data = bulk_get(sock, resp.ticket, "w", 6)
        assert reply.get("code") == "FAILED_PRECONDITION" and "ticket" in reply["error"] and data == b""
