"""Test-side name for :mod:`tierckptd.testing` (daemon subprocess launcher)."""

from __future__ import annotations

import time

from tierckptd.testing import _BIN_DIR, Daemon, free_port, scratch_dir  # noqa: F401


def wait_until(pred, timeout: float = 60.0, what: str = "condition", interval: float = 0.1):
    """Poll ``pred()`` until it returns something truthy (returned), or fail after ``timeout`` seconds
    (generous by default: a loaded 2-core machine runs the daemons behind)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    """n daemons that know each other (ports reserved before start)."""

    def __init__(self, factory, n: int, replicas: int = 1, extra: tuple[str, ...] = (), wait: bool = True,
                 metrics: bool = False) -> None:
        self.metrics = metrics
        self.factory = factory
        self.ids = [f"n{i}" for i in range(n)]
        self.ports = {i: free_port() for i in self.ids}
        peers = ",".join(f"{i}=127.0.0.1:{self.ports[i]}" for i in self.ids)
        self.args = ("--peers", peers, "--replicas", str(replicas), *extra)
        self.d: dict[str, Daemon] = {}
        for i in self.ids:
            self.start(i)
        for i in self.ids if wait else ():
            self.wait_peers(i)

    def start(self, node: str) -> Daemon:
        args = (*self.args, "--metrics-port", str(free_port())) if self.metrics else self.args
        self.d[node] = self.factory(node, port=self.ports[node], args=args)
        return self.d[node]

    def wait_peers(self, node: str, up: set[str] | None = None) -> None:
        want = set(self.ids) - {node} if up is None else up
        with self.d[node].client() as c:
            wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == want, what=f"{node} sees {want} up")

    def replace(self, node: str) -> Daemon:
        """kill -9, lose the local dir, start a new daemon with the same id and port."""
        self.d[node].kill()
        self.d[node].wipe()
        return self.start(node)

    def holders(self, node: str, job: str, step: int) -> dict[int, tuple[str, ...]]:
        with self.d[node].client() as c:
            for info in c.list(job):
                if info.step == step:
                    return {r.rank: r.nodes for r in info.ranks}
        return {}


