"""The CLI's connection to a daemon: where the address came from, and what to say when it fails.

A transport failure before the daemon has answered once (nothing listening, no socket, a
listener that never answers within ``--timeout``) becomes :class:`DaemonUnreachable`, which the
CLI reports with the address, where it came from and what to check, and exit status 3. After
the daemon has answered, an ``UNAVAILABLE`` is the daemon reporting something it needs (a peer,
the object store) and keeps its own message and exit status 1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..client import DEFAULT_ADDRESS, Client
from ..errors import DeadlineExceededError, InvalidArgumentError, UnavailableError

__all__ = ["DaemonUnreachable", "Session", "resolve_address"]

T = TypeVar("T")
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def resolve_address(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """Returns ``(address, source)``: the flag, else ``$TIERCKPT_ADDRESS``, else the default.

    Raises:
        InvalidArgumentError: the address is neither ``unix:PATH`` nor ``HOST:PORT``; the
            message names the flag or variable it came from.
    """
    if flag:
        address, source = flag, "--address"
    elif environ.get("TIERCKPT_ADDRESS"):
        address, source = environ["TIERCKPT_ADDRESS"], "$TIERCKPT_ADDRESS"
    else:
        address, source = DEFAULT_ADDRESS, "the default address"
    bad = InvalidArgumentError(f"{source if source != 'the default address' else '--address'}: {address!r} is not "
                               "unix:///PATH or HOST:PORT")
    if address.startswith("unix:"):
        if not _unix_path(address):
            raise bad
    elif not address.startswith(_SCHEMES):
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or re.search(r"\s", address):
            raise bad
    return address, source


def _unix_path(address: str) -> str:
    """``unix:///run/x.sock`` and ``unix:/run/x.sock`` -> ``/run/x.sock``; ``unix:rel.sock`` -> ``rel.sock``."""
    rest = address[len("unix:"):]
    return "/" + rest.lstrip("/") if rest.startswith("/") else rest


class DaemonUnreachable(Exception):
    """The daemon could not be reached or did not answer; ``str()`` is the error, ``hint`` what to check."""

    def __init__(self, address: str, source: str, timeout: float, cause: Exception) -> None:
        self.address, self.source, self.timeout, self.cause = address, source, timeout, cause
        where = f"tierckptd at {address} (from {source})"
        if isinstance(cause, DeadlineExceededError):
            super().__init__(f"{where} did not answer within {timeout:g} s (--timeout)")
            self.hint = ("something accepts connections there but does not answer: check that it is tierckptd "
                         "(and not another service on that port), that the daemon is not stopped or overloaded "
                         "(systemctl status tierckptd; its log), or give a longer --timeout")
            return
        if address.startswith("unix:"):
            path = _unix_path(address)
            if not os.path.exists(path):
                why = f"no socket at {path}"
            elif not os.access(path, os.R_OK | os.W_OK):
                why = f"permission denied on {path}"
            else:
                why = f"nothing accepts connections on {path} (a socket left by a daemon that is gone?)"
            super().__init__(f"cannot reach {where}: {why}")
            self.hint = ("check that tierckptd is running on this node (systemctl status tierckptd), that its "
                         "--socket is this path, and that your user may open it (a member of socket_group; "
                         "socket_mode 0660); or point --address or $TIERCKPT_ADDRESS at the daemon "
                         "(unix:///PATH or HOST:PORT)")
        else:
            detail = _grpc_detail(str(cause))
            super().__init__(f"cannot reach {where}" + (f": {detail}" if detail else ""))
            self.hint = ("check that tierckptd is running there and listening on this HOST:PORT (its --listen), "
                         "that no firewall is in the way, or point --address or $TIERCKPT_ADDRESS at the daemon "
                         "(unix:///PATH for the daemon on this node)")


def _grpc_detail(message: str) -> str:
    """The useful end of a gRPC connect error: ``... last error: UNAVAILABLE: ipv4:...: Connection refused``."""
    m = re.search(r"(Connection refused|Connection reset[^;]*|No route to host|Name or service not known|"
                  r"DNS resolution failed[^;]*|Socket closed|Connection timed out|Network is unreachable)", message)
    return m.group(1).lower() if m else ""


class Session:
    """One CLI invocation's daemon: the client, its address, and whether the daemon has answered yet."""

    def __init__(self, address_flag: str | None, timeout: float, environ: Mapping[str, str]) -> None:
        self.address, self.source = resolve_address(address_flag, environ)
        self.timeout = timeout
        self.answered = False
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, timeout=self.timeout)
        return self._client

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Calls ``fn``; a transport failure before the daemon's first answer raises :class:`DaemonUnreachable`."""
        try:
            result = fn(*args, **kwargs)
        except (UnavailableError, DeadlineExceededError) as e:
            if self.answered:
                raise
            raise DaemonUnreachable(self.address, self.source, self.timeout, e) from e
        self.answered = True
        return result

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
