"""Tuning constants of the daemon, in one place.

These are not user configuration (that is :class:`tierckptd.config.DaemonConfig`); they are the
timings and limits of background work that a production cluster should not need to change. Tests
shorten them so that no test sleeps through a real grace period:

- in-process: ``with KNOBS.overridden(owner_grace=1.0): ...``
- daemons started as subprocesses: ``--knobs owner_grace=1,refresh_interval=0.2`` (or a
  ``knobs`` table in the TOML file); :func:`tierckptd.main.serve` applies them at start-up.

Code reads ``KNOBS.<name>`` at the moment it needs the value (never copies it at import time), so
an override takes effect everywhere at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .retry import RetryPolicy

__all__ = ["Knobs", "KNOBS"]


@dataclass
class Knobs:
    """Every tuning constant, with its default and what it governs."""

    # -- cluster membership and health
    refresh_interval: float = 1.0
    """Seconds between two health/catalog exchanges with a peer of the neighbourhood."""
    rpc_timeout: float = 5.0
    """Deadline of one control RPC to a peer."""
    owner_grace: float = 15.0
    """Seconds an owner must stay down before the first live holder of its ranks re-replicates them."""
    takeover_grace: float = 10.0
    """Seconds an owner must stay down before the first live holder of its selected ranks drains them."""
    takeover_check_interval: float = 1.0
    """Seconds between two looks at the owners of the copies this node holds (drain take-over)."""

    max_widen: int = 8
    """Down neighbours a node walks past on each side of the ring looking for live ones (bounds
    the neighbourhood when much of the cluster is down, e.g. while it starts)."""
    down_retry_max: float = 5.0
    """A down neighbour is asked again after a delay doubling from ``refresh_interval`` up to this."""
    fanout: int = 32
    """Peers asked at once by a cluster-wide question (``latest``/``list`` for operators, a fetch
    of a rank that no neighbour holds)."""
    fanout_deadline: float = 3.0
    """Seconds a cluster-wide question waits for answers; the nodes that did not answer are named."""

    # -- peer tier
    catch_up_interval: float = 30.0
    """Seconds between full checks that every owned rank in the retention window has its copies."""
    gc_interval: float = 5.0
    """Seconds between sweeps for surplus and retired replicas."""
    bulk_streams: int = max(2, min(4, (os.cpu_count() or 2) // 2))
    """Parallel bulk connections per rank transfer: Python socket throughput is CPU-bound on both
    ends, so more streams than half the cores only add contention (measured)."""
    min_piece: int = 32 << 20
    """A shard is split over several bulk connections only into pieces at least this large."""
    max_parallel_ranks: int = 4
    """Ranks replicated at once (each uses up to ``bulk_streams`` connections)."""
    max_fails_per_peer: int = 2
    """Failed attempts of one rank on one peer before placement skips that peer for the rank."""
    replicate_retry: RetryPolicy = RetryPolicy(initial_delay=0.25, max_delay=5.0, multiplier=2.0, max_attempts=6,
                                               deadline=None)
    """Backoff between replication attempts of a rank; after the last one, waiters get TierError."""
    bulk_max_connections: int = 64
    """Bulk connections served at once; one more is closed at once (its sender retries)."""
    bulk_max_per_source: int = 16
    """Bulk connections served at once from one source address (a flood from one host cannot
    take every slot: replication from the others goes on)."""
    bulk_first_request_timeout: float = 5.0
    """Seconds a new bulk connection has for the TLS handshake and its first request header."""
    bulk_idle_timeout: float = 15.0
    """Seconds a bulk connection may wait between requests before it is closed."""
    bulk_max_unauthenticated: int = 16
    """Bulk connections at once that have not authenticated yet (TLS handshake and node role
    checked, or, without TLS, a first request received); one more closes the oldest of them.
    Authenticated connections have their own ``bulk_max_connections`` slots, so idle or slow
    unauthenticated connections never take a peer's slot."""
    max_connection_age: float = 600.0
    """Seconds a gRPC connection to the TCP listener lives before the server closes it (GOAWAY;
    clients reconnect and handshake again): after a CA or certificate change or a revocation,
    no connection outlives this plus ``max_connection_age_grace``."""
    max_connection_age_grace: float = 30.0
    """Seconds calls in flight on a connection past its maximum age may still run."""
    read_ticket_ttl: float = 30.0
    """Seconds a bulk read ticket stays valid after its last use (it is also bound to the requester)."""
    commit_timeout: float = 60.0
    """Deadline of a CommitReplica RPC (the receiver verifies and commits the replica)."""
    parity_share_wait: float = 5.0
    """Seconds a parity protector holds an unchanged chunk's ProtectRank while the other members of
    its base slot/row claim theirs (all unchanged: the base parity is linked, nothing pulled);
    past it, they are pulled and encoded as new (:mod:`tierckptd.parity.share`)."""

    # -- persistent tier
    upload_threads: int = 8
    """Uploads in flight at once (chunks, per-shard objects; each S3 upload also splits into parts on
    the backend's pool)."""
    drain_nice: int = 19
    """Niceness of the persistent tier's drain threads (the drain reads, hashes, encodes and uploads
    chunks on them): saves and trainer threads come first on a busy node; 0: the daemon's."""
    drain_idle: int = 1
    """1: the drain threads run under ``SCHED_IDLE`` (Linux, per thread): they get a CPU only when
    nothing else of any process wants it, so a save's copy, its RPCs on the event loop and the
    trainer always win (a waking normal thread preempts them at once; nice 19 alone still takes
    a share and a slice). The drain then goes as fast as the cores left idle allow, and stalls on a
    node whose every core stays busy (measured in bench/README.md); 0: ``drain_nice`` only."""
    drain_processes: int = 1
    """1: the drain's reads, hashes and encodes run in child processes at ``SCHED_IDLE`` (one per
    codec slot, kept for the daemon's life; see :mod:`tierckptd.persistent.chunkproc`), not on the
    daemon's threads, so they never hold the daemon's GIL while a save's RPCs wait for it; 0: on
    the drain threads (``drain_idle``)."""
    drain_idle_grace: float = 10.0
    """Seconds a drain chunk worker (``drain_processes``) may take over one chunk at ``SCHED_IDLE``
    before the daemon lifts it to the normal policy at nice 19 for the rest of that
    chunk: on a node whose every core stays busy a ``SCHED_IDLE`` process gets almost no CPU, and
    a drain must still make progress (a chunk takes well under a second otherwise); time it spent
    stopped for a save (``drain_yield``) does not count. A call on a drain thread (an upload;
    with ``drain_processes=0`` also the codec) is lifted the same way after this long, then the
    thread goes back under ``SCHED_IDLE`` (``persistent.calls.Lifter``). An unprivileged
    daemon needs ``RLIMIT_NICE`` >= 1 for that (the systemd unit's ``LimitNICE=1``); refused, it
    warns and the chunk waits for idle CPU; 0: never."""
    codec_threads: int = max(2, os.cpu_count() or 2)
    """Chunks the drain reads, checks and encodes at once (default: one per core, at least 2), each
    on a drain thread (``drain_nice``): zstd, numpy and xxhash release the GIL, so the codec runs on
    as many cores as this (bench/drain_workers.py). A chunk keeps its slot until it is uploaded
    (``upload_threads`` at a time), so at most this many encoded chunks (about twice
    ``chunk_bytes`` each, with the chunk) wait in memory."""
    drain_yield: float = 2.0
    """Seconds at most the drain is held back at a time while a save is open or committing on this
    node (a trainer's, an inbound replica's or a restore's): saves come first. The drain's child
    processes (``drain_processes``) are stopped (``SIGSTOP``) the moment a save opens, wherever a
    chunk is, and continued when the last save leaves; its threads wait before each upload (and,
    without children, each chunk's read), and a ``file://`` store writes an upload out in 1 MiB
    pieces with a wait before each. A pause that reaches this limit is followed by at least as
    long a run, so a node whose saves never stop still drains half the time
    (:mod:`tierckptd.persistent.pause`). 0: the drain never waits. On the 2-core bench machine
    a 16 MiB save during a drain blocked a median 1.05x its time with no drain (28 runs,
    0.91-1.30x), against 1.26x with 0; with saves 50 ms apart the drain took a median 1.4x
    longer (bench/save_during_drain.py, bench/README.md "Session of 2026-12-07, 18:57 UTC")."""
    drain_resume_delay: float = 0.02
    """Seconds the drain stays paused (``drain_yield``) after the last save left the node: the
    commit's reply reaches the trainer, and a save that follows at once finds the drain still
    stopped, before the drain's processes run again. Within ``drain_yield``'s bound. 0: continued
    at once. Same-run pairs on the bench machine: a save during a drain 1.00-1.09x its time with
    no drain, against 1.03-1.37x with 0 (bench/README.md "Session of 2026-12-07, 18:57 UTC")."""
    switch_interval: float = 0.0
    """Seconds a Python thread holding the GIL keeps it while another waits for it
    (``sys.setswitchinterval``; Python's default is 0.005): the RPCs and commits of saves wait
    at most this for the GIL behind the drain's threads' Python code (bench/save_during_drain.py);
    0 (the default): Python's default. Not shown to help yet (bench/README.md)."""
    ranks_at_once: int = 4
    """Ranks drained concurrently; their shards share the upload threads."""
    read_threads: int = 16
    """Backend reads in flight at once (restore downloads, catalog listings, manifests)."""
    failed_retry_seconds: float = 60.0
    """Delay before a rank whose upload failed with a non-retryable error is tried again."""
    catalog_ttl: float = 2.0
    """Seconds a job's persistent catalog is reused, so ``latest()`` stays cheap."""
    catalog_wait: float = 5.0
    """Seconds a catalog question waits for a listing before answering from the previous one."""
    fetch_pace: float = 0.0
    """Tests only: seconds a restore's fetch from the persistent tier pauses after each shard, so
    that its progress (``RestoreProgress``) can be watched. 0 in production."""
    drain_retry: RetryPolicy = RetryPolicy(initial_delay=0.5, max_delay=30.0, deadline=None)
    """Retries of one upload while the store is throttling or unreachable (for as long as it lasts)."""
    read_retry: RetryPolicy = RetryPolicy(initial_delay=0.2, max_delay=5.0, deadline=60.0)
    """Retries of one download or manifest read."""
    catalog_retry: RetryPolicy = RetryPolicy(initial_delay=0.2, max_delay=1.0, max_attempts=3, deadline=5.0)
    """Retries of one catalog listing."""

    chunk_bytes: int = 8 << 20
    """Bytes per chunk of the persistent tier's content layout (the unit of deduplication)."""
    per_shard_layout: int = 0
    """1: drains write the per-shard layout even where ``persistent_layout = "content"`` is
    configured (tests of that layout's reader and fault handling; both layouts are always read)."""
    lease_ttl: float = 6 * 3600.0
    """Seconds a drain's lease protects the chunks it names from collection (a drain that has
    not published its manifest by half of this starts over with a new lease)."""
    gc_window: float = 60.0
    """Seconds a collection may delete chunks after it read the leases; a drain that finds a
    collection marker waits until the marker is gone or twice this has passed."""

    inbound_idle_timeout: float = 30.0
    """Seconds an inbound replica may go without a byte before it is dropped (a dead sender's
    partial copy is also dropped as soon as one of its bulk connections breaks)."""
    stale_tmp_seconds: float = 3600.0
    """A ``file://`` persistent tier's temporary upload files older than this are removed at
    start-up and every ``stale_tmp_interval`` (left by a daemon killed mid-upload)."""
    stale_tmp_interval: float = 600.0
    """Seconds between two sweeps for stale temporary upload files."""

    # -- test hooks (0 = off): pause at one point of a protocol so that a test can inject a fault there
    debug_begin_delay: float = 0.0
    """Seconds opening a staging area waits after creating it, before it is handed back."""
    debug_commit_delay: float = 0.0
    """Seconds a local commit waits after its data files are in place, before the manifest."""
    debug_drop_delay: float = 0.0
    """Seconds a DropReplicas call waits before it removes the replicas (and answers)."""
    debug_drain_delay: float = 0.0
    """Seconds a newly queued rank waits before its first upload attempt."""
    debug_manifest_delay: float = 0.0
    """Seconds a drain waits after its last shard upload, before the manifest."""
    debug_probe_interval: float = 0.0
    """Seconds between two probes of a tier, working or degraded, instead of
    ``tierhealth.RECHECK_SECONDS`` / ``RETRY_SECONDS`` (a test sees a tier go degraded and heal)."""

    # -- local tier
    warm_pool: int = 1
    """Pre-allocated pool files sized from the jobs' last saves (see :mod:`tierckptd.local.warm`): 1 where
    the local dir is tmpfs, 2 on any filesystem, 0 off. The thread runs at nice 19 and waits while
    the node is busy (a save open or committing, a peer transfer reading from here); a save that
    takes a warm file writes it like a fresh one (pwrite: its pages are allocated but not yet
    faulted in). Measured on a quiet machine: the second save of a job 0.12-0.16 s instead of
    0.24-0.32 s for 1 GiB, back-to-back saves unchanged."""
    warm_ahead: int = 1
    """Staging files of inbound replicas and restores allocated ahead of the writer: 1 where the
    local dir is tmpfs, 2 on any filesystem, 0 off."""
    warm_hint: int = 1
    """Pool files for a first inbound copy, allocated from the owner's WarmReplica hint while its
    trainer is still saving (see :mod:`tierckptd.local.warm`): 1 where the local dir is tmpfs, 2 on any
    filesystem, 0 off (the owner still sends hints; this node ignores them)."""
    warm_touch: int = -1
    """How warming allocates pages on tmpfs: 1 touches them (``MADV_POPULATE_WRITE``: each page is
    zeroed, so the memory behind it is really there), 0 fallocates them (nothing is written until
    the file's writer comes), -1 touches only where the kernel hands free memory back to a
    hypervisor (virtio-balloon free page reporting): there a fallocated page is backed again by
    the host on its first write (3-4.5 s per GiB measured in such a VM), so only touching warms it.
    Elsewhere fallocate is the cheaper choice and equally warm."""
    warm_reserve: float = 0.2
    """Warming leaves this share of the local dir's filesystem free and, on tmpfs, of the
    machine's memory available, whatever the store's capacity (other daemons or programs may
    share them): warm pages are an optimisation and never the reason a machine runs out."""
    warm_hint_timeout: float = 2.0
    """Seconds an owner waits for a WarmReplica answer (a hint: failures are only logged)."""
    warm_idle_poll: float = 0.5
    """Seconds between the pool-warming thread's checks while the node is busy (a safety net: the
    end of a save or transfer wakes it)."""
    warm_min_bytes: int = 1 << 20
    """Smaller files are never warmed (a few pages: creating the file costs more than it saves)."""
    warm_chunk: int = 8 << 20
    """Bytes allocated per step by the warming threads (each step holds the file's lock)."""
    reserve_extent: int = 64 << 20
    """Size of the files the reserve (``local_reserve``, see :mod:`tierckptd.local.reserve`) is
    filled with; a shard up to twice this size takes one whole, any other size is covered too
    (see there). Evicted files that refill it keep their own sizes."""

    # -- /metrics over HTTP (see :mod:`tierckptd.metrics_http`)
    metrics_http_workers: int = 4
    """Threads answering /metrics requests; an idle connection holds none (it waits in a selector)."""
    metrics_http_max_connections: int = 32
    """Connections to /metrics held at once; one more closes the oldest idle one (or, when every
    held one is being answered, is closed itself)."""
    metrics_http_timeout: float = 10.0
    """Seconds a /metrics connection may take from its accept to the end of its answer (an idle
    one is closed then; one sending its request slowly is cut off)."""
    health_beat_interval: float = 1.0
    """Seconds between the event loop's heartbeats that /healthz reads (:mod:`tierckptd.httphealth`)."""
    health_stale_after: float = 30.0
    """/healthz answers 503 once the loop's last heartbeat is this many seconds old (a stuck loop)."""

    # -- node
    restore_pin_seconds: float = 60.0
    """A step fetched from a remote tier is kept from retention this long after the restore."""
    stream_chunk: int = 4 << 20
    """Bytes per message when a shard is streamed over gRPC (clients without the shared dir)."""

    def names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def apply(self, values: Mapping[str, Any]) -> None:
        """Set knobs from strings or numbers (the ``--knobs`` flag / ``knobs`` TOML table).

        Raises:
            ValueError: an unknown name, or a value of the wrong kind (the message names it).
        """
        for name, raw in values.items():
            if name not in self.names():
                raise ValueError(f"knobs: unknown knob {name!r} (known: {', '.join(self.names())})")
            current = getattr(self, name)
            if isinstance(current, RetryPolicy):
                raise ValueError(f"knobs.{name}: retry policies are set in code (KNOBS.overridden)")
            try:
                value = type(current)(raw)
            except (TypeError, ValueError):
                raise ValueError(f"knobs.{name}: expected {type(current).__name__}, got {raw!r}") from None
            if value < 0:
                raise ValueError(f"knobs.{name}: must not be negative")
            setattr(self, name, value)

    @contextlib.contextmanager
    def overridden(self, **values: Any) -> Iterator[Knobs]:
        """Override knobs for the duration of a ``with`` block (tests)."""
        old = {k: getattr(self, k) for k in values}
        for k, v in values.items():
            if k not in self.names():
                raise ValueError(f"knobs: unknown knob {k!r}")
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)


KNOBS = Knobs()
"""The process's knobs. Read attributes when needed; never copy them at import time."""


def parse_knobs(text: str) -> dict[str, str]:
    """``"a=1,b=2.5"`` -> ``{"a": "1", "b": "2.5"}`` (the ``--knobs`` flag).

    Raises:
        ValueError: an item is not NAME=VALUE.
    """
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"knobs: {item!r} is not NAME=VALUE")
        out[name.strip()] = value.strip()
    return out
