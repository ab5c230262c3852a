"""Manifest signing: an HMAC-SHA256 over every field of a manifest, with the cluster's manifest key.

A manifest is the commit marker of every tier and the only thing that says what a step holds
(checksums, sizes, dtypes, shapes, metadata, owner, world size). Whoever can write the object
store, or a trainer in the socket group who can write the local dir, could otherwise forge or
edit one. With ``manifest_key_file`` set, every manifest this daemon writes (local, replica,
persistent) carries ``"mac"``: HMAC-SHA256 (hex) of the manifest's canonical JSON without that
field (keys sorted, no spaces: what :meth:`.manifest.Manifest.to_json` writes), and every
manifest it reads must carry a matching one: a forged or edited manifest, or one made with
another key, is :class:`~tierckpt.errors.DataLossError` wherever it is parsed (restore, replica
receipt, the local start-up scan, the persistent catalog, ``verify``, retention and garbage
collection), so it is never restored nor counted. The key is one secret shared by the nodes of a
cluster (a file distributed like the certificates, never put in the bucket). A manifest without
a MAC (written before signing was turned on) is refused too, unless ``accept_unsigned_manifests``
says otherwise; ``verify`` reports such copies.

Without a key (the embedded default of a single machine) manifests are written and read
unsigned, and the daemon says so at start-up: the checksums then catch corruption, not forgery.

The key is process-wide state, set once at start-up by :func:`configure` (tests set and reset it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

from tierckpt.errors import DataLossError

__all__ = ["ManifestKey", "configure", "active", "load_key", "MIN_KEY_BYTES", "MAC_FIELD"]

MIN_KEY_BYTES = 32
MAC_FIELD = "mac"


@dataclass(frozen=True)
class ManifestKey:
    """The key manifests are signed with (None: unsigned), and whether unsigned ones are read."""

    key: bytes | None = None
    accept_unsigned: bool = True

    @property
    def signing(self) -> bool:
        return self.key is not None

    def mac(self, body: bytes) -> str:
        """The hex MAC of a canonical manifest body (without the mac field)."""
        assert self.key is not None
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def check(self, mac: object, body: bytes) -> bool:
        """Whether a manifest with this ``mac`` (None when absent) and canonical ``body`` is signed.

        Raises:
            DataLossError: the MAC does not match (forged, edited, or another cluster's key), or
                the manifest is unsigned and unsigned manifests are refused.
        """
        if mac is None:
            if self.key is not None and not self.accept_unsigned:
                raise DataLossError("manifest is not signed (written before manifest_key_file was set, or forged); "
                                    "accept_unsigned_manifests reads such steps")
            return False
        if not isinstance(mac, str) or len(mac) != 64:
            raise DataLossError("manifest.mac is not an HMAC-SHA256 in hex")
        if self.key is None:
            return False  # cannot be checked here: treated as unsigned (this node has no key)
        if not hmac.compare_digest(mac, self.mac(body)):
            raise DataLossError("manifest signature does not match: it was edited or forged, or signed with "
                                "another cluster's manifest key")
        return True


_active = ManifestKey()


def configure(key: ManifestKey) -> None:
    """Make ``key`` the one every manifest of this process is written and read with."""
    global _active  # noqa: PLW0603 (process-wide by design: one daemon, one cluster key)
    _active = key


def active() -> ManifestKey:
    return _active


def load_key(path: str, key_name: str = "manifest_key_file") -> bytes:
    """Read a manifest key file: at least 32 bytes (raw, or hex/base64 text: the bytes as they are
    after stripping surrounding whitespace), not readable by others.

    Raises:
        ValueError: naming ``key_name``, when the file is missing, too short, or world-readable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{key_name}: cannot open {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{key_name}: {path} is not a regular file")
        if st.st_mode & stat.S_IROTH:
            raise ValueError(f"{key_name}: {path} is readable by others (chmod o-r: it is the cluster's secret)")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_KEY_BYTES:
        raise ValueError(f"{key_name}: {path} holds {len(data)} bytes; a key needs at least {MIN_KEY_BYTES} "
                         "(head -c 32 /dev/urandom | base64 > FILE)")
    return data
