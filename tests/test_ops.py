"""Operations against a real daemon: health service, /metrics, sd_notify, socket permissions."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .harness import free_port
from .metrics_scrape import scrape, scrape_text


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
    values = scrape(mport)
    assert values['tierckpt_saves_total{result="ok",tier="local"}'] == 1
    assert values['tierckpt_saved_bytes_total{tier="local"}'] == 4
    assert values['tierckpt_restores_total{result="ok",tier="local"}'] == 1
    assert values["tierckpt_local_used_bytes"] == 2 * 4096  # as charged: the 4-byte file and the manifest, 4 KiB each
    assert values["tierckpt_commit_latency_seconds_count"] == 1
    # Bound to 127.0.0.1 only (README): the listening socket's own address, and no answer on
    # another address of this machine (127.0.0.2 reaches a socket bound to 0.0.0.0).
    assert _listeners(mport) == {"127.0.0.1"}
    assert not _answers("127.0.0.2", mport)


def _listeners(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state != "0A" or int(p, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(addr)  # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                out.add(str(ipaddress.ip_address(raw)))
    return out


def _answers(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(10)
        return s.connect_ex((host, port)) == 0


@pytest.mark.parametrize("how", ["flag", "config file"])
def test_metrics_host_sets_the_metrics_address(daemon_factory, scratch, how):
    """--metrics-host (metrics_host in the config file) is the address /metrics binds to."""
    mport = free_port()
    if how == "flag":
        args = ("--metrics-port", str(mport), "--metrics-host", "127.0.0.2")
    else:
        conf = scratch / "d.toml"
        conf.write_text(f'metrics_port = {mport}\nmetrics_host = "127.0.0.2"\n')
        args = ("--config", str(conf))
    d = daemon_factory(args=args)
    assert d.info["metrics_port"] == mport
    assert _listeners(mport) == {"127.0.0.2"}
    assert "tierckpt_build_info" in scrape_text(mport, host="127.0.0.2")
    assert not _answers("127.0.0.1", mport)


def test_metrics_host_all_addresses(daemon_factory):
    mport = free_port()
    daemon_factory(args=("--metrics-port", str(mport), "--metrics-host", "0.0.0.0"))
    assert _listeners(mport) == {"0.0.0.0"}
    for host in ("127.0.0.1", "127.0.0.2"):
        assert "tierckpt_build_info" in scrape_text(mport, host=host)


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
