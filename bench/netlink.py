"""Network-bound benchmark mode: every daemon in its own Linux network namespace behind a
rate-limited link, as on a cluster whose NICs are the limit.

Why: on loopback every transfer is bound by memory bandwidth and the two shared cores, so a
protocol that moves more bytes in total (XOR parity moves about K times a rank's bytes to
rebuild it, spread over K links) looks K times slower even where, on a real cluster, each node's
link carries no more than a replica fetch's worth. Here each node ``nI`` gets a namespace joined
by a veth pair to a bridge in the root namespace; both ends of the pair are shaped by a token
bucket (``tc qdisc ... tbf``) to ``mbit``: the namespace end limits what the node sends, the root
end what it receives, so each node has a full-duplex link of that rate, as a NIC has.

The daemons listen (gRPC, bulk, /metrics) on their namespace's address; clients reach them over
their Unix sockets, which are files and so namespace-independent. Everything created is removed
on exit, exceptions and Ctrl-C included (:class:`NetLab` is a context manager; a SIGTERM is
turned into KeyboardInterrupt while it is open). Needs root (``CAP_NET_ADMIN``).

Usage from a bench::

    with NetLab(["n0", "n1"], mbit=800) as lab:
        print(lab.raw_rate("n0", "n1"))          # bytes/s over one link, measured
        d = lab.daemon(root, "n0", args=(...))   # a tierckptd.testing.Daemon inside n0's namespace
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierckptd.testing import Daemon

__all__ = ["NetLab", "NetDaemon", "require_root"]

SUBNET = "10.77"
"""The lab's addresses: node i is ``10.77.<tag>.<i + 1>``, the bridge ``.254``."""


def require_root() -> None:
    """A clear error instead of a half-built lab."""
    if os.geteuid() != 0:
        sys.exit("the network-bound mode (--link-mbit) needs root: it creates network namespaces, veth pairs "
                 "and tc qdiscs (run as root, or without --link-mbit for loopback)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


class NetDaemon(Daemon):
    """A daemon inside a namespace, listening on its namespace address (a fixed port: every node
    has its own address, so ports cannot clash)."""

    def __init__(self, root: Path, node_id: str, *, netns: str, host: str, port: int,
                 args: tuple[str, ...] = ()) -> None:
        super().__init__(root, node_id, port=port, args=args)
        self.netns, self.host = netns, host

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--listen")
        cmd[at + 1] = f"{self.host}:{self.port}"
        return ["ip", "netns", "exec", self.netns, *cmd]

    @property
    def tcp_address(self) -> str:
        return f"{self.host}:{self.port}"


class NetLab:
    """Namespaces, veth pairs, a bridge and shaping for ``nodes``, each link ``mbit`` Mbit/s in
    each direction."""

    PORT = 7100
    METRICS_PORT = 7200

    def __init__(self, nodes: list[str], mbit: float) -> None:
        if mbit <= 0:
            raise ValueError("mbit must be > 0")
        self.nodes, self.mbit = list(nodes), float(mbit)
        self.tag = os.getpid() % 200 + 1  # several labs at once (different benches) do not collide
        self.bridge = f"tckbr{self.tag}"
        self.ns = {n: f"tck{self.tag}-{n}" for n in self.nodes}
        self.host = {n: f"{SUBNET}.{self.tag}.{i + 1}" for i, n in enumerate(self.nodes)}
        self._veths: list[str] = []
        self._old_term = None

    # set up / tear down
    def __enter__(self) -> NetLab:
        require_root()
        self._old_term = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.{self.tag}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, n in enumerate(self.nodes):
            ns, outer = self.ns[n], f"tck{self.tag}v{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._veths.append(outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.host[n]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape(outer, None)  # what the node receives
            self._shape("eth0", ns)  # what it sends

    def _shape(self, dev: str, ns: str | None) -> None:
        """A token bucket on ``dev``'s egress. The burst holds at least a few GSO super-packets
        (64 KiB each on veth: a smaller bucket would drop them all) and a couple of ms of rate."""
        rate = self.mbit * 1e6 / 8
        burst = int(max(256 << 10, rate * 0.002))
        pre = ["-n", ns] if ns else []
        _tc(*pre, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.mbit:g}mbit", "burst", str(burst),
            "latency", "50ms")

    def close(self) -> None:
        """Remove everything this lab created (idempotent; errors ignored: half-built labs too)."""
        for outer in self._veths:  # the peer end goes with it
            _ip("link", "del", outer, check=False)
        self._veths.clear()
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # use
    def peers_flag(self) -> str:
        return ",".join(f"{n}={self.host[n]}:{self.PORT}" for n in self.nodes)

    def daemon(self, root: Path, node: str, args: tuple[str, ...] = ()) -> NetDaemon:
        """A daemon of ``node`` (not started) listening on its namespace address, /metrics too."""
        return NetDaemon(root, node, netns=self.ns[node], host=self.host[node], port=self.PORT,
                         args=(*args, "--metrics-host", self.host[node], "--metrics-port", str(self.METRICS_PORT)))

    def raw_rate(self, src: str, dst: str, mib: int = 32) -> float:
        """Bytes per second of one plain TCP copy of ``mib`` MiB from ``src``'s namespace to
        ``dst``'s: the link as shaped, what a daemon's transfer can at best reach."""
        port = self.PORT + 50
        recv = subprocess.Popen(["ip", "netns", "exec", self.ns[dst], sys.executable, "-c", _RECV,
                                 self.host[dst], str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout is not None
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError("raw receiver did not start")
            out = subprocess.run(["ip", "netns", "exec", self.ns[src], sys.executable, "-c", _SEND,
                                  self.host[dst], str(port), str(mib << 20)], check=True, capture_output=True,
                                 text=True, timeout=300)
            return float(out.stdout.strip())
        finally:
            recv.kill()
            recv.wait(10)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


_RECV = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); buf = memoryview(bytearray(4 << 20))
while c.recv_into(buf):
    pass
c.sendall(b"k")
"""

_SEND = """
import socket, sys, time
n = int(sys.argv[3]); data = memoryview(bytearray(4 << 20))
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.perf_counter(); left = n
while left:
    left -= s.send(data[:min(left, len(data))])
s.shutdown(socket.SHUT_WR); s.recv(1)
print(n / (time.perf_counter() - t0))
"""


if __name__ == "__main__":  # a quick check: python bench/netlink.py [MBIT]
    with NetLab(["n0", "n1"], float(sys.argv[1]) if len(sys.argv) > 1 else 800) as lab:
        t0 = time.perf_counter()
        r = lab.raw_rate("n0", "n1")
        print(f"raw link n0 -> n1: {r * 8 / 1e6:.0f} Mbit/s ({r / 1e6:.1f} MB/s), shaped to {lab.mbit:g} Mbit/s")
