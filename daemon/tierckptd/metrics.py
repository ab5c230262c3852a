"""Prometheus metrics of one daemon, in their own registry (tests may create several).

Naming follows Prometheus conventions: prefix ``tierckpt_``, base units in the name (``_bytes``,
``_seconds``), ``_total`` on counters. Label values are small closed sets:

- ``tier``: ``local``, ``peer``, ``persistent`` (:data:`TIERS`)
- ``result``: ``ok``, ``error`` (:data:`RESULTS`)
- ``reason``: ``retention``, ``capacity``, ``capacity_undrained`` (:data:`EVICTION_REASONS`)
- ``peer``: a peer's node id (bounded by the cluster size; never a job or step)

Series with known label values are created at zero, so ``rate()`` and alerts work from the first
scrape: tiers, results and reasons here, peers when the watched neighbourhood is known
(:meth:`Metrics.known_peers`), configured tiers by :class:`~tierckptd.tierhealth.TierHealth`.
The registry also carries the standard ``process_*``, ``python_info`` and ``python_gc_*``
collectors of prometheus-client.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)

from . import __version__
from .httphealth import HealthState

__all__ = ["Metrics", "TIERS", "RESULTS", "EVICTION_REASONS", "LATENCY_BUCKETS"]

TIERS = ("local", "peer", "persistent")
RESULTS = ("ok", "error")
EVICTION_REASONS = ("retention", "capacity", "capacity_undrained")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""1 ms .. 30 min: local commits are milliseconds, multi-GiB peer copies and uploads are minutes."""


