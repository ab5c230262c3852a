"""Entry point of ``tierckptd``: read the config, assemble the node, serve until SIGTERM.

Shutdown is staged: stop accepting saves, finish in-flight commits and tier work within
``shutdown_timeout``, stop the gRPC server with a grace period, exit 0. On start-up a line
``READY {json}`` on stdout gives the bound ports (tests and scripts read it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any, Sequence

from .config import ConfigError, DaemonConfig, parse_args

log = logging.getLogger("tierckptd")


def build_tiers(config: DaemonConfig, store, metrics, cluster=None) -> list:
    """The remote tiers configured, in restore order (peer, then persistent)."""
    tiers: list = []
    if cluster is not None:
        from .peer import PeerTier  # noqa: PLC0415 - optional part of the daemon

        tiers.append(PeerTier(config, store, cluster, metrics))
    if config.persistent:
        from .persistent import PersistentTier  # noqa: PLC0415

        tiers.append(PersistentTier(config, store, metrics, cluster=cluster))
    return tiers


def build_membership(config: DaemonConfig, metrics):
    """The cluster membership when peers are configured (else None: a single-node daemon)."""
    if not (config.peers or config.peers_dns):
        return None
    from .cluster.membership import Membership  # noqa: PLC0415

    source = None
    if config.tls_enabled:
        from .tls import reloader  # noqa: PLC0415

        source = reloader(config)
    return Membership(config, metrics, source)


async def serve(config: DaemonConfig, *, ready_out=None) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status."""
    from .metrics import Metrics
    from .sdnotify import Notifier, watchdog_loop

    notifier = Notifier.from_env(os.environ)
    metrics = Metrics()
    node = await _open_node(config, metrics)
    grpc_side = await _GrpcSide.start(config, node)
    metrics_port = metrics.start_http_server(config.metrics_host, config.metrics_port) if config.metrics_port else None
    info = {"node_id": config.node_id, "tcp_port": grpc_side.listening.tcp_port,
            "socket": grpc_side.listening.socket_path, "metrics_port": metrics_port, "pid": os.getpid(),
            "local_dir": node.local_dir}
    log.info("tierckptd %s ready: %s", config.node_id, json.dumps(info))
    out = ready_out or sys.stdout
    out.write("READY " + json.dumps(info) + "\n")
    out.flush()
    notifier.ready()

    def status_text() -> str:
        u = node.store.usage()
        return f"{u.used}/{u.capacity} bytes used, {node.store.open_saves()} saves open"

    wd = asyncio.create_task(watchdog_loop(notifier, status_text))
    await _signalled()
    log.info("shutdown: stop accepting saves")
    notifier.stopping()
    await grpc_side.set_serving(False)
    await node.stop(config.shutdown_timeout)
    log.info("shutdown: in-flight work finished; stopping gRPC server")
    await grpc_side.stop(min(5.0, config.shutdown_timeout))
    wd.cancel()
    metrics.stop()
    log.info("shutdown complete")
    return 0


async def _open_node(config: DaemonConfig, metrics):
    """Open the local store, build the cluster membership and tiers, start the node."""
    from .node import Node
    from .offload import run_blocking
    from .store import LocalStore

    node: Node | None = None

    def evicted(ev) -> None:  # the node is built below; evictions only start once it serves
        if node is not None:
            node.evicted(ev)

    cluster = build_membership(config, metrics)
    store = LocalStore(config.local_dir, config.node_id, capacity=config.local_capacity,
                       keep_local=config.keep_local, fsync=config.fsync, max_shard_bytes=config.max_shard_bytes,
                       max_open_saves=config.max_open_saves,
                       is_complete=cluster.is_complete if cluster else None, on_evict=evicted)
    await run_blocking(store.open)
    tiers = build_tiers(config, store, metrics, cluster)
    node = Node(store, tiers, node_id=config.node_id, staging_timeout=config.staging_timeout, metrics=metrics)
    await node.start()
    return node


class _GrpcSide:
    """The gRPC servers (Unix socket, TCP) and the health service."""

    SERVICES = ("", "tierckpt.v1.Tierckpt")

    def __init__(self, listening, health_servicer) -> None:
        self.listening, self.health = listening, health_servicer

    @classmethod
    async def start(cls, config: DaemonConfig, node) -> _GrpcSide:
        from grpc_health.v1 import health, health_pb2_grpc

        from .server import create_server

        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()

        def add_health(server) -> None:
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

        def add_tier_services(server) -> None:
            for t in node.tiers:
                t.add_to_server(server)

        creds = None
        if config.tls_enabled:
            from .tls import server_credentials

            creds = server_credentials(config)
        side = cls(await create_server(config, node, add_health, creds, add_tier_services), health_servicer)
        await side.set_serving(True)
        return side

    async def set_serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in self.SERVICES:
            await _maybe_await(self.health.set(svc, status))

    async def stop(self, grace: float) -> None:
        await self.listening.stop(grace)
        if self.listening.socket_path:
            try:
                os.unlink(self.listening.socket_path)
            except OSError:
                pass


async def _signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


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
    if config.knobs:
        from .knobs import KNOBS, parse_knobs

        KNOBS.apply(parse_knobs(config.knobs))
        log.warning("tuning knobs overridden: %s", config.knobs)
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
    except OSError as e:
        print(f"tierckptd: cannot start: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
