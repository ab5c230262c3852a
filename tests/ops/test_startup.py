"""Every start-up failure is one line on stderr naming the key or resource, exit code 2; a live
socket is never taken over, and a daemon removes only the socket it made."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
from tierckptd.testing import _BIN_DIR

from ..security._util import run_daemon


def _refused(p: subprocess.CompletedProcess, key: str, *, only: bool = True) -> str:
    """Exit 2 and one line "tierckptd: ..." naming ``key``, last on stderr, no traceback; with
    ``only``, nothing else on stderr either (refused before the daemon logged anything)."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "READY" not in p.stdout, p.stderr
    ours = [line for line in lines if line.startswith("tierckptd:")]
    assert len(ours) == 1 and lines[-1] == ours[0], p.stderr
    assert key in ours[0], ours[0]
    if only:
        assert len(lines) == 1, p.stderr
    return ours[0]


def _answers(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


def test_a_live_socket_is_never_taken_over(daemon_factory, scratch: Path) -> None:
    first = daemon_factory("n0")
    p = run_daemon(scratch / "second", "--listen", "", "--socket", str(first.socket))
    line = _refused(p, "socket:")
    assert str(first.socket) in line and f"pid {first.proc.pid}" in line
    assert first.socket.exists() and _answers(first.address)
    with first.client() as c:  # still the first daemon's, and it still works
        assert c.status().node_id == "n0"


def test_a_live_socket_without_the_lock_is_not_taken_over(scratch: Path) -> None:
    """Another program (or an older daemon) serving the path: found by connecting, pid by SO_PEERCRED."""
    path = scratch / "other.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(8)
        p = run_daemon(scratch, "--listen", "", "--socket", str(path))
        line = _refused(p, "socket:")
        assert str(path) in line and f"pid {os.getpid()}" in line
        assert path.exists()


def test_a_stale_socket_is_replaced(scratch: Path, daemon_factory) -> None:
    d = daemon_factory("n0", start=False)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(d.socket))  # a dead daemon's leftover: nobody listens
    d.start()
    assert _answers(d.address)


def test_something_else_at_the_socket_path_is_refused(scratch: Path) -> None:
    path = scratch / "not-a-socket"
    path.write_text("keep me")
    line = _refused(run_daemon(scratch, "--listen", "", "--socket", str(path)), "socket:")
    assert "not a socket" in line and path.read_text() == "keep me"


def test_a_daemon_removes_only_its_own_socket(daemon_factory, scratch: Path) -> None:
    d = daemon_factory("n0")
    moved = scratch / "moved.sock"
    os.rename(d.socket, moved)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(d.socket))  # someone else's socket now at the path
        theirs = os.stat(d.socket).st_ino
        assert d.terminate() == 0
        assert d.socket.exists() and os.stat(d.socket).st_ino == theirs


def test_a_daemon_removes_its_socket_on_exit(daemon_factory) -> None:
    d = daemon_factory("n0")
    assert d.socket.exists()
    assert d.terminate() == 0
    assert not d.socket.exists()


def test_listen_port_in_use(scratch: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = _refused(run_daemon(scratch, "--listen", f"127.0.0.1:{port}", "--insecure-listen"), "listen:",
                        only=False)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert not (scratch / "d.sock").exists()  # nothing left behind


def test_metrics_port_in_use(scratch: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = _refused(run_daemon(scratch, "--listen", "", "--metrics-port", str(port)),
                        "metrics_port:")
    assert str(port) in line and "in use" in line
    assert not (scratch / "data").exists()  # refused before the local dir was touched


def test_unknown_socket_group(scratch: Path) -> None:
    line = _refused(run_daemon(scratch, "--listen", "", "--socket-group", "no-such-group-xyz"),
                    "socket_group:")
    assert "no-such-group-xyz" in line
    assert not (scratch / "data").exists() and not (scratch / "d.sock").exists()


def test_unusable_local_dir(scratch: Path) -> None:
    (scratch / "file").write_text("")
    argv = [str(_BIN_DIR / "tierckptd"), "--local-dir", str(scratch / "file" / "data"),
            "--socket", str(scratch / "d.sock"), "--listen", ""]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    line = _refused(p, "local_dir:", only=False)
    assert str(scratch / "file") in line
    assert not (scratch / "d.sock").exists()  # the claimed socket path is released again


def test_sigterm_after_refusal_leaves_the_first_daemon_serving(daemon_factory, scratch: Path) -> None:
    first = daemon_factory("n0")
    for _ in range(2):
        _refused(run_daemon(scratch / "again", "--listen", "", "--socket", str(first.socket)),
                 "socket:")
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(60) == 0
    assert not first.socket.exists()


@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_ready_line_in_both_formats(daemon_factory, fmt: str) -> None:
    d = daemon_factory("n0", args=("--log-format", fmt))  # testing.Daemon parses either
    assert d.info["node_id"] == "n0" and d.info["pid"] == d.proc.pid and d.info["tcp_port"]
