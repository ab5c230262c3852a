"""Scraping a daemon's /metrics (Prometheus text format): the one helper every test uses."""

from __future__ import annotations

import urllib.request

__all__ = ["scrape", "scrape_text", "value"]


def scrape_text(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> str:
    """The body of ``GET http://host:port/metrics`` (which must answer 200)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        assert resp.status == 200, resp.status
        return resp.read().decode()


def parse(text: str) -> dict[str, float]:
    """Each sample of an exposition by its series, as printed: ``name{label="v",...}`` -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, val = line.rpartition(" ")
            out[series] = float(val)
    return out


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> dict[str, float]:
    """Every sample of the daemon's /metrics by series (see :func:`parse`)."""
    return parse(scrape_text(port, host, timeout))


def value(port: int, series: str, default: float = 0.0) -> float:
    """One series' value (``default`` when the daemon does not export it)."""
    return scrape(port).get(series, default)
