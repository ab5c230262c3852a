"""Longer variants of the fault matrix (``-m long``, ``make test-long``): a real network partition
between network namespaces, and repeated kill -9 of a daemon under continuous saving."""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tierckpt.errors import TierckptError
from tierckptd.testing import Daemon, free_port

from ..harness import Cluster, wait_until
from ..threads import Checked
from ._util import Checker, save
from .test_matrix import JOB, SIZES, knobs

pytestmark = pytest.mark.long


class NsDaemon(Daemon):
    """A daemon in a network namespace, listening on its veth address (reached by peers only)."""

    def __init__(self, *a, netns: str, ip: str, **kw) -> None:
        super().__init__(*a, **kw)
        self.netns, self.ip = netns, ip

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command(), "--listen", f"{self.ip}:{self.port}",
                "--insecure-listen"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_namespaces():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid() % 100000}"
    ns, veth = [f"tck{tag}a", f"tck{tag}b"], [f"tv{tag}a", f"tv{tag}b"]
    ips = ["10.77.0.1", "10.77.0.2"]
    steps = [("netns", "add", ns[0]), ("netns", "add", ns[1]),
             ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
             ("link", "set", veth[0], "netns", ns[0]), ("link", "set", veth[1], "netns", ns[1])]
    for i in (0, 1):
        steps += [("-n", ns[i], "addr", "add", f"{ips[i]}/24", "dev", veth[i]),
                  ("-n", ns[i], "link", "set", veth[i], "up"), ("-n", ns[i], "link", "set", "lo", "up")]
    try:
        for s in steps:
            r = _ip(*s)
            if r.returncode:
                pytest.skip(f"cannot set up network namespaces here (ip {' '.join(s)}: {r.stderr.strip()})")
        yield ns, veth, ips
    finally:
        for n in ns:
            _ip("netns", "del", n)


def test_network_partition_between_namespaces(two_namespaces, scratch: Path, matrix) -> None:
    ns, veth, ips = two_namespaces
    chk = Checker(matrix)
    ports = [free_port(), free_port()]
    peers = f"n0={ips[0]}:{ports[0]},n1={ips[1]}:{ports[1]}"
    ds = [NsDaemon(scratch, f"n{i}", port=ports[i], netns=ns[i], ip=ips[i],
                   args=("--peers", peers, "--replicas", "1", knobs())) for i in (0, 1)]
    try:
        for d in ds:
            d.start()
        with ds[0].client() as c:
            wait_until(lambda: any(p.up for p in c.status().peers), 60, "n1 up")
            save(c, JOB, 1, 0, SIZES).wait("peer", timeout=30)
            _ip("-n", ns[0], "link", "set", veth[0], "down")  # the partition
            fut = save(c, JOB, 2, 0, SIZES)
            chk.expect_error(lambda: fut.wait("peer", timeout=3))
            t0 = time.monotonic()
            c.latest(JOB)
            # README: nodes that do not answer within fanout_deadline (1.5 s here) are left out;
            # 30 s is room for a loaded machine, far below a wait on the partitioned peer.
            assert time.monotonic() - t0 < 30
            _ip("-n", ns[0], "link", "set", veth[0], "up")  # healed
            # The rounds under way may all have failed by now (a loaded machine's partition
            # outlasts the retries); the peer's return triggers another round either way.
            wait_until(lambda: any(i.step == 2 and "n1" in i.ranks[0].nodes for i in c.list(JOB)), 90,
                       "the replica of step 2 on n1 after the partition healed")
            assert fut.wait("peer", timeout=30) == ["n1"]
            for step in (1, 2):
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
        with ds[1].client() as c:
            assert {i.step for i in c.list(JOB)} >= {1, 2}
    finally:
        for d in ds:
            d.kill()


def test_repeated_kill9_under_continuous_saving(daemon_factory, matrix) -> None:
    chk = Checker(matrix)
    cl = Cluster(daemon_factory, 2, replicas=1, extra=(knobs(), "--keep-local", "400"))
    committed: list[int] = []
    rng = random.Random(7)
    step = 0
    for _ in range(8):
        stop = threading.Event()

        def trainer() -> None:
            nonlocal step
            with cl.d["n0"].client(timeout=10) as c:
                while not stop.is_set():
                    step += 1
                    try:
                        save(c, JOB, step, 0, SIZES)
                        committed.append(step)
                    except TierckptError:
                        return

        t = Checked(trainer)
        before = len(committed)
        t.start()
        wait_until(lambda: len(committed) > before or not t.is_alive(), 60, "a save committed in this round")
        time.sleep(rng.uniform(0.2, 1.5))  # not a wait: a random moment for the kill, under way saves
        cl.d["n0"].kill()
        stop.set()
        t.join(60)  # the trainer ended on a typed error or the stop (anything else is raised here)
        assert len(committed) > before, "no save committed in this round"
        cl.d["n0"].start()
    with cl.d["n0"].client() as c:
        for s in committed:
            assert chk.restore_ok(c, JOB, s, 0, SIZES)
        complete = {i.step for i in c.list(JOB) if i.complete}
        assert complete <= set(range(1, step + 1))
        assert set(committed) <= complete
