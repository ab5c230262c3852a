"""Metrics registry contents and the /metrics HTTP endpoint."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tierckptd.metrics import Metrics

from .metrics_scrape import scrape, scrape_text

EXPECTED = {
    # name as exposed: (type, labels)
    "tierckpt_saved_bytes_total": ("counter", {"tier"}),
    "tierckpt_shared_bytes_total": ("counter", {"tier"}),
    "tierckpt_saves_total": ("counter", {"tier", "result"}),
    "tierckpt_restored_bytes_total": ("counter", {"tier"}),
    "tierckpt_restores_total": ("counter", {"tier", "result"}),
    "tierckpt_parity_rebuild_bulk_bytes_total": ("counter", set()),
    "tierckpt_parity_decode_bulk_bytes_total": ("counter", set()),
    "tierckpt_commit_latency_seconds": ("histogram", set()),
    "tierckpt_save_latency_seconds": ("histogram", set()),
    "tierckpt_restore_latency_seconds": ("histogram", {"tier"}),
    "tierckpt_replication_latency_seconds": ("histogram", set()),
    "tierckpt_replication_lag_seconds": ("gauge", set()),
    "tierckpt_replication_failures_total": ("counter", {"peer"}),
    "tierckpt_drain_backlog_bytes": ("gauge", set()),
    "tierckpt_drain_oldest_age_seconds": ("gauge", set()),
    "tierckpt_drain_failures_total": ("counter", set()),
    "tierckpt_drained_bytes_total": ("counter", set()),
    "tierckpt_local_capacity_bytes": ("gauge", set()),
    "tierckpt_local_used_bytes": ("gauge", set()),
    "tierckpt_local_free_bytes": ("gauge", set()),
    "tierckpt_local_warm_bytes": ("gauge", set()),
    "tierckpt_checksum_failures_total": ("counter", {"tier"}),
    "tierckpt_evictions_total": ("counter", {"reason"}),
    "tierckpt_peer_up": ("gauge", {"peer"}),
    "tierckpt_staging_reclaimed_total": ("counter", set()),
    "tierckpt_local_quarantined_total": ("counter", set()),
}


def _exercise(m: Metrics) -> None:
    for tier in ("local", "peer", "persistent"):
        m.restore_latency.labels(tier).observe(0.002)
    m.replication_failures.labels("node1").inc()
    m.peer_up.labels("node1").set(1)


def _samples(text: str) -> dict[str, tuple[str, set[str]]]:
    """Exposed sample name (counters with _total) -> (type, label names)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, labels)
    return out


def test_registry_has_every_metric_with_help_and_labels() -> None:
    m = Metrics()
    _exercise(m)
    text = m.render().decode()
    found = _samples(text)
    for name, want in EXPECTED.items():
        assert found.get(name) == want, name
        assert "# HELP %s " % name in text
    # Known label values exist at zero before anything happens.
    assert 'tierckpt_saves_total{result="error",tier="persistent"} 0.0' in Metrics().render().decode()
    assert 'tierckpt_evictions_total{reason="capacity_undrained"} 0.0' in text


def test_instances_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.saved_bytes.labels("local").inc(4096)
    a.set_local_usage(capacity=1000, used=1200)
    assert 'tierckpt_saved_bytes_total{tier="local"} 4096.0' in a.render().decode()
    assert 'tierckpt_saved_bytes_total{tier="local"} 0.0' in b.render().decode()
    assert "tierckpt_local_free_bytes 0.0" in a.render().decode()


def test_histogram_buckets_span_ms_to_minutes() -> None:
    m = Metrics()
    m.commit_latency.observe(0.0015)
    text = m.render().decode()
    assert 'tierckpt_commit_latency_seconds_bucket{le="0.001"} 0.0' in text
    assert 'tierckpt_commit_latency_seconds_bucket{le="0.0025"} 1.0' in text
    assert 'tierckpt_commit_latency_seconds_bucket{le="600.0"}' in text


def test_http_server_serves_metrics_on_free_port() -> None:
    m = Metrics()
    port = m.start_http_server("127.0.0.1", 0)
    try:
        assert port > 0
        m.drain_backlog_bytes.set(123)
        assert scrape(port)["tierckpt_drain_backlog_bytes"] == 123
        assert "tierckpt_drain_backlog_bytes 123.0" in scrape_text(port)
    finally:
        m.stop()
    m.stop()  # idempotent
    with pytest.raises(OSError):  # the server no longer answers after stop()
        scrape_text(port)
