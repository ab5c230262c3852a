"""/healthz and /readyz (tierckptd.httphealth): the answers for each state, through the same
bounded HTTP server the daemon runs (a real socket), with the state set by the test."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from tierckptd.knobs import KNOBS
from tierckptd.metrics import Metrics


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def served():
    m = Metrics()
    port = m.start_http_server("127.0.0.1", 0)
    yield m, port
    m.stop()


def test_ready_only_while_serving(served) -> None:
    m, port = served
    assert _get(port, "/readyz") == (503, b"not ready: starting or shutting down\n")
    m.health.set_ready(True)
    assert _get(port, "/readyz") == (200, b"ready\n")
    m.health.set_ready(False)  # shutdown started
    assert _get(port, "/readyz")[0] == 503
    assert b"tierckpt_build_info" in _get(port, "/metrics")[1]


def test_alive_until_the_loop_stops_beating(served, monkeypatch) -> None:
    m, port = served
    assert _get(port, "/healthz") == (200, b"alive\n")  # before the first beat: start-up
    monkeypatch.setattr(KNOBS, "health_beat_interval", 0.05)
    monkeypatch.setattr(KNOBS, "health_stale_after", 0.3)

    async def beat_then_stall() -> None:
        from tierckptd.httphealth import heartbeat_loop

        task = asyncio.create_task(heartbeat_loop(m.health))
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(_get, port, "/healthz") == (200, b"alive\n")
        task.cancel()  # the loop stops beating (as a stuck loop would)

    asyncio.run(beat_then_stall())
    import time

    time.sleep(0.5)
    code, body = _get(port, "/healthz")
    assert code == 503 and body.startswith(b"event loop stalled for"), body
