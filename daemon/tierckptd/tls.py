"""Mutual TLS for peer traffic: gRPC credentials and ``ssl`` contexts for the bulk data channel.

Every node presents ``tls_cert``/``tls_key`` and accepts only peers whose certificate is signed
by ``tls_ca``, in both directions and on both channels (gRPC and bulk). Clients check the
server's certificate against the name they dialled (the host of ``--peers``, or the DNS name of
``--peers-dns``), so node certificates need that name (or IP) as a subject alternative name.
"""

from __future__ import annotations

import ssl

import grpc

from .config import ConfigError, DaemonConfig

__all__ = ["channel_credentials", "client_ssl_context", "server_credentials", "server_ssl_context"]


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None


def server_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    """Credentials of the TCP listener: present our certificate, require a CA-signed client one."""
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key, "tls_key"), _read(config.tls_cert, "tls_cert"))],
        root_certificates=_read(config.tls_ca, "tls_ca"),
        require_client_auth=True,
    )


def channel_credentials(config: DaemonConfig) -> grpc.ChannelCredentials:
    """Credentials of a channel to a peer: verify it against the CA, present our certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca, "tls_ca"),
        private_key=_read(config.tls_key, "tls_key"),
        certificate_chain=_read(config.tls_cert, "tls_cert"),
    )


def _context(config: DaemonConfig, purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
        ctx.load_verify_locations(cafile=config.tls_ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_cert/tls_key/tls_ca: cannot load: {e}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_ssl_context(config: DaemonConfig) -> ssl.SSLContext:
    """Server side of the bulk channel: refuses clients without a certificate signed by tls_ca."""
    return _context(config, ssl.PROTOCOL_TLS_SERVER)


def client_ssl_context(config: DaemonConfig) -> ssl.SSLContext:
    """Client side of the bulk channel: verifies the peer's chain and name, presents our certificate."""
    ctx = _context(config, ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = True
    return ctx
