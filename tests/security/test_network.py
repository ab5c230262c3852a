"""Default deny on the network: no TCP listener beyond loopback without mTLS unless told so
explicitly, and no private key that the trainers' group (or anyone else) could read.

Every refusal is checked the way an operator meets it: ``tierckptd`` exits 2 with one line
naming the key, and nothing on disk changed (no local dir, no socket).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from pathlib import Path

import pytest
from tierckptd import tls
from tierckptd.config import ConfigError, is_loopback_host, load_config

from ..certs import issue, make_pki
from ..certs import tls_args as _tls_args
from ..threads import Checked
from ._util import run_daemon, snapshot


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """n0's files, its CA in tmp_path / "ca"."""
    return make_pki(tmp_path, ["n0"])["n0"]


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "", "example.invalid"])
def test_non_loopback_listen_without_tls_is_refused(tmp_path: Path, host: str) -> None:
    before = snapshot(tmp_path)
    p = run_daemon(tmp_path, "--listen", f"{host}:0")
    assert p.returncode == 2, p.stderr
    line = _one_line(p.stderr)
    assert "listen:" in line and "non-loopback" in line and "insecure_listen" in line and "tls_cert" in line
    assert snapshot(tmp_path) == before and not (tmp_path / "data").exists()


def test_the_same_refusal_from_the_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "d.toml"
    conf.write_text('listen = "0.0.0.0:7070"\n')
    before = snapshot(tmp_path)
    p = run_daemon(tmp_path, "--config", str(conf))
    assert p.returncode == 2 and "listen:" in _one_line(p.stderr)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"])
def test_loopback_listen_without_tls_is_refused_too(tmp_path: Path, host: str) -> None:
    """Loopback is no boundary (any local user reaches it): plain TCP needs the explicit flag."""
    before = snapshot(tmp_path)
    p = run_daemon(tmp_path, "--listen", f"{host}:0")
    assert p.returncode == 2, p.stderr
    line = _one_line(p.stderr)
    assert "listen:" in line and "a loopback address" in line and "insecure_listen" in line and "socket" in line
    assert snapshot(tmp_path) == before and not (tmp_path / "data").exists()
    cfg = load_config({}, {"listen": f"{host}:7070", "insecure_listen": True, "socket": "/tmp/x.sock"})
    warning = tls.insecure_warning(cfg)
    assert warning and "WITHOUT mTLS" in warning and "any local user" in warning


def test_by_default_there_is_no_tcp_listener(tmp_path: Path) -> None:
    """The defaults serve the Unix socket only: nothing answers on 127.0.0.1:7070 (or anywhere)."""
    assert load_config({}, {}).listen == ""
    import subprocess

    from tierckptd.logs import parse_ready_line
    from tierckptd.testing import _BIN_DIR

    argv = [str(_BIN_DIR / "tierckptd"), "--node-id", "n0", "--local-dir", str(tmp_path / "data"),
            "--socket", str(tmp_path / "d.sock")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        info = parse_ready_line(proc.stdout.readline().decode().strip())
        assert info is not None and not info.get("tcp_port")
        import tierckpt

        with tierckpt.Client(f"unix://{tmp_path / 'd.sock'}") as c:  # local tools use the socket
            c.save("j", 1, 0, 1, {"w": b"x"}).result(30)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.255.0.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False),
    ("::ffff:10.0.0.1", False), ("node1", False), ("localhost.evil.example", False),
])
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_insecure_listen_is_accepted_and_warned(daemon_factory) -> None:
    d = daemon_factory("n0", args=("--listen", "0.0.0.0:0", "--insecure-listen"))
    assert d.alive() and d.info["tcp_port"]
    with socket.create_connection(("127.0.0.1", d.info["tcp_port"]), timeout=5):
        pass  # listening on every interface, loopback included
    # The warning text; main logs it at start-up (the lead wires tls.insecure_warning into main).
    cfg = load_config({}, {"listen": "0.0.0.0:7070", "insecure_listen": True})
    warning = tls.insecure_warning(cfg)
    assert warning and "0.0.0.0:7070" in warning and "WITHOUT mTLS" in warning


