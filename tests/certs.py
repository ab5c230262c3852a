"""Test certificates: one helper for every mTLS test, made the way operators make them
(``tierckpt certs``: :func:`tierckpt.certs.make_ca`, :func:`tierckpt.certs.make_node_cert` and
:func:`tierckpt.certs.make_client_cert`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

__all__ = ["LOOPBACK", "issue", "issue_client", "make_pki", "tls_args"]

LOOPBACK = ("localhost", "127.0.0.1")  # what a client on this machine dials


def make_pki(root: Path, nodes: Iterable[str], *, sans: Iterable[str] = LOOPBACK,
             ca_name: str = "tierckpt test CA") -> dict[str, dict[str, Path]]:
    """A CA in ``root/ca`` and, for each node id, a certificate it signed in ``root/<node>`` (CN and
    first DNS SAN the node id, then ``sans``): ``{node: {"cert", "key", "ca"}}``, the files of
    ``--tls-cert``, ``--tls-key`` and ``--tls-ca``."""
    from tierckpt.certs import make_ca

    make_ca(Path(root) / "ca", name=ca_name)
    return {node: issue(root, node, sans=sans) for node in nodes}


def issue(root: Path, node: str, *, sans: Iterable[str] = LOOPBACK) -> dict[str, Path]:
    """One more certificate from the CA of :func:`make_pki` at ``root``, in ``root/<node>``."""
    from tierckpt.certs import make_node_cert

    f = make_node_cert(Path(root) / "ca", node, Path(root) / node, sans=tuple(sans))
    return {"cert": f.cert, "key": f.key, "ca": f.ca}


def issue_client(root: Path, name: str) -> dict[str, Path]:
    """A client certificate (``tierckpt certs client``) from the CA at ``root``, in ``root/client-<name>``."""
    from tierckpt.certs import make_client_cert

    f = make_client_cert(Path(root) / "ca", name, Path(root) / f"client-{name}")
    return {"cert": f.cert, "key": f.key, "ca": f.ca}


def tls_args(files: dict[str, Path]) -> tuple[str, ...]:
    """The daemon flags for one node's files from :func:`make_pki`."""
    return ("--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]), "--tls-ca", str(files["ca"]))


def install(src: dict[str, Path], live: Path) -> None:
    """Replace the live key, cert and CA files the way an operator (or the kubelet) would: write
    aside, then rename (what the daemon's reload watches for)."""
    for name in ("key", "cert", "ca"):
        tmp = live / f".{name}.tmp"
        shutil.copyfile(src[name], tmp)
        tmp.chmod(0o600 if name == "key" else 0o644)
        os.replace(tmp, live / f"{name}.pem")
