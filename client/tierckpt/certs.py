"""``tierckpt certs``: a cluster CA, node certificates and client certificates for tierckptd's mTLS.

One CA signs every certificate. A certificate carries its **role** as a URI subject alternative
name: ``tierckpt://node/<id>`` (``certs node``) or ``tierckpt://client/<name>`` (``certs
client``). Daemons serve the Peer service and the bulk channel to node certificates only, for
the node id in that URI; a client certificate (a trainer, an operator's CLI) reaches only the
Tierckpt service, limited by ``client_jobs``. A certificate without a role URI (made by
releases before roles) is a client as far as the Peer service is concerned.

A node certificate also names its node id as the CN and a DNS SAN, plus the names and addresses
peers dial it by (``--san``); it serves as both server and client certificate (extended key usage
serverAuth + clientAuth). A client certificate has the name as CN and clientAuth only, so it
cannot serve as a daemon's certificate either. Keys are ECDSA P-256, signed with SHA-256.

Files (the daemon's ``tls_cert``/``tls_key``/``tls_ca``)::

    CA_DIR/ca.pem  CA_DIR/ca.key          make_ca: keep ca.key off the nodes
    OUT/node.pem   OUT/node.key  OUT/ca.pem   make_node_cert: copy OUT to /etc/tierckpt/tls/
    OUT/client.pem OUT/client.key OUT/ca.pem  make_client_cert: tierckpt.Client(tls_cert=..., ...)

Keys are written 0600 and never replace an existing key unless ``force=True``; certificates
are 0644. Every file is published by rename, so a running daemon that re-reads its files on
change (rotation) never sees half a file.

``cryptography`` is not a dependency of the thin client: it is imported when a function here
runs, with an error that says ``pip install 'tierckpt[certs]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

from .common.names import check_node
from .errors import AlreadyExistsError, InvalidArgumentError, TierckptError

__all__ = ["CertFiles", "MissingExtraError", "NODE_URI", "CLIENT_URI", "make_ca", "make_client_cert", "make_node_cert",
           "register"]

CA_CERT, CA_KEY = "ca.pem", "ca.key"
NODE_CERT, NODE_KEY = "node.pem", "node.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
NODE_URI = "tierckpt://node/"
"""Role marker of a node certificate: this prefix and the node id, as a URI SAN."""
CLIENT_URI = "tierckpt://client/"
"""Role marker of a client certificate: this prefix and the client's name, as a URI SAN."""


class MissingExtraError(TierckptError, ImportError):
    """``cryptography`` is not installed; the message names the extra to install."""


@dataclasses.dataclass(frozen=True)
class CertFiles:
    """Paths written by :func:`make_ca` or :func:`make_node_cert`."""

    cert: Path
    key: Path
    ca: Path  # the CA certificate (for make_ca: the same as cert)


def _crypto() -> SimpleNamespace:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise MissingExtraError(f"tierckpt certs needs cryptography, which cannot be imported ({e}); "
                                "install it with: pip install 'tierckpt[certs]'") from e
    return SimpleNamespace(x509=x509, hashes=hashes, serialization=serialization, ec=ec,
                           EKU=ExtendedKeyUsageOID, NameOID=NameOID)