class Metrics:
    """Every metric the daemon exports. Attributes are prometheus-client metric objects.

    Counters (``.inc(n)``; labelled ones via ``.labels(...)``):
        saved_bytes (tier), shared_bytes (tier), saves (tier, result), restored_bytes (tier), restores (tier, result),
        replication_failures (peer), drain_failures, drained_bytes, checksum_failures (tier),
        evictions (reason), staging_reclaimed, local_quarantined.
    Histograms (``.observe(seconds)`` or ``with h.time():``):
        commit_latency, save_latency, restore_latency (tier), replication_latency.
    Gauges (``.set(v)``):
        replication_lag, drain_backlog_bytes, drain_oldest_age, local_capacity_bytes,
        local_used_bytes, local_free_bytes, local_warm_bytes, local_reserve_bytes,
        local_reserve_taken_bytes, peer_up (peer), tier_up (tier).
    Collectors: process (CPU, memory, file descriptors), platform (python_info), GC.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build_info = Info("tierckpt_build", "Daemon version.", registry=r)
        self.build_info.info({"version": __version__})
        self._saves_and_restores(r)
        self._latencies(r)
        self._background_tiers(r)
        self._local_tier(r)
        self._zero_series()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._server: WSGIServer | None = None
        self.health = HealthState()  # /healthz and /readyz on the same port (tierckptd.httphealth)
        self._thread: threading.Thread | None = None

    def _saves_and_restores(self, r: CollectorRegistry) -> None:
        self.saved_bytes = Counter(
            "tierckpt_saved_bytes_total",
            "Shard bytes committed into a tier by this daemon: local = trainer saves committed here, "
            "peer = replicas acknowledged by peers, persistent = ranks whose manifest reached the object store.",
            ["tier"], registry=r)
        self.shared_bytes = Counter(
            "tierckpt_shared_bytes_total",
            "Shard bytes not copied because a committed file on this node already held them (unchanged "
            "shards): local = linked from the base step at BeginSave, peer = linked from a copy the receiver "
            "held when a replica was prepared (not sent over the bulk channel).",
            ["tier"], registry=r)
        self.parity_pulled_bytes = Counter(
            "tierckpt_parity_pulled_bytes_total",
            "Chunk bytes this node pulled from their owners to encode into the parity it protects "
            "(redundancy = parity:K+M).", registry=r)
        self.parity_linked_bytes = Counter(
            "tierckpt_parity_linked_bytes_total",
            "Chunk bytes this node protected without pulling them: their parity slot/row was linked from the "
            "base step, every member of it unchanged (redundancy = parity:K+M).", registry=r)
        self.saves = Counter(
            "tierckpt_saves_total",
            "Rank commits into a tier (local saves, peer replications, persistent drains) by result.",
            ["tier", "result"], registry=r)
        self.restored_bytes = Counter(
            "tierckpt_restored_bytes_total", "Shard bytes handed to restoring clients, by source tier.",
            ["tier"], registry=r)
        self.parity_rebuild_bulk_bytes = Counter(
            "tierckpt_parity_rebuild_bulk_bytes_total", "Bytes this node received over the bulk data channel while "
            "reconstructing lost ranks from parity (XOR: the chunks its protectors decoded, else the slots and the "
            "other members' chunks; Reed-Solomon: rows and data blocks).", registry=r)
        self.parity_decode_bulk_bytes = Counter(
            "tierckpt_parity_decode_bulk_bytes_total", "Bytes this node pulled over the bulk data channel to decode "
            "chunks of lost ranks for the nodes restoring them (OpenRebuiltChunk: XOR slots and Reed-Solomon rows it "
            "holds).",
            registry=r)
        self.restores = Counter(
            "tierckpt_restores_total", "Rank restores by source tier and result.", ["tier", "result"], registry=r)

    def _latencies(self, r: CollectorRegistry) -> None:
        self.commit_latency = Histogram(
            "tierckpt_commit_latency_seconds",
            "Local commit RPC time: verify staged shards, flush, publish the manifest.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.save_latency = Histogram(
            "tierckpt_save_latency_seconds",
            "Save time as seen by the daemon, from the begin-save request to the local commit.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.restore_latency = Histogram(
            "tierckpt_restore_latency_seconds", "Rank restore time by the tier it was served from.",
            ["tier"], buckets=LATENCY_BUCKETS, registry=r)

    def _background_tiers(self, r: CollectorRegistry) -> None:
        self.replication_latency = Histogram(
            "tierckpt_replication_latency_seconds",
            "Time from a local commit until the requested number of peer replicas is acknowledged.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.replication_lag = Gauge(
            "tierckpt_replication_lag_seconds",
            "Age of the oldest locally committed rank still short of its peer replicas (0 when none).",
            registry=r)
        self.replication_failures = Counter(
            "tierckpt_replication_failures_total", "Failed replication attempts, by target peer.",
            ["peer"], registry=r)

        self.drain_backlog_bytes = Gauge(
            "tierckpt_drain_backlog_bytes", "Bytes selected for the persistent tier and not yet uploaded.",
            registry=r)
        self.drain_oldest_age = Gauge(
            "tierckpt_drain_oldest_age_seconds",
            "Age of the oldest step waiting to be drained to the persistent tier (0 when none).", registry=r)
        self.drain_failures = Counter(
            "tierckpt_drain_failures_total", "Failed uploads to the persistent tier (each is retried).",
            registry=r)
        self.drained_bytes = Counter(
            "tierckpt_drained_bytes_total", "Bytes uploaded to the persistent tier, counted as they are sent.",
            registry=r)
        self.peer_up = Gauge(
            "tierckpt_peer_up", "1 if the last health check of a peer succeeded, else 0.", ["peer"], registry=r)
        self.tier_up = Gauge(
            "tierckpt_tier_up", "1 if a configured tier can do its work, 0 if it is degraded (e.g. the "
            "object store refuses the start-up probe: credentials, bucket, write permission).", ["tier"], registry=r)
        self.peer_calls = Counter(
            "tierckpt_peer_calls_total", "Control RPCs this daemon made to a peer (health, catalog deltas, "
            "replication, fetch), by peer: at scale only the ring neighbourhood should grow.", ["peer"], registry=r)

    def _local_tier(self, r: CollectorRegistry) -> None:
        self.local_capacity_bytes = Gauge(
            "tierckpt_local_capacity_bytes", "Bytes the local tier may hold (local_capacity).", registry=r)
        self.local_used_bytes = Gauge(
            "tierckpt_local_used_bytes", "Bytes held by the local tier, staging and replicas included, as charged "
            "against local_capacity (every file at least 4 KiB, every manifest its size with its metadata).",
            registry=r)
        self.local_free_bytes = Gauge(
            "tierckpt_local_free_bytes", "Capacity left in the local tier (capacity - used, >= 0).", registry=r)
        self.local_warm_bytes = Gauge(
            "tierckpt_local_warm_bytes",
            "Bytes of pre-allocated files in the local tier's recycle pool (part of used; dropped first).",
            registry=r)
        self.local_reserve_bytes = Gauge(
            "tierckpt_local_reserve_bytes", "Bytes of pre-touched memory the local tier holds for new files "
            "(local_reserve; part of used).", registry=r)
        self.local_reserve_taken_bytes = Gauge(
            "tierckpt_local_reserve_taken_bytes", "Shard bytes of saves and replicas that the reserve covered since "
            "start-up (a count that only grows while the daemon runs).", registry=r)

        self.checksum_failures = Counter(
            "tierckpt_checksum_failures_total",
            "Shard copies that failed checksum verification, by the tier they were read from.",
            ["tier"], registry=r)
        self.evictions = Counter(
            "tierckpt_evictions_total",
            "Steps removed from the local tier: retention = beyond keep_local, capacity = to make room, "
            "capacity_undrained = to make room, step held only by peers (never selected for the persistent tier).",
            ["reason"], registry=r)
        self.staging_reclaimed = Counter(
            "tierckpt_staging_reclaimed_total",
            "Uncommitted saves whose staging files were reclaimed after staging_timeout.", registry=r)
        self.local_quarantined = Counter(
            "tierckpt_local_quarantined_total",
            "Entries of the local dir set aside at start-up, not served: committed ranks failing a rule "
            "(a FIFO, socket, device or link where a manifest or data file should be, a wrong size, ...) "
            "moved to quarantine/, and non-directories under a top-level directory's name moved aside.",
            registry=r)

    def _zero_series(self) -> None:
        """Create every labelled series whose labels are known up front at zero (rate() sees the first event)."""
        for tier in TIERS:
            for metric in (self.saved_bytes, self.shared_bytes, self.restored_bytes, self.checksum_failures,
                           self.restore_latency):
                metric.labels(tier)
            for result in RESULTS:
                self.saves.labels(tier, result)
                self.restores.labels(tier, result)
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)

    def known_peers(self, peers: list[str]) -> None:
        """Create the per-peer series of known peers at zero."""
        for p in peers:
            self.replication_failures.labels(peer=p)
            self.peer_calls.labels(peer=p)

    def set_local_usage(self, capacity: int, used: int) -> None:
        """Update the three local-tier gauges together."""
        self.local_capacity_bytes.set(capacity)
        self.local_used_bytes.set(used)
        self.local_free_bytes.set(max(0, capacity - used))

    def render(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def start_http_server(self, host: str, port: int) -> int:
        """Serve /metrics from a daemon thread, bound to ``host``, with bounded threads, connections
        and time per connection (see :mod:`tierckptd.metrics_http`).

        Args:
            host: Address to bind (e.g. "127.0.0.1", "0.0.0.0", "::").
            port: TCP port; 0 picks a free one.

        Returns:
            The bound port.

        Raises:
            RuntimeError: Already serving.
            OSError: The address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("metrics HTTP server already started")
        from .httphealth import health_app
        from .metrics_http import BoundedMetricsServer

        server = BoundedMetricsServer(host, port, health_app(self.health, make_wsgi_app(self.registry)))
        self._server, self._thread = server, server.start()
        return int(server.server_address[1])

    def stop(self) -> None:
        """Stop the HTTP server, if started, and close its socket. Idempotent."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