def test_toml_insecure_listen_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="insecure_listen: expected true or false"):
        load_config({"insecure_listen": "yes", "listen": "0.0.0.0:1"})
    assert load_config({"insecure_listen": True, "listen": "0.0.0.0:1"}).insecure_listen


def test_non_loopback_listen_with_mtls_starts(daemon_factory, pki) -> None:
    d = daemon_factory("n0", args=("--listen", "0.0.0.0:0", *_tls_args(pki)))
    assert d.alive() and d.info["tcp_port"]
    assert tls.insecure_warning(load_config({}, {"listen": "0.0.0.0:1", "tls_cert": "c", "tls_key": "k",
                                                 "tls_ca": "a", "insecure_listen": True})) is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o620])
def test_key_readable_by_group_or_others_is_refused(tmp_path: Path, pki, mode: int) -> None:
    pki["key"].chmod(mode)
    before = snapshot(tmp_path)
    p = run_daemon(tmp_path, "--listen", "127.0.0.1:0", *_tls_args(pki))
    assert p.returncode == 2, p.stderr
    line = _one_line(p.stderr)
    assert "tls_key:" in line and str(pki["key"]) in line and f"mode {mode:04o}" in line
    assert snapshot(tmp_path) == before and not (tmp_path / "data").exists()


def test_group_readable_key_only_when_told_and_never_for_the_socket_group(tmp_path: Path, pki) -> None:
    pki["key"].chmod(0o440)
    values = {"tls_cert": str(pki["cert"]), "tls_key": str(pki["key"]), "tls_ca": str(pki["ca"])}
    with pytest.raises(ConfigError, match="mode 0440"):
        tls.TlsReloader(load_config(values))
    tls.TlsReloader(load_config({**values, "tls_key_group_readable": True}))  # Kubernetes Secret + fsGroup
    gid = str(os.stat(pki["key"]).st_gid)
    with pytest.raises(ConfigError, match="socket_group"):
        tls.TlsReloader(load_config({**values, "tls_key_group_readable": True, "socket_group": gid}))
    pki["key"].chmod(0o444)
    with pytest.raises(ConfigError, match="mode 0444"):
        tls.TlsReloader(load_config({**values, "tls_key_group_readable": True}))


def test_missing_or_mismatched_tls_files_stop_start_up_before_the_disk(tmp_path: Path, pki) -> None:
    other = issue(tmp_path, "n1")
    before = snapshot(tmp_path)
    for args, key in ((("--tls-cert", str(pki["cert"]), "--tls-key", str(tmp_path / "nope.key"),
                        "--tls-ca", str(pki["ca"])), "tls_key"),
                      (("--tls-cert", str(pki["cert"]), "--tls-key", str(other["key"]), "--tls-ca", str(pki["ca"])),
                       "tls_cert/tls_key/tls_ca")):
        p = run_daemon(tmp_path, "--listen", "127.0.0.1:0", *args)
        assert p.returncode == 2 and _one_line(p.stderr).startswith(f"tierckptd: config error: {key}")
    assert snapshot(tmp_path) == before


# -- rotation (the daemon-level test is tests/test_tls.py::test_certificates_rotate_without_restart) ----

def _replace(src: Path, dst: Path, mode: int) -> None:
    tmp = dst.with_name("." + dst.name + ".tmp")
    tmp.write_bytes(src.read_bytes())
    tmp.chmod(mode)
    os.replace(tmp, dst)