def _check_days(days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 36500:
        raise InvalidArgumentError(f"days: {days!r} must be an integer in [1, 36500]")
    return days


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a temporary name with ``mode`` from the start, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # the umask may have cleared bits of a 0644 certificate
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _refuse_existing_key(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise AlreadyExistsError(f"{path} exists; refusing to replace a private key (use --force)")


def _out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(mode=0o750, parents=True, exist_ok=True)
    return out


def _pem_key(c: SimpleNamespace, key: Any) -> bytes:
    s = c.serialization
    return key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())


def _san(c: SimpleNamespace, name: str) -> Any:
    try:
        return c.x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    label = name.rstrip(".")
    if not label or len(label) > 253 or any(not p or len(p) > 63 for p in label.split(".")) or not all(
            ch.isalnum() or ch in "-.*" for ch in label):
        raise InvalidArgumentError(f"san: {name!r} is neither an IP address nor a DNS name")
    return c.x509.DNSName(label)


def make_ca(out_dir: str | os.PathLike, *, name: str = "tierckpt cluster CA", days: int = 3650,
            force: bool = False) -> CertFiles:
    """Create the cluster CA: ``out_dir/ca.pem`` (0644) and ``out_dir/ca.key`` (0600).

    Args:
        out_dir: Directory to write to (created 0750 if missing).
        name: The CA's common name.
        days: Validity in days.
        force: Replace an existing ``ca.key`` (every node certificate must then be reissued).

    Returns:
        The paths written.

    Raises:
        AlreadyExistsError: ``ca.key`` exists and ``force`` is false.
        InvalidArgumentError: ``name`` is empty or ``days`` is out of range.
        MissingExtraError: ``cryptography`` is not installed.
    """
    if not name or not isinstance(name, str):
        raise InvalidArgumentError("name: must be a non-empty string")
    days = _check_days(days)
    c = _crypto()
    out = _out_dir(out_dir)
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    _refuse_existing_key(key_path, force)
    key = c.ec.generate_private_key(c.ec.SECP256R1())
    subject = c.x509.Name([c.x509.NameAttribute(c.NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    x = c.x509
    cert = (x.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                      data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                      crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, c.hashes.SHA256()))
    _write(key_path, _pem_key(c, key), 0o600)
    _write(cert_path, cert.public_bytes(c.serialization.Encoding.PEM), 0o644)
    return CertFiles(cert_path, key_path, cert_path)


def make_node_cert(ca_dir: str | os.PathLike, node_id: str, out_dir: str | os.PathLike, *,
                   sans: Iterable[str] = (), days: int = 365, force: bool = False) -> CertFiles:
    """Issue a node certificate signed by the CA in ``ca_dir``.

    Writes ``out_dir/node.pem`` (0644), ``out_dir/node.key`` (0600) and a copy of the CA
    certificate, ``out_dir/ca.pem`` (0644): the three files of ``tls_cert``, ``tls_key`` and
    ``tls_ca``.

    Args:
        ca_dir: Directory holding ``ca.pem`` and ``ca.key`` (from :func:`make_ca`).
        node_id: The node's id (``--node-id``): the certificate's CN and first DNS SAN.
        out_dir: Directory to write to (created 0750 if missing).
        sans: More subject alternative names: the host names and IP addresses peers dial the
            node by (the HOST of ``--peers``, the name of ``--peers-dns``).
        days: Validity in days.
        force: Replace an existing ``node.key``.

    Returns:
        The paths written.

    Raises:
        AlreadyExistsError: ``node.key`` exists and ``force`` is false.
        InvalidArgumentError: Bad node id, SAN or days; the CA files are missing or unusable.
        MissingExtraError: ``cryptography`` is not installed.
    """
    check_node(node_id, "node_id")
    if len(node_id) > 64:
        raise InvalidArgumentError(f"node_id: {node_id!r} is longer than a certificate's CN allows (64)")
    days = _check_days(days)
    c = _crypto()
    x = c.x509
    names = [x.UniformResourceIdentifier(NODE_URI + node_id), x.DNSName(node_id)]  # role + binding name
    for s in sans:
        san = _san(c, str(s).strip())
        if san not in names:
            names.append(san)
    ca_pem, ca_cert, ca_key = _load_ca(c, Path(ca_dir))
    out = _out_dir(out_dir)
    cert_path, key_path, ca_copy = out / NODE_CERT, out / NODE_KEY, out / CA_CERT
    _refuse_existing_key(key_path, force)
    key = c.ec.generate_private_key(c.ec.SECP256R1())
    cert = _leaf_certificate(c, node_id, names, key, ca_cert, ca_key, days, [c.EKU.SERVER_AUTH, c.EKU.CLIENT_AUTH])
    # Key first: a daemon re-reading its files sees the new pair once the certificate lands.
    _write(key_path, _pem_key(c, key), 0o600)
    _write(cert_path, cert.public_bytes(c.serialization.Encoding.PEM), 0o644)
    _write(ca_copy, ca_pem, 0o644)
    return CertFiles(cert_path, key_path, ca_copy)


def _load_ca(c: Any, ca_dir: Path) -> tuple[bytes, Any, Any]:
    """(ca.pem bytes, CA certificate, CA key) from a directory made by :func:`make_ca`."""
    x = c.x509
    try:
        ca_pem = (ca_dir / CA_CERT).read_bytes()
        ca_cert = x.load_pem_x509_certificate(ca_pem)
        ca_key = c.serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except OSError as e:
        raise InvalidArgumentError(f"ca: cannot read {e.filename}: {e.strerror} "
                                   "(create it with: tierckpt certs ca)") from None
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"ca: {ca_dir} does not hold a usable CA ({e})") from None
    return ca_pem, ca_cert, ca_key


def make_client_cert(ca_dir: str | os.PathLike, name: str, out_dir: str | os.PathLike, *, days: int = 365,
                     force: bool = False) -> CertFiles:
    """Issue a client certificate (a trainer or an operator reaching daemons over TCP).

    Writes ``out_dir/client.pem`` (0644), ``out_dir/client.key`` (0600) and ``out_dir/ca.pem``.
    The certificate's CN is ``name`` (what ``client_jobs`` matches), its role URI SAN
    ``tierckpt://client/<name>``, its extended key usage clientAuth only: daemons refuse it on
    the Peer service and the bulk channel.

    Raises:
        AlreadyExistsError: ``client.key`` exists and ``force`` is false.
        InvalidArgumentError: Bad name or days; the CA files are missing or unusable.
        MissingExtraError: ``cryptography`` is not installed.
    """
    try:
        check_node(name, "name")
    except InvalidArgumentError:
        raise InvalidArgumentError(f"name: {name!r} must be letters, digits, '.', '_' or '-' (a client name such as "
                                   "trainer-a)") from None
    if len(name) > 64:
        raise InvalidArgumentError(f"name: {name!r} is longer than a certificate's CN allows (64)")
    days = _check_days(days)
    c = _crypto()
    ca_pem, ca_cert, ca_key = _load_ca(c, Path(ca_dir))
    out = _out_dir(out_dir)
    cert_path, key_path, ca_copy = out / CLIENT_CERT, out / CLIENT_KEY, out / CA_CERT
    _refuse_existing_key(key_path, force)
    key = c.ec.generate_private_key(c.ec.SECP256R1())
    cert = _leaf_certificate(c, name, [c.x509.UniformResourceIdentifier(CLIENT_URI + name)], key, ca_cert, ca_key,
                             days, [c.EKU.CLIENT_AUTH])
    _write(key_path, _pem_key(c, key), 0o600)
    _write(cert_path, cert.public_bytes(c.serialization.Encoding.PEM), 0o644)
    _write(ca_copy, ca_pem, 0o644)
    return CertFiles(cert_path, key_path, ca_copy)


def _leaf_certificate(c: Any, cn: str, names: list, key: Any, ca_cert: Any, ca_key: Any, days: int,
                      eku: list) -> Any:
    """A node or client certificate: the CN, the SANs, the extended key usages, signed by the CA."""
    x = c.x509
    now = datetime.datetime.now(datetime.UTC)
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x.SubjectKeyIdentifier).value
    usage = x.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                       data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                       encipher_only=False, decipher_only=False)
    return (x.CertificateBuilder()
            .subject_name(x.Name([x.NameAttribute(c.NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(x.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x.ExtendedKeyUsage(eku), critical=False)
            .add_extension(x.SubjectAlternativeName(names), critical=False)
            .add_extension(x.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, c.hashes.SHA256()))


# -- command line ---------------------------------------------------------------------------------

def cmd_ca(args: argparse.Namespace, out: TextIO) -> int:
    files = make_ca(args.out, name=args.name, days=args.days, force=args.force)
    out.write(f"CA certificate {files.cert}\nCA key         {files.key}  (0600; keep it off the nodes)\n")
    return 0


def cmd_node(args: argparse.Namespace, out: TextIO) -> int:
    sans = [s for item in args.san for s in item.split(",") if s.strip()]
    files = make_node_cert(args.ca, args.node_id, args.out, sans=sans, days=args.days, force=args.force)
    out.write(f"tls_cert = \"{files.cert}\"\ntls_key = \"{files.key}\"\ntls_ca = \"{files.ca}\"\n")
    return 0


def cmd_client(args: argparse.Namespace, out: TextIO) -> int:
    files = make_client_cert(args.ca, args.name, args.out, days=args.days, force=args.force)
    out.write(f"tls_cert = \"{files.cert}\"\ntls_key = \"{files.key}\"\ntls_ca = \"{files.ca}\"\n")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``certs ca``, ``certs node`` and ``certs client`` to the ``tierckpt`` command line.

    Each sub-command sets ``fn(args, out) -> exit code``, like the CLI's other commands; errors
    are :class:`~tierckpt.errors.TierckptError` subclasses (bad input:
    :class:`~tierckpt.errors.InvalidArgumentError`).

    Args:
        subparsers: The object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The ``certs`` parser.
    """
    p = subparsers.add_parser("certs", help="create the cluster CA, node and client certificates for mTLS "
                                            "(needs [certs])",
                              description="Create a cluster CA, per-node certificates (role: node; the Peer service "
                                          "and bulk channel) and client certificates (role: client; the Tierckpt "
                                          "service only) for tierckptd's mTLS. Keys are written 0600 and never "
                                          "replaced without --force.",
                              epilog="examples:\n  tierckpt certs ca --out /root/tierckpt-ca\n"
                                     "  tierckpt certs node --ca /root/tierckpt-ca --node-id gpu-017 "
                                     "--out /etc/tierckpt/tls --san gpu-017.cluster.local\n"
                                     "  tierckpt certs client --ca /root/tierckpt-ca --name trainer-a "
                                     "--out ./trainer-a",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="certs_command", required=True, metavar="ca|node|client")
    s = sub.add_parser("ca", help="create the cluster CA (ca.pem, ca.key)")
    s.add_argument("--out", required=True, metavar="DIR", help="directory for ca.pem and ca.key")
    s.add_argument("--name", default="tierckpt cluster CA", metavar="NAME", help="the CA's common name")
    s.add_argument("--days", type=int, default=3650, metavar="N", help="validity in days (default 3650)")
    s.add_argument("--force", action="store_true", help="replace an existing ca.key")
    s.set_defaults(fn=cmd_ca)
    s = sub.add_parser("node", help="issue a node certificate (node.pem, node.key, ca.pem; role node)")
    s.add_argument("--ca", required=True, metavar="DIR", help="directory holding ca.pem and ca.key")
    s.add_argument("--node-id", required=True, metavar="ID", help="the node's --node-id (CN and DNS SAN)")
    s.add_argument("--out", required=True, metavar="DIR", help="directory for node.pem, node.key and ca.pem")
    s.add_argument("--san", action="append", default=[], metavar="NAME|IP",
                   help="another DNS name or IP address peers dial this node by (repeatable, or comma-separated)")
    s.add_argument("--days", type=int, default=365, metavar="N", help="validity in days (default 365)")
    s.add_argument("--force", action="store_true", help="replace an existing node.key")
    s.set_defaults(fn=cmd_node)
    s = sub.add_parser("client", help="issue a client certificate (client.pem, client.key, ca.pem)")
    s.add_argument("--ca", required=True, metavar="DIR", help="directory holding ca.pem and ca.key")
    s.add_argument("--name", required=True, metavar="NAME", help="the client's name (CN; what client_jobs matches)")
    s.add_argument("--out", required=True, metavar="DIR", help="directory for client.pem, client.key and ca.pem")
    s.add_argument("--days", type=int, default=365, metavar="N", help="validity in days (default 365)")
    s.add_argument("--force", action="store_true", help="replace an existing client.key")
    s.set_defaults(fn=cmd_client)
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``python -m tierckpt.certs ...``: the same commands without the rest of the CLI."""
    import sys

    parser = argparse.ArgumentParser(prog="tierckpt")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.fn(args, out or sys.stdout)
    except InvalidArgumentError as e:
        print(f"tierckpt: error: {e}", file=sys.stderr)
        return 2
    except TierckptError as e:
        print(f"tierckpt: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"tierckpt: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
