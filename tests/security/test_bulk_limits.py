"""The bulk port against idle and flooding connections: 70 idle connections from another host
(127.0.0.2) neither stall replication (a per-source limit keeps slots for the others) nor stay
open (a connection that sends no request is closed quickly)."""

from __future__ import annotations

import socket
import time

import grpc
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..harness import Cluster


def _bulk_port(tcp_address: str) -> int:
    with grpc.insecure_channel(tcp_address) as ch:
        return ppb_grpc.PeerStub(ch).Hello(ppb.HelloRequest(node_id="n0"), timeout=10).bulk_port


def test_idle_connections_do_not_stall_replication_and_are_closed(daemon_factory):
    cl = Cluster(daemon_factory, 2, extra=("--knobs", "bulk_first_request_timeout=2,refresh_interval=0.3"))
    port = _bulk_port(cl.d["n1"].tcp_address)
    idle = []
    for _ in range(70):
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0))
        idle.append(s)
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
    assert "connection limit reached" in cl.d["n1"].log_tail(400) or "no request in time" in cl.d["n1"].log_tail(400)