def test_reloader_takes_up_a_good_change_and_keeps_the_old_files_on_a_bad_one(tmp_path: Path, caplog) -> None:
    files = {label: make_pki(tmp_path / label, ["n0"])["n0"] for label in ("a", "b")}
    live = tmp_path / "live"
    live.mkdir()
    for name, mode in (("cert", 0o644), ("key", 0o600), ("ca", 0o644)):
        _replace(files["a"][name], live / name, mode)
    r = tls.TlsReloader(load_config({}, {"tls_cert": str(live / "cert"), "tls_key": str(live / "key"),
                                         "tls_ca": str(live / "ca")}))
    assert r.generation == 1 and r.files().cert == files["a"]["cert"].read_bytes()
    ctx1 = r.server_ssl_context()
    assert r.server_ssl_context() is ctx1 and r.generation == 1  # no change, no rebuild

    _replace(files["b"]["cert"], live / "cert", 0o644)  # half-way: b's cert with a's key
    with caplog.at_level(logging.ERROR, logger="tierckptd.tls"):
        assert r.generation == 1 and r.generation == 1
    assert len([rec for rec in caplog.records if "not loaded" in rec.getMessage()]) == 1  # logged once
    assert r.files().cert == files["a"]["cert"].read_bytes()  # still the old pair

    _replace(files["b"]["key"], live / "key", 0o600)
    _replace(files["b"]["ca"], live / "ca", 0o644)
    assert r.generation == 2 and r.files().key == files["b"]["key"].read_bytes()
    assert r.server_ssl_context() is not ctx1 and r.client_ssl_context().check_hostname


# -- identity -------------------------------------------------------------------------------------

def test_ssl_peer_identity_and_node_binding(tmp_path: Path, pki) -> None:
    client = issue(tmp_path, "gpu-7", sans=("gpu-7.example", "10.0.0.7"))
    cfg = load_config({}, {"tls_cert": str(pki["cert"]), "tls_key": str(pki["key"]), "tls_ca": str(pki["ca"])})
    r = tls.TlsReloader(cfg)
    got: list[set[str]] = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def serve() -> None:
            conn, _ = srv.accept()
            with r.server_ssl_context().wrap_socket(conn, server_side=True) as s:
                got.append(tls.ssl_peer_identity(s))
                s.sendall(b"k")

        t = Checked(serve)
        t.start()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(str(pki["ca"]))
        ctx.load_cert_chain(str(client["cert"]), str(client["key"]))
        with ctx.wrap_socket(socket.create_connection(srv.getsockname()), server_hostname="localhost") as s:
            assert s.recv(1) == b"k"
            assert tls.ssl_peer_identity(s) == {"n0", "localhost"}
        t.join(30)
    assert got == [{"gpu-7", "gpu-7.example"}]  # CN and DNS SANs; IP SANs are not names
    assert tls.check_peer_node(got[0], "gpu-7", cfg) is None
    refusal = tls.check_peer_node(got[0], "gpu-8", cfg)
    assert refusal and "'gpu-8'" in refusal and "gpu-7.example" in refusal
    shared = load_config({}, {"tls_cert": "c", "tls_key": "k", "tls_ca": "a", "tls_bind_node_id": False})
    assert tls.check_peer_node({"tierckptd-peers.tierckpt.svc"}, "gpu-8", shared) is None


class _Ctx:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_grpc_peer_identity_from_the_auth_context() -> None:
    auth = {"transport_security_type": [b"ssl"], "x509_common_name": [b"n3"],
            "x509_subject_alternative_name": [b"n3", b"n3.example", b"10.0.0.3"],
            "peer_dns": [b"n3", b"n3.example"], "peer_ip": [b"10.0.0.3"]}
    assert tls.peer_identity(_Ctx(auth)) == {"n3", "n3.example"}
    del auth["peer_dns"]
    assert tls.peer_identity(_Ctx(auth)) == {"n3", "n3.example"}
    assert tls.peer_identity(_Ctx({"transport_security_type": [b"insecure"]})) == set()
    assert tls.peer_identity(_Ctx({})) == set()
