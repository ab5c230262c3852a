"""Entry point of ``tierckptd``: read the config, assemble the node, serve until SIGTERM.

Shutdown is staged: stop accepting saves, finish in-flight commits and tier work within
``shutdown_timeout``, stop the gRPC server with a grace period, exit 0. On start-up a line
``READY {json}`` on stdout gives the bound ports (tests and scripts read it; with
``log_format = "json"`` it is a JSON log record instead, see :func:`tierckptd.logs.ready_line`).
A start-up failure is one line on stderr naming the key or resource, exit 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .config import ConfigError, DaemonConfig, parse_args
from .redact import redact_text

log = logging.getLogger("tierckptd")


class StartupError(Exception):
    """Start-up failed for a reason that is not a configuration key; the message is one line."""


def build_tiers(config: DaemonConfig, store, metrics, cluster=None, backend=None) -> list:
    """The remote tiers configured, in restore order (peer, then persistent)."""
    tiers: list = []
    if cluster is not None:
        # replicas and parity: the daemon's redundancy is the default, a job's policy may choose
        from .parity.peertier import ParityPeerTier

        tiers.append(ParityPeerTier(config, store, cluster, metrics))
    if config.persistent:
        from .persistent import PersistentTier

        tiers.append(PersistentTier(config, store, metrics, cluster=cluster, backend=backend))
    return tiers


def _default_redundancy(config: DaemonConfig) -> str:
    """The daemon's ``redundancy`` in a job policy's terms (the effective policy of every job)."""
    return config.redundancy if config.parity else f"replicas:{config.replicas}"


def _no_peers(r: int, shape: tuple[int, int] | None) -> None:
    """A daemon without peers has no peer tier: a job's ``redundancy`` can only be replicas:0."""
    if r or shape:
        from tierckpt.errors import InvalidArgumentError

        raise InvalidArgumentError("policy.redundancy: this daemon has no peers (--peers): only replicas:0 applies")


def build_membership(config: DaemonConfig, metrics):
    """The cluster membership when peers are configured (else None: a single-node daemon)."""
    if not (config.peers or config.peers_dns):
        return None
    from .cluster.membership import Membership

    source = None
    if config.tls_enabled:
        from .tls import reloader

        source = reloader(config)
    return Membership(config, metrics, source)


