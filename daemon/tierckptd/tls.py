"""Mutual TLS for peer traffic: gRPC credentials and ``ssl`` contexts for the bulk data channel.

Every node presents ``tls_cert``/``tls_key`` and accepts only peers whose certificate is signed
by ``tls_ca``, in both directions and on both channels (gRPC and bulk). Clients check the
server's certificate against the name they dialled (the host of ``--peers``, or the DNS name of
``--peers-dns``), so node certificates need that name (or IP) as a subject alternative name.

Rotation without restart: :class:`TlsReloader` re-reads the three files when one of them
changes (mtime, size or inode: an editor's rename and Kubernetes' atomic ``..data`` swap both
count). New handshakes use the new files; established connections keep theirs. A change that
does not load (a key that does not match the certificate, a half-written file, a key readable by
others) is logged once and the previous files stay in use until the next change.

- gRPC server: :meth:`TlsReloader.server_credentials` (``grpc.dynamic_ssl_server_credentials``,
  whose fetcher runs at each handshake) follows rotation by itself.
- Bulk server: every context from :meth:`TlsReloader.server_ssl_context` switches the handshake
  to the newest context from its ``sni_callback``, so a listener built once follows rotation.
- Clients: :meth:`TlsReloader.channel_credentials` and :meth:`TlsReloader.client_ssl_context`
  return what is current when called; callers that cache them compare
  :attr:`TlsReloader.generation` to know when to rebuild.

Identity: :func:`peer_identity` (gRPC) and :func:`ssl_peer_identity` (bulk socket) return the
names a verified peer certificate carries (CN and DNS SANs); :func:`peer_role` and
:func:`ssl_peer_role` its role, from the URI SAN ``tierckpt://node/<id>`` or
``tierckpt://client/<name>`` (``tierckpt certs node|client``); :func:`check_peer_node` says
whether a node certificate binds the node id a peer claims.

The private key must not be readable by group or others (``chmod 600``): a key readable by the
trainers' group would let any trainer pose as this node. :func:`check_key_file` refuses it,
naming the file and its mode, at start-up (called from :func:`tierckptd.config.parse_args`) and
at every reload.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import stat
import threading
from typing import Any

import grpc

from .config import ConfigError, DaemonConfig, is_loopback_host

__all__ = [
    "CLIENT_URI", "NODE_URI", "Role", "TlsFiles", "TlsReloader", "channel_credentials", "check_key_file",
    "check_node_role", "check_peer_node",
    "client_ssl_context", "insecure_warning", "peer_identity", "peer_role", "reloader", "server_credentials",
    "server_ssl_context", "ssl_peer_identity", "ssl_peer_role",
]

NODE_URI = "tierckpt://node/"
CLIENT_URI = "tierckpt://client/"

log = logging.getLogger("tierckptd.tls")

_Signature = tuple[tuple[int, int, int], ...]


def _gid(group: str) -> int | None:
    """The gid of ``group`` (name or number), None when unset or unknown (start-up refuses an
    unknown socket_group separately, naming it)."""
    from .config import ConfigError
    from .unixsock import resolve_group

    try:
        return resolve_group(group)
    except ConfigError:
        return None


def check_key_file(path: str, *, group_readable: bool = False, socket_group: str = "") -> os.stat_result:
    """Refuse a private key file that others (or, by default, its group) may read or write.

    Args:
        path: The key file (symlinks are followed: the target's mode is what counts).
        group_readable: Accept read access for the file's group (``tls_key_group_readable``),
            unless that group is ``socket_group`` (the trainers).
        socket_group: The Unix socket's group, name or gid.

    Returns:
        The file's ``os.stat_result``.

    Raises:
        ConfigError: The file is missing, not a regular file, or too open; the message names
            ``tls_key``, the file and its mode.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"tls_key: cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"tls_key: {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    allowed = 0o040 if group_readable else 0
    if mode & 0o077 & ~allowed:
        raise ConfigError(f"tls_key: {path} is readable by group or others (mode {mode:04o}); a private key "
                          f"must be 0600 (chmod 600 {path})")
    if mode & 0o040 and st.st_gid == _gid(socket_group):
        raise ConfigError(f"tls_key: {path} is readable by group {st.st_gid} (mode {mode:04o}), which is "
                          "socket_group: every trainer could pose as this node (chmod 600)")
    return st


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """One consistent set of PEM files as read from disk."""

    cert: bytes
    key: bytes
    ca: bytes
    generation: int  # 1 for the files read at start-up, +1 at every successful reload


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None


class TlsReloader:
    """The node's certificate, key and CA, re-read when the files change.

    Thread-safe: gRPC calls the credential fetcher from its own threads and the bulk channel
    handshakes in worker threads.

    Args:
        config: The daemon configuration (``tls_cert``, ``tls_key``, ``tls_ca``,
            ``tls_key_group_readable``, ``socket_group``).

    Raises:
        ConfigError: The files cannot be read or do not form a valid key pair and CA, or the
            key file is too open (the first load only: later failures are logged).
    """

    def __init__(self, config: DaemonConfig) -> None:
        if not config.tls_enabled:
            raise ConfigError("tls_cert/tls_key/tls_ca: TLS is not configured")
        self._paths = (config.tls_cert, config.tls_key, config.tls_ca)
        self._group_readable = config.tls_key_group_readable
        self._socket_group = config.socket_group
        self._lock = threading.Lock()
        self._failed: _Signature | None = None
        self._signature = self._stat()
        self._files, self._server_ctx, self._client_ctx = self._load(1)
        self._fetched = 0  # generation handed to gRPC's fetcher last

    # -- loading --------------------------------------------------------------------------------

    def _stat(self) -> _Signature:
        """(mtime, size, inode) of cert, key and CA; a missing file reads as zeros."""
        sig = []
        for path in self._paths:
            try:
                st = os.stat(path)
                sig.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                sig.append((0, 0, 0))
        return tuple(sig)

    def _load(self, generation: int) -> tuple[TlsFiles, ssl.SSLContext, ssl.SSLContext]:
        cert, key, ca = self._paths
        check_key_file(key, group_readable=self._group_readable, socket_group=self._socket_group)
        files = TlsFiles(_read(cert, "tls_cert"), _read(key, "tls_key"), _read(ca, "tls_ca"), generation)
        server = self._context(ssl.PROTOCOL_TLS_SERVER)  # also proves that key, cert and CA load together
        server.sni_callback = self._switch
        client = self._context(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = True
        return files, server, client

    def _context(self, purpose: int) -> ssl.SSLContext:
        cert, key, ca = self._paths
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"tls_cert/tls_key/tls_ca: cannot load {cert}, {key} and {ca}: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def refresh(self) -> bool:
        """Reload the files if they changed since the last look; return whether a reload happened.

        A change that fails to load is logged (once per change) and the current files stay.
        """
        with self._lock:
            sig = self._stat()
            if sig in (self._signature, self._failed):
                return False
            try:
                files, server, client = self._load(self._files.generation + 1)
            except ConfigError as e:
                self._failed = sig
                log.error("TLS files changed but were not loaded; still using generation %d: %s",
                          self._files.generation, e)
                return False
            self._signature, self._failed = sig, None
            self._files, self._server_ctx, self._client_ctx = files, server, client
            log.info("TLS files reloaded (generation %d): %s", files.generation, ", ".join(self._paths))
            return True

    # -- what callers use ------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Increases by one at every reload; compare it to know when cached credentials are stale."""
        self.refresh()
        return self._files.generation

    def files(self) -> TlsFiles:
        """The current PEM bytes (after looking for a change)."""
        self.refresh()
        return self._files

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of the TCP listener: present our certificate, require a CA-signed client one.

        The certificate, key and CA are fetched again at each handshake when the files changed.
        """
        def config_for(files: TlsFiles) -> Any:
            return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], root_certificates=files.ca)

        def fetch() -> Any:
            # Called by gRPC core at every handshake, on its threads: never raise into it.
            try:
                files = self.files()
                if files.generation == self._fetched:
                    return None  # no change
                self._fetched = files.generation
                return config_for(files)
            except Exception:
                log.exception("TLS credential fetch failed; keeping the current certificate")
                return None

        files = self.files()
        self._fetched = files.generation
        return grpc.dynamic_ssl_server_credentials(config_for(files), fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a new channel to a peer (current files): verify it against the CA,
        present our certificate. A channel keeps the credentials it was built with."""
        files = self.files()
        return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key,
                                            certificate_chain=files.cert)

    def server_ssl_context(self) -> ssl.SSLContext:
        """Server side of the bulk channel: refuses clients without a certificate signed by tls_ca.

        The context switches each handshake to the newest files, so it may be kept for good.
        """
        self.refresh()
        return self._server_ctx

    def client_ssl_context(self) -> ssl.SSLContext:
        """Client side of the bulk channel (current files): verifies the peer's chain and name,
        presents our certificate. Ask again for each connection to follow rotation."""
        self.refresh()
        return self._client_ctx

    def _switch(self, sslobj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext) -> None:
        # OpenSSL calls this during every server handshake (with or without SNI): hand the
        # connection the newest context, whose certificate and CA then apply to it.
        try:
            current = self.server_ssl_context()
            if current is not ctx:
                sslobj.context = current
        except Exception:
            log.exception("TLS context switch failed; handshake uses the previous files")


_reloaders: dict[tuple[Any, ...], TlsReloader] = {}
_reloaders_lock = threading.Lock()


def reloader(config: DaemonConfig) -> TlsReloader:
    """The process's :class:`TlsReloader` for ``config``'s files (one per set of paths)."""
    key = (config.tls_cert, config.tls_key, config.tls_ca, config.tls_key_group_readable, config.socket_group)
    with _reloaders_lock:
        r = _reloaders.get(key)
        if r is None:
            r = _reloaders[key] = TlsReloader(config)
        return r


def server_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    """Credentials of the TCP listener (rotating): see :meth:`TlsReloader.server_credentials`."""
    return reloader(config).server_credentials()


def channel_credentials(config: DaemonConfig) -> grpc.ChannelCredentials:
    """Credentials of a channel to a peer (current files): see :meth:`TlsReloader.channel_credentials`."""
    return reloader(config).channel_credentials()


def server_ssl_context(config: DaemonConfig) -> ssl.SSLContext:
    """Server side of the bulk channel (rotating): see :meth:`TlsReloader.server_ssl_context`."""
    return reloader(config).server_ssl_context()


def client_ssl_context(config: DaemonConfig) -> ssl.SSLContext:
    """Client side of the bulk channel (current files): see :meth:`TlsReloader.client_ssl_context`."""
    return reloader(config).client_ssl_context()


# -- identity -------------------------------------------------------------------------------------

def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def peer_identity(context: Any) -> set[str]:
    """The names in the verified client certificate of a gRPC call: CN and DNS SANs.

    Args:
        context: A ``grpc.aio.ServicerContext`` (or ``grpc.ServicerContext``).

    Returns:
        The names; empty when the call did not come over mTLS (the Unix socket, plain TCP).
    """
    auth = context.auth_context() or {}
    if auth.get("transport_security_type", [b""])[0] != b"ssl":
        return set()
    values: list[bytes] = list(auth.get("x509_common_name", []))
    dns = auth.get("peer_dns")
    if dns is not None:
        values += dns
    else:  # older gRPC: every SAN in one property; IP SANs are not names
        values += [v for v in auth.get("x509_subject_alternative_name", []) if not _is_ip(v.decode(errors="replace"))]
    return {v.decode(errors="replace") for v in values if v}


def ssl_peer_identity(sslsock: ssl.SSLSocket | ssl.SSLObject) -> set[str]:
    """The names in the verified certificate of the other end of a bulk connection: CN and DNS SANs.

    Returns:
        The names; empty when the peer presented no verified certificate.
    """
    cert = sslsock.getpeercert()
    if not cert:
        return set()
    subject: Any = cert.get("subject", ())
    sans: Any = cert.get("subjectAltName", ())
    names = {str(value) for rdn in subject for key, value in rdn if key == "commonName"}
    names |= {str(value) for kind, value in sans if kind == "DNS"}
    return names


@dataclasses.dataclass(frozen=True)
class Role:
    """What a verified certificate is: ``kind`` "node" (with its node id), "client" (with its
    name) or "none" (no role URI: a certificate from before roles, treated as a client)."""

    kind: str
    name: str = ""
    names: frozenset[str] = frozenset()  # CN and DNS SANs, for messages and the deny-list

    @property
    def all_names(self) -> set[str]:
        return set(self.names) | ({self.name} if self.name else set())

    def describe(self) -> str:
        shown = ", ".join(sorted(self.names)) or "no names"
        return f"{self.kind} certificate {self.name!r} ({shown})" if self.name else f"certificate without a role " \
            f"URI ({shown})"


def _role(uris: list[str], names: set[str]) -> Role:
    nodes = {u[len(NODE_URI):] for u in uris if u.startswith(NODE_URI)}
    clients = {u[len(CLIENT_URI):] for u in uris if u.startswith(CLIENT_URI)}
    if len(nodes) == 1 and not clients:
        return Role("node", next(iter(nodes)), frozenset(names))
    if clients or nodes:  # a client, or an ambiguous certificate: never a node
        return Role("client", sorted(clients | nodes)[0], frozenset(names))
    return Role("none", "", frozenset(names))


def peer_role(context: Any) -> Role | None:
    """The role of a gRPC call's verified client certificate; None without mTLS."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type", [b""])[0] != b"ssl":
        return None
    raw = auth.get("peer_uri")
    if raw is None:  # older gRPC: every SAN in one property
        raw = auth.get("x509_subject_alternative_name", [])
    uris = [v.decode(errors="replace") for v in raw]
    return _role([u for u in uris if u.startswith("tierckpt://")], peer_identity(context))


def ssl_peer_role(sslsock: ssl.SSLSocket | ssl.SSLObject) -> Role | None:
    """The role of the verified certificate at the other end of a bulk connection; None without one."""
    cert = sslsock.getpeercert()
    if not cert:
        return None
    sans: Any = cert.get("subjectAltName", ())
    return _role([str(v) for kind, v in sans if kind == "URI"], ssl_peer_identity(sslsock))


def check_node_role(role: Role | None, node_id: str, config: DaemonConfig) -> str | None:
    """Whether a caller presenting ``role`` may act as node ``node_id`` on the Peer service or
    the bulk channel: a node certificate, naming ``node_id`` unless ``tls_bind_node_id`` is off.

    Returns:
        None when allowed (or without TLS), else a refusal message.
    """
    if not config.tls_enabled:
        return None
    if role is None or role.kind != "node":
        what = role.describe() if role is not None else "no certificate"
        return (f"the Peer service and the bulk channel serve node certificates only (URI SAN {NODE_URI}<id>, "
                f"tierckpt certs node); the caller presents a {what}")
    if config.tls_bind_node_id and role.name != node_id:
        return f"peer claims node id {node_id!r} but its node certificate is for {role.name!r}"
    return None


def check_peer_node(identity: set[str], node_id: str, config: DaemonConfig) -> str | None:
    """Whether a peer that claims ``node_id`` may act as that node.

    Args:
        identity: From :func:`peer_identity` or :func:`ssl_peer_identity`.
        node_id: The node id the peer claims (in a request, or the one it was dialled as).
        config: ``tls_enabled`` and ``tls_bind_node_id`` decide.

    Returns:
        None when allowed, else a refusal message naming the id and the certificate's names.
    """
    if not config.tls_enabled or not config.tls_bind_node_id:
        return None
    if node_id in identity:
        return None
    names = ", ".join(sorted(identity)) or "none"
    return (f"peer claims node id {node_id!r} but its certificate names {names}; node certificates carry "
            "their node id as CN or DNS SAN (tierckpt certs node --node-id ID)")


def insecure_warning(config: DaemonConfig) -> str | None:
    """The warning to log at start-up when ``insecure_listen`` opens a network listener without mTLS.

    Returns:
        The message, or None when TLS is on, insecure_listen is off, or there is no TCP listener.
    """
    if not config.insecure_listen or not config.listen or config.tls_enabled:
        return None
    loopback = is_loopback_host(config.listen.rpartition(":")[0])
    who = "any local user" if loopback else "anyone who can reach this address"
    return (f"insecure_listen: serving {config.listen} WITHOUT mTLS: {who} can read, "
            "overwrite and delete checkpoints and pose as a peer; set tls_cert/tls_key/tls_ca")
