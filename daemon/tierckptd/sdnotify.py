"""A minimal sd_notify(3) client: readiness, status, watchdog and stopping messages to systemd.

The protocol is one datagram of newline-separated ``KEY=VALUE`` assignments sent to the AF_UNIX
socket named by ``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket). Every call is a no-op
when the service was not started by systemd with ``Type=notify``. Send errors are logged and
swallowed: a missing supervisor must never take the daemon down.

Typical use::

    notifier = Notifier.from_env(os.environ)   # read once, at the edge
    ...                                        # bind listeners, scan the local tier
    notifier.ready("serving")
    task = asyncio.create_task(watchdog_loop(notifier, lambda: "3 jobs, 12 GiB local"))
    ...
    notifier.stopping()
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

__all__ = ["Notifier", "watchdog_loop"]

log = logging.getLogger("tierckptd.sdnotify")

_STATUS_ONLY_INTERVAL = 10.0
"""Seconds between STATUS refreshes when systemd set no watchdog."""


class Notifier:
    """Sends sd_notify messages to one socket; thread-safe (each message is a single datagram).

    Args:
        address: The ``$NOTIFY_SOCKET`` value (a path, or ``@name`` for an abstract socket), or
            None to make every method a no-op.
        watchdog_usec: ``$WATCHDOG_USEC``: the watchdog timeout in microseconds, or None.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self._address: str | None = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Notifier:
        """Build a notifier from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        Args:
            environ: The process environment (the caller passes ``os.environ``).

        Returns:
            A notifier; a disabled one when ``NOTIFY_SOCKET`` is unset or empty. The watchdog is
            ignored when ``WATCHDOG_PID`` names another process, as sd_watchdog_enabled(3) does.
        """
        usec_text = environ.get("WATCHDOG_USEC", "")
        pid_text = environ.get("WATCHDOG_PID", "")
        usec = int(usec_text) if usec_text.isdigit() else None
        if pid_text and (not pid_text.isdigit() or int(pid_text) != os.getpid()):
            usec = None
        return cls(environ.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        """Whether a notification socket is configured."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or None without a watchdog."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2e6

    def notify(self, **fields: str) -> bool:
        """Send one message of ``KEY=VALUE`` lines, e.g. ``notify(READY="1", STATUS="up")``.

        Returns:
            True if the datagram was sent; False when disabled or on a send error (logged).
        """
        if self._address is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._address)
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self._address.replace("\0", "@"), e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd start-up is complete (``READY=1``), optionally with a status line."""
        return self.notify(READY="1", **({"STATUS": _line(status)} if status else {}))

    def status(self, text: str) -> bool:
        """Set the free-form status shown by ``systemctl status`` (``STATUS=...``)."""
        return self.notify(STATUS=_line(text))

    def watchdog(self) -> bool:
        """Ping the service watchdog (``WATCHDOG=1``)."""
        return self.notify(WATCHDOG="1")

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd a graceful shutdown has begun (``STOPPING=1``)."""
        return self.notify(STOPPING="1", **({"STATUS": _line(status)} if status else {}))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time to start or stop (``EXTEND_TIMEOUT_USEC``), e.g. while scanning a large tier."""
        return self.notify(EXTEND_TIMEOUT_USEC=str(int(seconds * 1e6)))

    def close(self) -> None:
        """Close the socket; a later message reopens it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _line(text: str) -> str:
    # A newline would start a new assignment and could smuggle e.g. READY=1 into a status.
    return " ".join(str(text).splitlines())


async def watchdog_loop(notifier: Notifier, status_fn: Callable[[], str] | None = None) -> None:
    """Ping the watchdog at ``notifier.watchdog_interval()`` and refresh STATUS, until cancelled.

    The pings come from the event loop itself, so a blocked or wedged loop stops them and systemd
    restarts the daemon after ``WatchdogSec``. Without a watchdog, STATUS is still refreshed every
    10 seconds; with a disabled notifier the coroutine returns at once.

    Args:
        notifier: Where to send the messages.
        status_fn: Returns the current one-line status; called on the event loop, so it must be cheap.
    """
    if not notifier.enabled:
        return
    interval = notifier.watchdog_interval()
    while True:
        fields: dict[str, str] = {"WATCHDOG": "1"} if interval is not None else {}
        if status_fn is not None:
            try:
                fields["STATUS"] = _line(status_fn())
            except Exception:
                log.exception("watchdog status callback failed")
        if fields:
            notifier.notify(**fields)
        await asyncio.sleep(interval if interval is not None else _STATUS_ONLY_INTERVAL)