async def serve(config: DaemonConfig, *, ready_out=None) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status.

    Raises:
        ConfigError: a start-up check failed; the message names the key (exit 2).
        StartupError: start-up failed otherwise; the message is one line (exit 2).
    """
    from .httphealth import heartbeat_loop
    from .metrics import Metrics
    from .sdnotify import Notifier, watchdog_loop

    notifier = Notifier.from_env(os.environ)
    metrics = Metrics()
    signing_warning = _configure_signing(config)
    try:
        node, grpc_side, metrics_port = await _start(config, metrics)
    except ConfigError:
        raise
    except Exception as e:  # anything else that stops start-up: still one line (the traceback at DEBUG)
        log.debug("start-up failed", exc_info=True)
        first = (redact_text(str(e)).splitlines() or [""])[0]
        raise StartupError(f"{type(e).__name__}: {first}".rstrip(": ")) from e
    info = {"node_id": config.node_id, "tcp_port": grpc_side.listening.tcp_port,
            "socket": grpc_side.listening.socket_path, "metrics_port": metrics_port, "pid": os.getpid(),
            "local_dir": node.local_dir}
    if signing_warning:  # once started: a refused start-up stays one line
        log.warning("%s", signing_warning)
    stop = _stop_event()  # before READY: a SIGTERM right after it must start the staged shutdown
    log.info("tierckptd %s ready: %s", config.node_id, json.dumps(info))
    from .logs import ready_line

    out = ready_out or sys.stdout
    out.write(ready_line(info, config.log_format) + "\n")
    out.flush()
    notifier.ready()

    def status_text() -> str:
        u = node.store.usage()
        return f"{u.charged}/{u.capacity} bytes used, {node.store.open_saves()} saves open"

    wd = asyncio.create_task(watchdog_loop(notifier, status_text))
    metrics.health.set_ready(True)
    beat = asyncio.create_task(heartbeat_loop(metrics.health))
    await stop.wait()
    log.info("shutdown: stop accepting saves")
    metrics.health.set_ready(False)
    notifier.stopping()
    await grpc_side.set_serving(False)
    await node.stop(config.shutdown_timeout)
    log.info("shutdown: in-flight work finished; stopping gRPC server")
    await grpc_side.stop(min(5.0, config.shutdown_timeout))
    wd.cancel()
    beat.cancel()
    metrics.stop()
    log.info("shutdown complete")
    return 0


def _configure_signing(config: DaemonConfig) -> str | None:
    """Load the cluster's manifest key (every manifest written is signed, every one read checked);
    returns the warning to log once started, if any."""
    from .local import signing

    if not config.manifest_key_file:
        signing.configure(signing.ManifestKey())
        return ("manifests are not signed (manifest_key_file is not set): anyone who can write the object store or "
                "the local dir can forge or edit a step; checksums catch corruption only")
    try:
        key = signing.load_key(config.manifest_key_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    signing.configure(signing.ManifestKey(key, accept_unsigned=config.accept_unsigned_manifests))
    if config.accept_unsigned_manifests:
        return ("accept_unsigned_manifests: steps written before manifest signing are read (tierckpt verify lists "
                "them); forged unsigned manifests are read too until this is turned off")
    return None


async def _start(config: DaemonConfig, metrics):
    """Claim the socket and the metrics port, open the node, serve gRPC, probe the tiers.

    Everything that can be checked before the local dir is touched is checked first; whatever
    was started is stopped again when a later step fails.
    """
    from .server import check_listen
    from .unixsock import claim_socket, resolve_group

    resolve_group(config.socket_group)
    if config.listen:
        check_listen(config.listen)
    claim = claim_socket(os.path.abspath(config.socket)) if config.socket else None
    node = None
    try:
        metrics_port = _start_metrics(config, metrics)
        node = await _open_node(config, metrics)
        grpc_side = await _GrpcSide.start(config, node, metrics, claim)
    except BaseException:
        if node is not None:
            await node.stop(1.0)
        metrics.stop()
        if claim is not None:
            claim.release()
        raise
    await grpc_side.probe_tiers(node)
    return node, grpc_side, metrics_port


def _start_metrics(config: DaemonConfig, metrics) -> int | None:
    if not config.metrics_port:
        return None
    try:
        return metrics.start_http_server(config.metrics_host, config.metrics_port)
    except OSError as e:
        raise ConfigError(f"metrics_port: cannot serve /metrics on {config.metrics_host}:{config.metrics_port}: "
                          f"{e.strerror or e}") from None


async def _open_node(config: DaemonConfig, metrics):
    """Open the local store, build the cluster membership and tiers, start the node."""
    from .local.policies import JobPolicies, JobPolicy
    from .local.store import LocalStore
    from .node import Node
    from .offload import run_blocking

    node: Node | None = None

    def evicted(ev) -> None:  # the node is built below; evictions only start once it serves
        if node is not None:
            node.evicted(ev)

    cluster = build_membership(config, metrics)
    store = LocalStore(config.local_dir, config.node_id, capacity=config.local_capacity, reserve=config.local_reserve,
                       keep_local=config.keep_local, fsync=config.fsync, max_shard_bytes=config.max_shard_bytes,
                       max_open_saves=config.max_open_saves, max_shards_per_save=config.max_shards_per_save,
                       max_metadata_bytes=config.max_metadata_bytes,
                       is_complete=cluster.is_complete if cluster else None, on_evict=evicted,
                       policies=JobPolicies(JobPolicy(
                           config.keep_local, config.keep_persistent, config.persist_every,
                           _default_redundancy(config) if cluster else None)))
    try:
        await run_blocking(store.open)
    except OSError as e:
        raise ConfigError(f"local_dir: cannot use {config.local_dir}: {e.strerror or e}"
                          + (f" ({e.filename})" if e.filename else "")) from None
    backend = await _open_backend(config) if config.persistent else None
    tiers = build_tiers(config, store, metrics, cluster, backend)
    if cluster is None:
        store.policies.check_redundancy = _no_peers
    node = Node(store, tiers, node_id=config.node_id, staging_timeout=config.staging_timeout, metrics=metrics)
    await node.start()
    return node


async def _open_backend(config: DaemonConfig):
    """The persistent tier's object store client, with the options of the configuration.

    A URL that cannot be opened at all (SDK missing, client refused) is fatal; an object store
    that refuses to work (credentials, bucket, permission) is found by the probe and degraded.
    """
    from .backends import BackendError, MissingExtraError, backend_options, open_backend
    from .offload import run_blocking

    try:
        return await run_blocking(lambda: open_backend(config.persistent, **backend_options(config)))
    except (MissingExtraError, BackendError) as e:
        raise ConfigError(f"persistent: {e}") from None


class _GrpcSide:
    """The gRPC servers (Unix socket, TCP), the health service and the tiers' health."""

    SERVICES = ("", "tierckpt.v1.Tierckpt")

    def __init__(self, health_servicer, tier_health) -> None:
        self.health, self.tier_health = health_servicer, tier_health
        self.listening: Any = None
        self._probes: list[asyncio.Task] = []

    @classmethod
    async def start(cls, config: DaemonConfig, node, metrics, claim=None) -> _GrpcSide:
        from grpc_health.v1 import health, health_pb2_grpc

        from .server import create_server
        from .tierhealth import TierHealth

        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        side = cls(health_servicer, None)
        side.tier_health = TierHealth(["local", *(t.name for t in node.tiers)], metrics, side._set)

        def add_health(server) -> None:
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

        def add_tier_services(server) -> None:
            for t in node.tiers:
                t.add_to_server(server)

        creds = None
        if config.tls_enabled:
            from .tls import server_credentials

            creds = server_credentials(config)
        side.listening = await create_server(config, node, add_health, creds, add_tier_services,
                                             tier_health=side.tier_health, socket_claim=claim)
        await side.set_serving(True)
        return side

    async def probe_tiers(self, node) -> None:
        """Probe the persistent tier in the background; wait a little for the first answer."""
        from .tierhealth import FIRST_PROBE_WAIT, probe_loop

        for tier in node.tiers:
            if not tier.needs_probe:
                continue
            first: asyncio.Future = asyncio.get_running_loop().create_future()
            self._probes.append(asyncio.create_task(probe_loop(self.tier_health, tier.name, tier.probe, first)))
            try:
                await asyncio.wait_for(asyncio.shield(first), FIRST_PROBE_WAIT)
            except TimeoutError:
                await self.tier_health.report(tier.name, f"no answer to the start-up probe within "
                                                         f"{FIRST_PROBE_WAIT:.0f} s (still trying)")

    async def _set(self, service: str, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await _maybe_await(self.health.set(service, status))

    async def set_serving(self, serving: bool) -> None:
        for svc in self.SERVICES:
            await self._set(svc, serving)
        await self.tier_health.serving(serving)

    async def stop(self, grace: float) -> None:
        for t in self._probes:
            t.cancel()
        await self.listening.stop(grace)  # removes the socket only if it is still ours


def _stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _maybe_await(x):
    if asyncio.iscoroutine(x):
        await x


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as e:
        print(f"tierckptd: config error: {e}", file=sys.stderr)
        return 2
    from .logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    from .tls import insecure_warning

    if (warning := insecure_warning(config)) is not None:
        log.warning("%s", warning)
    from .knobs import KNOBS, parse_knobs

    if config.knobs:
        KNOBS.apply(parse_knobs(config.knobs))
        log.warning("tuning knobs overridden: %s", config.knobs)
    if KNOBS.switch_interval > 0:  # a save's RPCs wait at most this for the GIL behind the drain's threads
        sys.setswitchinterval(KNOBS.switch_interval)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # uvloop is a [daemon] extra; asyncio's loop works, slower
        runner = asyncio.run
    try:
        return runner(serve(config))
    except ConfigError as e:
        print(f"tierckptd: config error: {e}", file=sys.stderr)
        return 2
    except StartupError as e:
        print(f"tierckptd: cannot start: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
