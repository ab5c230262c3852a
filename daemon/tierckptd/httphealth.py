"""HTTP health endpoints on the metrics port: ``/healthz`` (liveness) and ``/readyz`` (readiness).

The Kubernetes probes ask these with ``httpGet`` instead of running a Python interpreter that
imports grpc on every probe (~7% of a core per node at the shipped periods). They answer from
state the event loop keeps, never by calling into it, so a probe cannot queue behind work:

- ``/readyz``: 200 ``ready`` from the moment the daemon is serving (the local tier scanned, the
  listeners up: when it prints READY) until shutdown starts, 503 before and after. This is the
  gRPC health service's overall status (``""``); a degraded persistent tier does not fail it.
- ``/healthz``: 200 ``alive`` while the event loop has run its heartbeat within
  ``KNOBS.health_stale_after`` seconds, 503 naming how long ago otherwise (a stuck loop: the
  kubelet restarts the pod). Before the first heartbeat (start-up, a long scan) it is 200: the
  startup probe asks ``/readyz``.

Everything else goes to the wrapped app (``/metrics``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .knobs import KNOBS

__all__ = ["HealthState", "health_app", "heartbeat_loop"]


class HealthState:
    """Readiness and the loop's last heartbeat, shared by the loop (writer) and the HTTP threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._beat: float | None = None

    def set_ready(self, ready: bool) -> None:
        with self._lock:
            self._ready = ready

    def beat(self) -> None:
        with self._lock:
            self._beat = time.monotonic()

    def ready(self) -> bool:
        with self._lock:
            return self._ready

    def stalled_for(self) -> float | None:
        """Seconds since the last heartbeat when that is too long ago, else None."""
        with self._lock:
            beat = self._beat
        if beat is None:
            return None
        age = time.monotonic() - beat
        return age if age > KNOBS.health_stale_after else None


async def heartbeat_loop(state: HealthState) -> None:
    """Beat every ``KNOBS.health_beat_interval`` seconds until cancelled."""
    while True:
        state.beat()
        await asyncio.sleep(KNOBS.health_beat_interval)


def health_app(state: HealthState, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app answering ``/healthz`` and ``/readyz`` from ``state``, the rest from ``app``."""

    def answer(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/readyz":
            ok = state.ready()
            body = b"ready\n" if ok else b"not ready: starting or shutting down\n"
        elif path == "/healthz":
            stalled = state.stalled_for()
            ok = stalled is None
            body = b"alive\n" if ok else f"event loop stalled for {stalled:.0f}s\n".encode()
        else:
            return app(environ, start_response)
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                        ("Cache-Control", "no-store")])
        return [body]

    return answer
