"""Operations against a real daemon: health service, /metrics, sd_notify, socket permissions."""

from __future__ import annotations

import os
import socket
import stat
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .harness import free_port


def test_health_metrics_and_socket_mode(daemon_factory):
    mport = free_port()
    d = daemon_factory(args=("--metrics-port", str(mport), "--socket-mode", "0600"))
    assert d.info["metrics_port"] == mport
    with grpc.insecure_channel(d.tcp_address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(service="tierckpt.v1.Tierckpt")).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    with d.client() as c:
        c.save("job", 1, 0, 1, {"x": b"abcd"}).result(30)
        c.restore("job", 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['tierckpt_saves_total{result="ok",tier="local"}'] == 1
    assert values['tierckpt_saved_bytes_total{tier="local"}'] == 4
    assert values['tierckpt_restores_total{result="ok",tier="local"}'] == 1
    assert values["tierckpt_local_used_bytes"] == 4
    assert values["tierckpt_commit_latency_seconds_count"] == 1
    # Bound to loopback only.
    with socket.socket() as s:
        s.settimeout(1)
        external = socket.gethostbyname(socket.gethostname())
        if not external.startswith("127."):
            assert s.connect_ex((external, mport)) != 0


def test_sd_notify_ready_and_stopping(daemon_factory, scratch):
    path = str(scratch / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    try:
        d = daemon_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        while not any("WATCHDOG=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        assert d.terminate() == 0
        while not any("STOPPING=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
    finally:
        sock.close()
