"""Revocation that takes effect without a restart: the deny-list of certificate names.

``tls_deny`` names a file with one certificate name per line (a CN, a DNS SAN, or the node id or
client name of a role URI; ``#`` starts a comment). It is re-read when it changes (mtime, size or
inode, looked at no more than every :data:`POLL` seconds), like the TLS files. A denied name is
refused on every gRPC call over TCP (both services: an open connection gets PERMISSION_DENIED
on its next call) and on the bulk channel (its open connections are closed within a second).

A change of the CA or of this node's certificate (:class:`tierckptd.tls.TlsReloader`) closes
the bulk connections authenticated before it; gRPC connections are closed by their maximum age
(``KNOBS.max_connection_age`` plus ``KNOBS.max_connection_age_grace``) and must then handshake
again under the new files.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from tierckpt.errors import PermissionDeniedError

from .config import ConfigError, DaemonConfig

__all__ = ["DenyList", "POLL", "check_names", "deny_list"]

log = logging.getLogger(__name__)

POLL = 0.5
"""Seconds between two looks at the deny-list file."""


def _parse(text: str) -> frozenset[str]:
    names = set()
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.add(name)
    return frozenset(names)


class DenyList:
    """The names in ``path``, re-read when the file changes.

    Raises:
        ConfigError: the file cannot be read at start-up (naming ``tls_deny``). Later read
            failures are logged once and the previous names stay in force.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._checked = 0.0
        self._sig = self._stat()
        try:
            with open(path, encoding="utf-8") as fh:
                self._names = _parse(fh.read())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"tls_deny: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        self.version = 1

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (0, 0, 0)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def names(self) -> frozenset[str]:
        """The denied names now (re-read first if the file changed)."""
        now = time.monotonic()
        if now - self._checked < POLL:
            return self._names
        with self._lock:
            self._checked = now
            sig = self._stat()
            if sig == self._sig:
                return self._names
            self._sig = sig
            try:
                with open(self.path, encoding="utf-8") as fh:
                    names = _parse(fh.read())
            except (OSError, UnicodeDecodeError) as e:
                log.error("tls_deny: cannot read %s (%s); still denying %d names", self.path, e, len(self._names))
                return self._names
            if names != self._names:
                self._names, self.version = names, self.version + 1
                log.warning("tls_deny: %s reloaded: %d certificate names denied", self.path, len(names))
            return self._names


_lists: dict[str, DenyList] = {}
_lists_lock = threading.Lock()


def deny_list(config: DaemonConfig) -> DenyList | None:
    """The process's :class:`DenyList` for ``config.tls_deny`` (None when unset)."""
    if not config.tls_deny:
        return None
    with _lists_lock:
        d = _lists.get(config.tls_deny)
        if d is None:
            d = _lists[config.tls_deny] = DenyList(config.tls_deny)
        return d


def check_names(config: DaemonConfig, names: set[str]) -> None:
    """PermissionDeniedError if any of a certificate's ``names`` is on the deny-list."""
    d = deny_list(config)
    if d is None:
        return
    hit = sorted(names & d.names())
    if hit:
        raise PermissionDeniedError(f"certificate {', '.join(hit)} is denied (tls_deny)")
